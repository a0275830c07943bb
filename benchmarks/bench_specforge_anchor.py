"""SpecForge 0.2.0's own offline EAGLE-3 training step, driven at bench_train_step.py's dimensions on the
same random inputs: the same-run anchor that every training-speed claim is a ratio to (issue 22).

What runs is SpecForge's code end to end, as its trainer assembles it for an offline run
(specforge/training/trainer.py + training/assembly.py + algorithms/model_providers.py, 0.2.0):
`LlamaForCausalLMEagle3` (bf16, frozen embedding, t2d/d2t vocab buffers) inside `OnlineEagle3Model`
(TTT unroll, its Triton soft-CE `LogSoftmaxLoss`), wrapped by `FSDPTrainingBackend.prepare_model`
(FSDP SHARD_GRAD_OP with bf16 mixed precision, here over a one-rank process group, as a one-GPU
`torchrun` launch gets), the `BF16Optimizer` (fp32 master copies, AdamW, clip 0.5, cosine warm-up schedule),
`Eagle3TrainStrategy` (0.8^k step weights; teacher from the frozen `TargetHead` over the stored last hidden
state: the full-vocabulary logits by default, `compact_teacher` = its draft-vocab rows + a streamed
log-sum-exp), and one `TrainerCore.train_step` per timed step (forward + loss, backward, optimizer).
Only the inputs are this script's: random weights, a `TargetHead` built from a written config.json instead
of a checkpoint, and the batch `bench_train_step.make_batch` gives this project's step (aux states ->
`hidden_state`, last state -> `target`, the same loss mask).

Needs SpecForge 0.2.0 importable (`pip install --no-deps specforge==0.2.0`: its model, loss, optimizer and
trainer core import with torch, transformers, huggingface_hub and triton) and CUDA: its loss is a Triton
kernel. `unavailable()` says why not, so the caller reports a skip instead of failing.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

DEFAULTS = dict(attention_backend="flex_attention", compact_teacher=False, fsdp=True)  # SpecForge 0.2.0's
# config defaults (config/schema.py: training.attention_backend, training.compact_teacher; trainer.py wraps)


def unavailable(device: torch.device) -> str | None:
    """None when the anchor can run here, else the one-line reason."""
    if device.type != "cuda":
        return "SpecForge's loss (specforge/core/loss.py LogSoftmaxLoss) is a Triton GPU kernel: the anchor runs on CUDA only"
    try:
        import specforge  # noqa: F401
        from importlib.metadata import version

        v = version("specforge")
    except Exception as e:  # noqa: BLE001 - any import failure means: no anchor, say why
        return f"SpecForge is not importable ({type(e).__name__}: {e}); pip install --no-deps specforge==0.2.0"
    if v != "0.2.0":
        return f"SpecForge {v} installed; the anchor is pinned to 0.2.0"
    return None


def _one_rank_group(device: torch.device) -> bool:
    """FSDP needs a process group; SpecForge's launcher always makes one (torchrun). Returns True when
    this call created it (so `close` destroys it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


class SpecForgeStep:
    """SpecForge's trainer core for one offline EAGLE-3 run at `dims` (bench_train_step's dict: hidden,
    heads, kv_heads, head_dim, intermediate, draft_vocab, vocab), with draft vocabulary `draft_ids`
    (the same sorted target ids this project's benchmark maps, so t2d/d2t match)."""

    def __init__(self, dims: dict, ttt: int, device: torch.device, draft_ids: torch.Tensor, *, max_len: int,
                 attention_backend: str = DEFAULTS["attention_backend"],
                 compact_teacher: bool = DEFAULTS["compact_teacher"], fsdp: bool = DEFAULTS["fsdp"], lr: float = 5e-5):
        from transformers import LlamaConfig

        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from specforge.modeling.target.target_head import TargetHead
        from specforge.optimizer import BF16Optimizer
        from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
        from specforge.training.controller import TrainerCore
        from specforge.training.strategies.base import Eagle3TrainStrategy

        self.settings = dict(attention_backend=attention_backend, compact_teacher=compact_teacher, fsdp=fsdp)
        self.device = device
        self.owns_group = _one_rank_group(device) if fsdp else False
        H, V, DV = dims["hidden"], dims["vocab"], dims["draft_vocab"]
        cfg = LlamaConfig(
            architectures=["LlamaForCausalLMEagle3"], hidden_size=H, intermediate_size=dims["intermediate"],
            num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"],
            vocab_size=V, draft_vocab_size=DV, target_hidden_size=H, num_hidden_layers=1, rms_norm_eps=1e-5,
            max_position_embeddings=max_len, hidden_act="silu", tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        torch.manual_seed(0)
        with torch.device(device):  # random init on the device (a K2-size drafter is 2.4B values with its embedding)
            draft = LlamaForCausalLMEagle3(cfg, attention_backend=attention_backend)
        ids = draft_ids.to(device)
        t2d = torch.zeros(V, dtype=torch.bool, device=device)
        t2d[ids] = True
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(ids - torch.arange(ids.numel(), device=device))
        draft.freeze_embedding()
        draft = draft.to(device=device, dtype=torch.bfloat16)  # model_providers.build_eagle3_draft
        model = OnlineEagle3Model(draft_model=draft, length=ttt, attention_backend=attention_backend).to(
            device=device, dtype=torch.bfloat16)

        self._tmp = tempfile.TemporaryDirectory(prefix="sf-target-")
        (Path(self._tmp.name) / "config.json").write_text(json.dumps(
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "vocab_size": V,
             "intermediate_size": dims["intermediate"], "num_attention_heads": dims["heads"],
             "num_key_value_heads": dims["kv_heads"], "num_hidden_layers": 1}))
        with torch.device(device):
            head = TargetHead(self._tmp.name)  # what TargetHead.from_pretrained builds, minus the checkpoint read
        with torch.no_grad():
            head.fc.weight.normal_(0.0, 0.02)
        head.freeze_weights()
        head = head.eval().to(device=device, dtype=torch.bfloat16)

        steps = 10_000
        backend = FSDPTrainingBackend(ParallelConfig.from_distributed(), optimizer_factory=lambda m: BF16Optimizer(
            m, lr=lr, max_grad_norm=0.5, total_steps=steps, warmup_ratio=0.015, lr_scheduler="cosine"))
        wrapped = backend.prepare_model(model, wrap=fsdp, optimizer_target=model.draft_model)
        strategy = Eagle3TrainStrategy(wrapped, target_head=head, ploss_decay=0.8, compact_teacher=compact_teacher)
        self.core = TrainerCore(strategy, backend, accumulation_steps=1)
        self.trainable = sum(p.numel() for p in model.draft_model.parameters() if p.requires_grad)

    def batch(self, b: dict):
        """A SpecForge `TrainBatch` of this project's benchmark batch (keys of bench_train_step.make_batch):
        aux [B, T, 3H] -> hidden_state, last [B, T, H] -> target (stored last hidden state), same ids and mask."""
        from specforge.runtime.contracts import TrainBatch

        ids = b["input_ids"]
        return TrainBatch(
            sample_ids=[f"bench-{i}" for i in range(ids.shape[0])], strategy="eagle3",
            tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": b["loss_mask"].long(),
                     "hidden_state": b["aux"], "target": b["last"]},
            metadata={"target_repr": "hidden_state"})

    def step(self, batch) -> float:
        """One optimizer step of SpecForge's trainer core; returns the loss it reports."""
        return float(self.core.train_step(batch).loss)

    def close(self) -> None:
        import torch.distributed as dist

        self.core = None
        self._tmp.cleanup()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def time_steps(sf: SpecForgeStep, batch_dict: dict, iters: int, warmup: int) -> dict:
    """Median wall time of `iters` SpecForge steps after `warmup` (device synchronised around each step,
    as bench_train_step times this project's), with peak allocated / reserved memory over them."""
    device = sf.device
    batch = sf.batch(batch_dict)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], float("nan")
    for i in range(warmup + iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = sf.step(batch)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    tokens = batch_dict["input_ids"].numel()
    step = statistics.median(times)
    out = {"step_s": round(step, 5), "tokens_per_s": round(tokens / step, 1), "loss": loss}
    if cuda:
        out["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    return out
