"""A tiny, learnable training world for the train-stage tests (private helper of tests/test_train*.py).

Inputs in the stage layout: `capture/{train,validation}` hidden-state stores written with the real
HiddenStateWriter, `vocab/vocab.safetensors` + manifests, and an "old relative" drafter directory
with a *different* draft vocab (init=aqmedai_k2 must remap it). The target is the conftest's
`tiny_k25_target` (Kimi-K2.5 layout), whose lm_head rows are the teacher.

The toy is learnable: tokens follow a fixed successor rule inside the draft vocab, the stored
`last` state points at the next token's lm_head row (so the teacher is peaked on it and the
stored target argmax is computed exactly from the full head), and aux encodes the current token.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3.aux_layers import sglang_default_hf_indices
from eagle3.drafter_io import save_drafter_dir
from eagle3.init_drafter import build_training_drafter
from eagle3.manifest import write_manifest
from eagle3.store import HiddenStateWriter
from eagle3.target_io import load_lm_head_rows, read_text_config
from eagle3.vocab_map import d2t_from_ids, t2d_from_ids

DRAFT_V = 48


def write_world(root: Path, target: Path, n_train: int = 24, n_val: int = 8, seed: int = 0) -> dict:
    root = Path(root)
    text = read_text_config(target, "kimi_k25")
    V, H, L = int(text["vocab_size"]), int(text["hidden_size"]), int(text["num_hidden_layers"])
    g = torch.Generator().manual_seed(seed)
    vocab_ids = torch.sort(torch.randperm(V - 16, generator=g)[:DRAFT_V] + 8).values  # sorted target ids
    d2t, t2d = d2t_from_ids(vocab_ids), t2d_from_ids(vocab_ids, V)
    head = load_lm_head_rows(target, "kimi_k25").float()                           # [V, H]
    hf_indices = sglang_default_hf_indices(L)
    E = torch.randn(V, 3 * H, generator=g)                                         # aux encoding of a token
    succ = torch.randperm(DRAFT_V, generator=g)                                    # successor rule

    def sequence(n: int):
        j = int(torch.randint(0, DRAFT_V, (1,), generator=g))
        idx = []
        for _ in range(n):
            idx.append(j)
            j = int(succ[j])
        x = vocab_ids[torch.tensor(idx)]
        nxt = torch.cat([x[1:], vocab_ids[succ[idx[-1]]].view(1)])
        last = 4.0 * head[nxt] / head[nxt].norm(dim=-1, keepdim=True) * H ** 0.5 + 0.1 * torch.randn(n, H, generator=g)
        argmax = (last @ head.t()).argmax(-1)
        mask = torch.ones(n, dtype=torch.uint8)
        mask[:2] = 0
        aux = E[x] + 0.1 * torch.randn(n, 3 * H, generator=g)
        return x, mask, aux, last, argmax

    capture = root / "capture"
    for split, count in (("train", n_train), ("validation", n_val)):
        w = HiddenStateWriter(capture / split, hidden_size=H, target_hidden_size=H, hf_indices=hf_indices,
                              dtype="bfloat16", shard_tokens=200,
                              meta={"split": split})
        for i in range(count):
            n = int(torch.randint(12, 40, (1,), generator=g))
            x, m, aux, last, am = sequence(n)
            w.add(f"{split}-{i}", x, m, aux, last, am)
        w.finish()
    write_manifest(capture, "capture", {"toy": True}, target={
        "path": str(target), "layout": "kimi_k25", "num_hidden_layers": L, "hidden_size": H, "vocab_size": V,
        "config_sha256": hashlib.sha256((Path(target) / "config.json").read_bytes()).hexdigest()},
        hf_indices=hf_indices)
    vocab = root / "vocab"
    vocab.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": d2t, "t2d": t2d, "counts": torch.zeros(V, dtype=torch.int64)}, str(vocab / "vocab.safetensors"))
    write_manifest(vocab, "vocab", {"toy": True})
    # The old relative's drafter: same shapes, a draft vocab that overlaps the new one by half.
    old_ids = torch.sort(torch.cat([vocab_ids[: DRAFT_V // 2], torch.arange(V - 8 - DRAFT_V // 2, V - 8)])).values
    old, _ = build_training_drafter("scratch", None, target, "kimi_k25", old_ids, hf_indices=hf_indices)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for p in old.midlayer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    old_dir = save_drafter_dir(old, root / "old-drafter", dtype=torch.bfloat16)
    return {"capture": capture, "vocab": vocab, "old_drafter": old_dir, "target": Path(target),
            "vocab_ids": vocab_ids, "hf_indices": hf_indices}


def overrides(world: dict, out_dir: Path, init: str = "scratch", **extra) -> list[str]:
    """Hydra overrides of conf/train.yaml for a fast CPU run on the toy world."""
    base = {
        "paths.root": str(Path(out_dir).parent / "root"), "target": "k25_mini", "target.path": str(world["target"]),
        "target.k2_drafter": str(world["old_drafter"]), "capture_dir": str(world["capture"]),
        "vocab_dir": str(world["vocab"]), "out_dir": str(out_dir), "ttt_length": 3, "max_steps": 12,
        "data.max_tokens_per_batch": 160, "data.max_length": 40, "data.bucket_window": 8,
        "optim.lr": 3e-3, "optim.warmup_steps": 2, "log_every": 2, "checkpoint_every": 4, "keep_checkpoints": 2,
        "val_accept_sequences": 0, "wandb.mode": "disabled", "progress": False, "cpu": True,
    }
    base.update(extra)
    return [f"+init={init}"] + [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in base.items()]


def test_toy_world_is_consistent(tmp_path, tiny_k25_target):
    """The toy's stored target argmax is the teacher's top token and mostly inside the draft vocab."""
    from eagle3.loss import loss_positions
    from eagle3.store import HiddenStateStore

    world = write_world(tmp_path, tiny_k25_target, n_train=4, n_val=2)
    store = HiddenStateStore(world["capture"] / "train")
    head = load_lm_head_rows(tiny_k25_target, "kimi_k25").float()
    item = store[0]
    full = item["last"].float() @ head.t()
    assert torch.equal(full.argmax(-1), item["target_argmax"])
    t2d = t2d_from_ids(world["vocab_ids"], head.shape[0])
    valid = loss_positions(item["loss_mask"][None], item["target_argmax"][None], t2d)
    assert valid.float().mean() > 0.5
    # the next token is what the target predicts (a learnable successor rule)
    assert (item["target_argmax"][:-1] == item["input_ids"][1:]).float().mean() > 0.9
