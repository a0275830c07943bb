"""The train stage: `run_train(config) -> out_dir` (what `train/run.py` and tests call).

One CPU process, one GPU, or `accelerate launch` (DDP; `fsdp=true` for FSDP). Per optimizer step
each rank takes `grad_accum` token-budget micro-batches of its shard (train/data.py); each step's
loss is normalised by the valid-position counts of the WHOLE optimizer step over all ranks
(eagle3/unroll.py), so the update does not depend on how the tokens were split. AdamW (fused on
CUDA), warmup + cosine, grad clipping; bf16 autocast on GPU.

Restartable: checkpoints every `checkpoint_every` steps (train/checkpoint.py, atomic) hold the
weights, optimizer, scheduler, RNG and data position; rerunning the same command resumes from the
newest one; a finished run whose manifest matches config and inputs is reused as is. A non-finite
loss stops the run naming the step and its sequences (or, with on_nonfinite=skip, drops that
update and counts it); nothing is written for that step.

Test hook: env EAGLE3_FAULT_KILL_AFTER_STEP=N SIGKILLs the process right after optimizer step N
(after that step's checkpoint, if any): a real crash at a known point, for resume tests.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object

from eagle3.conf import as_plain_dict
from eagle3.errors import StageError
from eagle3.manifest import MANIFEST, read_manifest, sha256_file, write_manifest
from eagle3.unroll import TTTObjective, step_position_counts
from train import checkpoint as ckpt
from train.data import BatchStream, make_loader
from train.engine import (full_model_state, full_optimizer_state, load_optimizer_state, make_accelerator,
                          make_optimizer, make_scheduler, mixed_precision, uses_fsdp)
from train.inputs import TrainInputError, open_inputs
from train.metrics import MetricsLogger
from train.model_setup import build_drafter, drafter_from_state, write_drafter_dir
from train.prefetch import DevicePrefetcher
from train.progress import StepStats, progress_bar
from train.validate import run_validation, simulated_accept_length

log = logging.getLogger(__name__)
FINAL = "final"
# Config keys that may change between a run and its resumption (length, logging, I/O knobs).
RESUMABLE_CHANGES = ("max_steps", "epochs", "log_every", "val_every", "val_max_batches", "checkpoint_every",
                     "keep_checkpoints", "progress", "wandb", "on_nonfinite", "max_nonfinite_skips")


class NonFiniteLossError(StageError, RuntimeError):
    """The loss or gradient norm became NaN/inf; the message names the step and its sequences."""


def run_key(config, fingerprints: dict, world_size: int) -> dict:
    """What must be equal for a checkpoint to be resumed by this config."""
    cfg = as_plain_dict(config)
    for k in RESUMABLE_CHANGES:
        cfg.pop(k, None)
    cfg["data"] = {k: v for k, v in cfg["data"].items() if k not in ("num_workers", "verify")}
    return {"config": cfg, "inputs": fingerprints, "world_size": world_size}


def _finished_run_matches(out: Path, config, fingerprints: dict) -> bool:
    if not (out / MANIFEST).is_file() or not (out / FINAL / "config.json").is_file():
        return False
    try:
        m = read_manifest(out, "train")
    except Exception:
        return False
    same_inputs = {k: v["fingerprint"] for k, v in m.get("inputs", {}).items()} == fingerprints
    return same_inputs and m.get("config") == as_plain_dict(config) and m.get("init_fingerprint") == _init_fp(config)


def _init_fp(config) -> str | None:
    path = config.init.drafter_path
    if config.init.name == "scratch" or not path:
        return None
    f = Path(path) / "model.safetensors"
    return sha256_file(f) if f.is_file() else None


def total_steps(config, stream: BatchStream) -> tuple[int, int]:
    """(total optimizer steps, optimizer steps per epoch)."""
    per_epoch = max(1, -(-stream.batches_per_epoch() // config.grad_accum))
    candidates = [s for s in (config.max_steps, None if config.epochs is None else config.epochs * per_epoch) if s]
    return min(candidates), per_epoch


def run_train(config) -> Path:
    out = Path(config.out_dir)
    accelerator = make_accelerator(config)
    main = accelerator.is_main_process
    fsdp = uses_fsdp(accelerator)
    if config.fsdp and not fsdp and main:
        print(f"[train] fsdp=true but accelerate runs {accelerator.distributed_type} here (FSDP needs several "
              f"GPUs): training without sharding")
    inputs = open_inputs(config)
    for w in inputs.warnings:
        log.warning(w)
    if _finished_run_matches(out, config, inputs.fingerprints):
        if main:
            print(f"[train] {out} already holds a finished run with this config and inputs: reused")
        return out
    t_start = time.time()
    drafter, report = build_drafter(config, inputs)  # compatibility checks run inside, before any work
    key = run_key(config, inputs.fingerprints, accelerator.num_processes)
    ckpt_root = out / "checkpoints"
    resume = _find_resume_point(ckpt_root, key, main)
    if resume is not None:
        drafter_from_state(drafter, resume["model"])
    torch.manual_seed(config.seed + 1000 * accelerator.process_index)
    lm_head_rows = report.pop("lm_head_rows").to(accelerator.device)
    device = accelerator.device
    if mixed_precision(config) == "bf16" and not fsdp:
        drafter.embed_tokens.to(torch.bfloat16)  # frozen and bf16 in the target anyway: half the memory

    objective = accelerator.prepare(TTTObjective(drafter, config.ttt_length, config.step_decay,
                                                 impl=config.unroll, compile=_use_compile(config, device),
                                                 attention_kernel=config.attention_kernel))
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = accelerator.prepare(make_optimizer(params, config.optim, device))
    stream = BatchStream(inputs.train.lengths, config.data.max_tokens_per_batch, config.data.max_length, config.seed,
                         accelerator.process_index, accelerator.num_processes, config.data.bucket_window)
    total, per_epoch = total_steps(config, stream)
    epoch_batches = stream.batches_per_epoch()
    scheduler, warmup = make_scheduler(optimizer, config.optim, total)
    step, position, skipped, tokens_seen, prior_s, first_val, last_val = 0, 0, 0, 0, 0.0, None, None
    if resume is not None:
        load_optimizer_state(objective, optimizer, resume["optimizer"], fsdp)
        scheduler.load_state_dict(resume["scheduler"])
        ckpt.restore_rng(resume["rng"][accelerator.process_index] if isinstance(resume["rng"], list) else resume["rng"])
        step, position, skipped = resume["step"], resume["position"], resume["nonfinite_skips"]
        tokens_seen, prior_s = resume["tokens_seen"], resume["elapsed_s"]
        first_val, last_val = resume.get("val_start"), resume.get("val_last")
        if resume["total_steps"] != total and main:
            print(f"[train] total steps changed {resume['total_steps']} -> {total}: the LR schedule continues for {total}")
    if main and resume is None and (out / MANIFEST).exists():
        (out / MANIFEST).unlink()  # a stale manifest must not vouch for this (unfinished) run
    metrics = MetricsLogger(out, enabled=main, wandb_conf=config.wandb, run_config=as_plain_dict(config),
                            resume_step=None if resume is None else step)
    try:
        if main:
            print(f"[train] init={config.init.name} on {accelerator.num_processes} process(es), {device}, "
                  f"precision={mixed_precision(config)}, {_wrapper_name(accelerator)}; "
                  f"{len(inputs.train):,} train sequences, {per_epoch} steps/epoch, {total} steps (warmup {warmup})"
                  + (f"; resumed at step {step}" if resume else ""))

        def validate(at_step: int) -> dict | None:
            if inputs.val is None:
                return None
            res = run_validation(accelerator, objective, inputs.val, lm_head_rows, config, progress=config.progress and main)
            if main and config.val_accept_sequences and not fsdp:
                res["accept_length"] = simulated_accept_length(accelerator.unwrap_model(objective).drafter, inputs.val,
                                                               config.val_accept_sequences)
            metrics.log(at_step, res, kind="val")
            return res

        def save(at_step: int) -> None:
            model_state = full_model_state(accelerator, objective)
            optim_state = full_optimizer_state(accelerator, objective, optimizer, fsdp)
            rngs = gather_object([ckpt.rng_state()]) if accelerator.num_processes > 1 else [ckpt.rng_state()]
            if main:
                state = {"step": at_step, "position": position, "total_steps": total, "optimizer": optim_state,
                         "scheduler": scheduler.state_dict(), "rng": rngs, "run_key": key, "nonfinite_skips": skipped,
                         "tokens_seen": tokens_seen, "elapsed_s": prior_s + time.time() - t_start,
                         "val_start": first_val, "val_last": last_val}
                ckpt.save_checkpoint(ckpt_root, at_step, lambda d: write_drafter_dir(drafter, model_state, d), state,
                                     config.keep_checkpoints)
            accelerator.wait_for_everyone()

        if resume is None:
            first_val = validate(step)  # the init's own accuracy, the baseline the run must beat
        workers = config.data.num_workers if config.data.num_workers >= 0 else (4 if device.type == "cuda" else 0)
        loader = DevicePrefetcher(make_loader(inputs.train, stream, position, config.data.max_length, workers,
                                              pin_memory=device.type == "cuda"), device)
        stats = StepStats(config.ttt_length, device, config.step_decay)
        bar = progress_bar(total, step, enabled=config.progress and main)
        objective.train()
        kill_after = int(os.environ.get("EAGLE3_FAULT_KILL_AFTER_STEP", "0") or 0)
        t2d = drafter.t2d.cpu()
        vocab_size = t2d.numel()
        while step < total:
            # counts and id checks on the host copies (no device sync); one micro-batch on the device at a time
            hosts = loader.peek_hosts(config.grad_accum)
            if len(hosts) < config.grad_accum:  # the batch stream repeats epochs: only a broken reader ends
                raise RuntimeError(f"step {step + 1}: the batch reader ended after {position + len(hosts)} micro-batches")
            position += len(hosts)
            denom = sum(step_position_counts(h["loss_mask"], h["target_argmax"], t2d, config.ttt_length) for h in hosts)
            denom = accelerator.reduce(denom.to(device), reduction="sum")
            # accelerate divides by grad_accum and DDP averages over ranks: undo both, the loss is already global.
            scale = float(config.grad_accum * accelerator.num_processes)
            losses = []
            for _ in hosts:
                host, mb = next(loader)
                _check_ids(host, vocab_size, inputs.train.dir, step + 1)
                with accelerator.accumulate(objective):
                    try:
                        res = objective(mb, lm_head_rows, step_denominators=denom)
                    except ValueError as e:
                        raise TrainInputError(f"step {step + 1}: batch of sequences {mb['ids']}: {e}") from e
                    accelerator.backward(res.loss * scale)
                losses.append(res.loss.detach())
                stats.add_micro(res, host)
            grad_norm = accelerator.clip_grad_norm_(params, config.optim.grad_clip) if config.optim.grad_clip > 0 else \
                torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
            # One small all-reduce per step: any rank non-finite, and the step's real tokens over all ranks.
            bad = (~torch.isfinite(torch.stack(losses).sum() + grad_norm)).float()
            flags = accelerator.reduce(torch.stack([bad, torch.tensor(float(stats.window_tokens()), device=device)]),
                                       reduction="sum")
            if bool(flags[0] > 0):
                where = _nonfinite_report(step + 1, hosts, losses, grad_norm)
                optimizer.zero_grad(set_to_none=True)
                if config.on_nonfinite == "stop":
                    raise NonFiniteLossError(f"{where}; stopped without writing a checkpoint (newest intact one in "
                                             f"{ckpt_root}); set on_nonfinite=skip to drop such updates instead")
                skipped += 1
                log.warning("%s: update skipped (%d so far)", where, skipped)
                if skipped > config.max_nonfinite_skips:
                    raise NonFiniteLossError(f"{skipped} non-finite updates (> max_nonfinite_skips={config.max_nonfinite_skips}); "
                                             f"last: {where}")
                stats.reset()
                continue
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += int(flags[1])
            stats.end_step(float(grad_norm))
            bar.update(1)
            if step % config.log_every == 0 or step == total:
                row = stats.summary(accelerator, lr=scheduler.get_last_lr()[0], epoch=position / max(1, epoch_batches))
                metrics.log(step, row)
                bar.set_postfix(loss=f"{row['loss_weighted']:.3f}", acc0=f"{row['acc'][0]:.3f}")
            t_aside = time.perf_counter()
            if (config.val_every and step % config.val_every == 0) or step == total:
                last_val = validate(step)  # before the checkpoint, which records it
            if step % config.checkpoint_every == 0 or step == total:
                save(step)
            stats.exclude(time.perf_counter() - t_aside)
            if kill_after and step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
        bar.close()
        if main:
            _write_final(out, drafter, full_model_state(accelerator, objective), config, inputs, report, step, total,
                         tokens_seen, skipped, prior_s + time.time() - t_start, first_val, last_val, stream, metrics)
        else:
            full_model_state(accelerator, objective)
    finally:
        metrics.close()  # also on errors: the wandb run and metrics file are closed cleanly
    accelerator.wait_for_everyone()
    return out


def _use_compile(config, device: torch.device) -> bool:
    """compile=auto: on GPU only (Inductor's CPU compile takes minutes and the CPU path is small)."""
    choice = str(config.compile).lower()
    return device.type == "cuda" if choice == "auto" else choice == "true"


def _wrapper_name(accelerator) -> str:
    """'single process', 'MULTI_CPU' (DDP over gloo), 'MULTI_GPU' (DDP over NCCL), 'FSDP'."""
    name = str(accelerator.distributed_type).split(".")[-1]
    return "single process" if name == "NO" else name


def _find_resume_point(ckpt_root: Path, key: dict, main: bool):
    if main:
        gone = ckpt.remove_partial_checkpoints(ckpt_root)
        if gone:
            print(f"[train] removed unfinished checkpoint writes: {gone}")
    latest = ckpt.latest_checkpoint(ckpt_root)
    if latest is None:
        return None
    state = ckpt.load_training_state(latest[1])
    if state["run_key"] != key:
        diff = _key_diff(state["run_key"], key)
        raise ckpt.CheckpointError(f"{latest[1]} was written by a run with other settings ({diff}); use another "
                                   f"out_dir, or delete {ckpt_root} to start over")
    state["model"] = ckpt.read_checkpoint_weights(latest[1])
    if main:
        print(f"[train] resuming from {latest[1]}")
    return state


def _key_diff(a, b, prefix="") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        parts = [_key_diff(a.get(k), b.get(k), f"{prefix}{k}.") for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        return "; ".join(p for p in parts if p)
    return f"{prefix.rstrip('.')}: {a!r} -> {b!r}"


def _check_ids(batch: dict, vocab_size: int, store_dir, step: int) -> None:
    """Token ids outside the target vocab mean a store tokenized for another target (CPU tensors: cheap)."""
    for key in ("input_ids", "target_argmax"):
        top = int(batch[key].max())
        if top >= vocab_size or int(batch[key].min()) < 0:
            raise TrainInputError(f"step {step}: {key} of sequences {batch['ids']} in {store_dir} holds id {top}, "
                                  f"outside the target vocab of {vocab_size}: the store was captured with another "
                                  f"tokenizer/target than this vocab and drafter")


def _nonfinite_report(step: int, window: list, losses: list, grad_norm) -> str:
    bad = [i for i, l in enumerate(losses) if not torch.isfinite(l)]
    if bad:
        i = bad[0]
        return (f"non-finite loss ({float(losses[i])}) at step {step}, micro-batch {i} (sequences {window[i]['ids']})")
    return f"non-finite gradient norm ({float(grad_norm)}) at step {step} (sequences {[mb['ids'] for mb in window]})"


def _write_final(out, drafter, model_state, config, inputs, report, step, total, tokens, skipped, seconds,
                 first_val, final_val, stream, metrics) -> None:
    tmp = out / f".tmp-{FINAL}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_drafter_dir(drafter, model_state, tmp)
    ckpt.write_file_index(tmp, step)  # the export verifies final/ against it
    if (out / FINAL).exists():
        shutil.rmtree(out / FINAL)
    os.rename(tmp, out / FINAL)
    summary = {"steps": step, "total_steps": total, "tokens_seen": tokens, "nonfinite_skips": skipped,
               "wall_s": round(seconds, 2), "val_start": first_val, "val_end": final_val,
               "padding_efficiency": stream_padding_efficiency(inputs.train.lengths, stream),
               "truncated_sequences": sum(1 for n in inputs.train.lengths if n > config.data.max_length)}
    metrics.summary({k: v for k, v in summary.items() if not isinstance(v, dict)})
    write_manifest(out, "train", config, inputs={"capture": Path(config.capture_dir), "vocab": Path(config.vocab_dir)},
                   init_fingerprint=_init_fp(config), init_report=report, final=str(out / FINAL),
                   wandb_dir=metrics.wandb_dir, hf_indices=inputs.train.hf_indices,
                   aux_layers=inputs.train.manifest.get("aux_provenance"), **summary)
    print(f"[train] done: {step} steps, {tokens:,} tokens in {seconds:.1f}s; final drafter {out / FINAL}")


def stream_padding_efficiency(lengths, stream: BatchStream) -> float:
    """Real tokens / padded tokens over one epoch's batches (1.0 = no padding)."""
    clipped = [min(n, stream.max_length) for n in lengths]
    real = padded = 0
    for b in stream.epoch_batches(0):
        real += sum(clipped[i] for i in b)
        padded += len(b) * max(clipped[i] for i in b)
    return round(real / max(1, padded), 4)
