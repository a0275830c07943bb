"""One training run as a small Trainer with named parts (in the spirit of torchtitan's Trainer):

  setup       (__init__) the init drafter, the resume point, objective/optimizer/schedule, counters
  data        the batch loader from this rank's current position (reader thread + device prefetch)
  step        one optimizer step over `grad_accum` micro-batches, with the non-finite policy
  validate    held-out loss/accuracy (+ simulated accept length), logged
  checkpoint  an atomic checkpoint of everything a resume needs (train/checkpointing.py)
  finish      `final/` (drafter dir + file index) and the stage manifest
  run         the loop that ties them: validate the init, then step / log / validate / checkpoint

Each step's loss is normalised by the valid-position counts of the WHOLE optimizer step over all ranks
(eagle3/ttt/unroll.py), so the update does not depend on how the tokens were split. A non-finite loss
stops the run naming the step and its sequences (or, with on_nonfinite=skip, drops that update and
counts it); nothing is written for that step. After each applied step the loop fires the test hook
point `train.after_step` (eagle3/hooks.py; nothing is installed outside tests).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from accelerate.utils import gather_object

from eagle3 import hooks
from eagle3.errors import StageError
from eagle3 import fingerprints as fp
from eagle3.drafter.image_embeddings import rows_problem
from eagle3.formats.manifest import MANIFEST
from eagle3.ttt.unroll import TTTObjective, step_position_counts
from train import checkpointing as ckpt
from train.batches import BatchStream, WindowedStream, make_loader
from train.colocation import check_colocation
from train.distributed import (clip_gradients, full_model_state, full_optimizer_state, load_optimizer_state,
                               make_optimizer, make_scheduler, optimizer_name, optimizer_step)
from train.inputs import TrainInputError
from train.metrics import MetricsLogger
from train.model_setup import build_drafter, drafter_from_state, write_drafter_dir
from train.prefetch import DevicePrefetcher
from train.progress import StepStats, progress_bar
from train.setup import TrainSetup
from train.spool_source import SpoolStore, StoreWindows, live_postfix, sized_streams
from train.validate import run_validation, simulated_accept_length

log = logging.getLogger(__name__)
FINAL = "final"


class NonFiniteLossError(StageError, RuntimeError):
    """The loss or gradient norm became NaN/inf; the message names the step and its sequences."""


@dataclass
class RunCounters:
    """The loop's counters: what a checkpoint records besides weights/optimizer/schedule/RNG."""
    step: int = 0                  # optimizer steps applied
    position: int = 0              # micro-batches this rank has taken from its batch stream
    nonfinite_skips: int = 0
    tokens_seen: int = 0           # real tokens, all ranks
    prior_s: float = 0.0           # wall seconds of the runs this one continues
    val_start: Optional[dict] = None  # validation of the init (step 0): the baseline the run must beat
    val_last: Optional[dict] = None

    @classmethod
    def from_state(cls, state: dict) -> "RunCounters":
        return cls(state["step"], state["position"], state["nonfinite_skips"], state["tokens_seen"],
                   state["elapsed_s"], state.get("val_start"), state.get("val_last"))


class Trainer:
    """A run set up to start or to resume (by `train/stage.py` `run_train`, after its reuse check);
    `run()` trains to the last step and publishes `final/` through `stage` (eagle3/stage_dir.py).
    `setup`: what the run reads of its config and of where it runs, once (train/setup.py)."""

    def __init__(self, setup: TrainSetup, inputs, stage):
        config, accelerator = setup.config, setup.accelerator
        self.config, self.acc, self.inputs, self.resolved, self.stage = config, accelerator, inputs, setup.resolved, stage
        self.out, self.main, self.fsdp, self.device = setup.out, setup.main, setup.fsdp, setup.device
        self.t_start = time.time()
        self.image_embeddings = setup.resolved["image_embeddings"]  # what image rows feed the drafter
        for store in (inputs.train, inputs.val):  # fused needs the stores' fused rows (a vLLM capture has none)
            if store is not None and (problem := rows_problem(self.image_embeddings, store, config.image_embeddings)):
                raise TrainInputError(problem)
        # the model: the init drafter (checked against the inputs inside, before any work), or the checkpoint's
        self.drafter, self.report = build_drafter(config, inputs)
        self.ckpt_root = self.out / "checkpoints"
        self.key, resume = ckpt.resume_point(self.ckpt_root, setup.plain, inputs.fingerprints, setup.world, self.main)
        self.resumed = resume is not None
        if resume is not None:
            drafter_from_state(self.drafter, resume["model"])
        torch.manual_seed(config.seed + 1000 * setup.rank)
        self.lm_head_rows = self.report.pop("lm_head_rows").to(self.device)
        if setup.resolved["precision"] == "bf16" and not self.fsdp:
            self.drafter.embed_tokens.to(torch.bfloat16)  # frozen and bf16 in the target anyway: half the memory
        self.objective = accelerator.prepare(TTTObjective(
            self.drafter, config.ttt_length, config.step_decay, impl=setup.resolved["unroll"],
            compile=setup.resolved["compile"], attention_kernel=config.attention_kernel,
            image_embeddings=self.image_embeddings, image_token_id=inputs.train.image_token_id))
        self.params = [p for p in self.objective.parameters() if p.requires_grad]
        # the card holds trainer and producer: checked before the optimizer's state exists (a refusal costs nothing)
        self.colocation = check_colocation(
            config.data.producer_gpu_fraction, sum(p.numel() for p in self.params), self.drafter.config.hidden_size,
            config.data.max_tokens_per_batch, self.device, self.main)
        # the data: what stream positions index (the store, or a spool), this rank's stream, the steps it gives
        self.items = stream_items(config, inputs)
        self.spool = self.items if isinstance(self.items, SpoolStore) else None
        # and what the schedule is sized on: for windows the planned lengths (a stream's skips end it a little early)
        self.stream, self.sizing = sized_streams(setup.stream, self.items, setup.rank, setup.world)
        self.total, self.per_epoch = total_steps(config, self.sizing)
        self.epoch_batches = self.sizing.batches_per_epoch()
        self.stream_ended_at: Optional[int] = None
        # the optimization: warmup + cosine over the steps the data gives
        self.optimizer = accelerator.prepare(make_optimizer(self.params, config.optim, self.device))
        self.scheduler, self.warmup = make_scheduler(self.optimizer, config.optim, self.total)
        self.counters = RunCounters()
        self._released_windows = 0
        if resume is not None:  # the checkpoint's optimizer and schedule state, RNG and counters
            load_optimizer_state(self.objective, self.optimizer, resume["optimizer"], self.fsdp)
            self.scheduler.load_state_dict(resume["scheduler"])
            rng = resume["rng"]
            ckpt.restore_rng(rng[self.acc.process_index] if isinstance(rng, list) else rng)
            self.counters = RunCounters.from_state(resume)
            if resume["total_steps"] != self.total and self.main:
                print(f"[train] total steps changed {resume['total_steps']} -> {self.total}: the LR schedule continues "
                      f"for {self.total}")
        if self.main and resume is None and (self.out / MANIFEST).exists():
            (self.out / MANIFEST).unlink()  # a stale manifest must not vouch for this (unfinished) run
        self.t2d = self.drafter.t2d.cpu()  # id checks and loss denominators on host copies (no device sync)
        self.metrics = MetricsLogger(self.out, enabled=self.main, wandb_conf=config.wandb, run_config=setup.plain,
                                     resume_step=self.counters.step if self.resumed else None)

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> Path:
        c = self.counters
        try:
            if self.main:
                print(f"[train] init={self.config.init.name} on {self.acc.num_processes} process(es), {self.device}, "
                      f"precision={self.resolved['precision']}, {_wrapper_name(self.acc)}; "
                      f"{len(self.inputs.train):,} train sequences, {self.per_epoch} steps/epoch, {self.total} steps "
                      f"(warmup {self.warmup})" + (f"; resumed at step {c.step}" if self.resumed else ""))
            if not self.resumed:
                c.val_start = self.validate(c.step)
            loader = self.data()
            self.stats = StepStats(self.config.ttt_length, self.device, self.config.step_decay)  # tokens/s from here
            bar = progress_bar(self.total, c.step, enabled=self.config.progress and self.main)
            self.objective.train()
            while c.step < self.total and self.stream_ended_at is None:
                if not self.step(loader):
                    continue  # a skipped non-finite update, or the end of a windowed stream
                bar.update(1)
                self._after_step(bar)
                hooks.fire(hooks.TRAIN_AFTER_STEP, step=c.step)
            bar.close()
            if self.stream_ended_at is not None:  # the data ran out before the planned last step
                if self.main:
                    print(f"[train] the stream ended at step {c.step} (skipped samples: fewer batches than planned)")
                c.val_last = self.validate(c.step)
                self.checkpoint(c.step)
            self.finish()
        finally:
            self.metrics.close()  # also on errors: the wandb run and metrics file are closed cleanly
        self.acc.wait_for_everyone()
        return self.out

    def _after_step(self, bar) -> None:
        """Log, validate, checkpoint at their intervals (and at the last step); their time is not
        counted in tokens/s."""
        cfg, c, last = self.config, self.counters, self.counters.step == self.total
        if c.step % cfg.log_every == 0 or last:
            row = self.stats.summary(self.acc, lr=self.scheduler.get_last_lr()[0],
                                     epoch=c.position / max(1, self.epoch_batches))
            live = self.spool.live() if self.spool is not None and self.main else None
            if live is not None:  # capture tok/s, spool occupancy, both sides' idle share (wandb: stream/*)
                row["stream"] = live
            self.metrics.log(c.step, row)
            bar.set_postfix(loss=f"{row['loss_weighted']:.3f}", acc0=f"{row['acc'][0]:.3f}",
                            tok_s=f"{row['tokens_per_s']:,.0f}", **(live_postfix(live) if live else {}))
        t_aside = time.perf_counter()
        if (cfg.val_every and c.step % cfg.val_every == 0) or last:
            c.val_last = self.validate(c.step)  # before the checkpoint, which records it
        window_closed = self.spool is not None and self.stream.windows_done(c.position) > self._released_windows
        if c.step % cfg.checkpoint_every == 0 or last or window_closed:  # a closed window's chunks wait for one
            self.checkpoint(c.step)
        self.stats.exclude(time.perf_counter() - t_aside)

    # ---- the parts ------------------------------------------------------------------------------
    def data(self) -> DevicePrefetcher:
        """This rank's batches from its current position; on GPU a reader thread fills pinned memory
        and a side stream copies ahead."""
        cfg = self.config
        return DevicePrefetcher(make_loader(self.items, self.stream, self.counters.position, cfg.data.max_length,
                                            self.resolved["loader_workers"], pin_memory=self.device.type == "cuda"),
                                self.device)

    def step(self, loader: DevicePrefetcher) -> bool:
        """One optimizer step over `grad_accum` micro-batches (one on the device at a time). False
        when the update was non-finite and skipped (on_nonfinite=skip); raises on `stop`."""
        cfg, c, acc = self.config, self.counters, self.acc
        hosts = loader.peek_hosts(cfg.grad_accum)  # counts and id checks on the host copies
        if len(hosts) < cfg.grad_accum and isinstance(self.stream, WindowedStream):
            self.stream_ended_at = c.step  # a windowed stream ends with its data (a tail < grad_accum unused)
            return False
        if len(hosts) < cfg.grad_accum:  # the batch stream repeats epochs: only a broken reader ends
            raise RuntimeError(f"step {c.step + 1}: the batch reader ended after {c.position + len(hosts)} micro-batches")
        c.position += len(hosts)
        denom = sum(step_position_counts(h["loss_mask"], h["target_argmax"], self.t2d, cfg.ttt_length) for h in hosts)
        denom = acc.reduce(denom.to(self.device), reduction="sum")  # [K] valid positions of the whole step
        # accelerate divides by grad_accum and DDP averages over ranks: undo both, the loss is already global.
        scale = float(cfg.grad_accum * acc.num_processes)
        losses = []
        for _ in hosts:
            host, mb = next(loader)
            _check_ids(host, self.t2d.numel(), self.inputs.train.dir, c.step + 1)
            with acc.accumulate(self.objective):
                try:
                    res = self.objective(mb, self.lm_head_rows, step_denominators=denom)
                except ValueError as e:
                    raise TrainInputError(f"step {c.step + 1}: batch of sequences {mb['ids']}: {e}") from e
                acc.backward(res.loss * scale)
            losses.append(res.loss.detach())
            self.stats.add_micro(res, host)
        grad_norm = clip_gradients(acc, self.optimizer, self.params, cfg.optim.grad_clip, self.fsdp) \
            if cfg.optim.grad_clip > 0 else \
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None]))
        # One small all-reduce per step: any rank non-finite, and the step's real tokens over all ranks.
        bad = (~torch.isfinite(torch.stack(losses).sum() + grad_norm)).float()
        flags = acc.reduce(torch.stack([bad, torch.tensor(float(self.stats.window_tokens()), device=self.device)]),
                           reduction="sum")
        if bool(flags[0] > 0):
            self._drop_update(_nonfinite_report(c.step + 1, hosts, losses, grad_norm))
            return False
        optimizer_step(self.optimizer)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        c.step += 1
        c.tokens_seen += int(flags[1])
        self.stats.end_step(float(grad_norm))
        return True

    def _drop_update(self, where: str) -> None:
        """A non-finite step: stop (default) or, with on_nonfinite=skip, drop it and count it."""
        cfg, c = self.config, self.counters
        self.optimizer.zero_grad(set_to_none=True)
        if cfg.on_nonfinite == "stop":
            raise NonFiniteLossError(f"{where}; stopped without writing a checkpoint (newest intact one in "
                                     f"{self.ckpt_root}); set on_nonfinite=skip to drop such updates instead")
        c.nonfinite_skips += 1
        log.warning("%s: update skipped (%d so far)", where, c.nonfinite_skips)
        if c.nonfinite_skips > cfg.max_nonfinite_skips:
            raise NonFiniteLossError(f"{c.nonfinite_skips} non-finite updates (> max_nonfinite_skips="
                                     f"{cfg.max_nonfinite_skips}); last: {where}")
        self.stats.reset()

    def validate(self, at_step: int) -> Optional[dict]:
        """Validation of the current weights, logged as a `val` row (None without a validation store)."""
        if self.inputs.val is None:
            return None
        res = run_validation(self.acc, self.objective, self.inputs.val, self.lm_head_rows, self.config,
                             progress=self.config.progress and self.main)
        if self.main and self.config.val_accept_sequences and not self.fsdp:
            res["accept_length"] = simulated_accept_length(self.acc.unwrap_model(self.objective).drafter,
                                                           self.inputs.val, self.config.val_accept_sequences,
                                                           self.image_embeddings)
        self.metrics.log(at_step, res, kind="val")
        return res

    def checkpoint(self, at_step: int) -> None:
        """Checkpoint `at_step` (collective: every rank gathers; rank 0 writes)."""
        c = self.counters
        model_state = full_model_state(self.acc, self.objective)
        optim_state = full_optimizer_state(self.acc, self.objective, self.optimizer, self.fsdp)
        rngs = gather_object([ckpt.rng_state()]) if self.acc.num_processes > 1 else [ckpt.rng_state()]
        if self.main:
            state = {"step": at_step, "position": c.position, "total_steps": self.total, "optimizer": optim_state,
                     "scheduler": self.scheduler.state_dict(), "rng": rngs, "run_key": self.key,
                     "nonfinite_skips": c.nonfinite_skips, "tokens_seen": c.tokens_seen,
                     "elapsed_s": self._elapsed(), "val_start": c.val_start, "val_last": c.val_last}
            ckpt.save_checkpoint(self.ckpt_root, at_step, lambda d: write_drafter_dir(self.drafter, model_state, d,
                                                                                    self.image_embeddings),
                                 state, self.config.keep_checkpoints)
        self.acc.wait_for_everyone()
        self._release()

    def _release(self, everything: bool = False) -> None:
        """Spool only, after a checkpoint: each rank frees the chunks of the windows it has finished (a resume
        starts at this checkpoint or later, so it never needs them); rank 0 deletes what every rank freed."""
        if self.spool is None:
            return
        done = self.stream.windows_done(self.counters.position)
        self.spool.release(self.acc.process_index, None if everything else done * self.config.data.window_sequences)
        self._released_windows = done
        self.acc.wait_for_everyone()
        if self.main:
            self.spool.reclaim(self.acc.num_processes)

    def finish(self) -> None:
        """`final/` (staged, then published with the stage manifest); rank 0 writes, every rank takes part
        in gathering the weights."""
        model_state = full_model_state(self.acc, self.objective)
        self._release(everything=True)  # the last checkpoint is written: nothing of the stream is needed again
        if not self.main:
            return
        c, out, seconds = self.counters, self.out, self._elapsed()
        with self.stage.staging() as tmp:
            write_drafter_dir(self.drafter, model_state, tmp / FINAL, self.image_embeddings)
            ckpt.write_file_index(tmp / FINAL, c.step)  # the export verifies final/ against it
            self._publish(tmp, seconds)
        print(f"[train] done: {c.step} steps, {c.tokens_seen:,} tokens in {seconds:.1f}s; final drafter {out / FINAL}")

    def _publish(self, tmp: Path, seconds: float) -> None:
        """final/ swapped in from `tmp`, then the stage manifest."""
        cfg, c, out = self.config, self.counters, self.out
        train = self.inputs.train
        summary = {"steps": c.step, "total_steps": self.total, "tokens_seen": c.tokens_seen,
                   "nonfinite_skips": c.nonfinite_skips, "wall_s": round(seconds, 2), "val_start": c.val_start,
                   "val_end": c.val_last, "padding_efficiency": stream_padding_efficiency(self.items.lengths, self.sizing),
                   "truncated_sequences": sum(1 for n in train.lengths if n > cfg.data.max_length),
                   "numerics": {"unroll": self.resolved["unroll"], "compile": self.resolved["compile"],
                                "optimizer": optimizer_name(self.optimizer),
                                "mixed_precision": self.resolved["precision"], "device": str(self.device)},
                   "data_order": {"source": cfg.data.source, "order": cfg.data.resolved_order(),
                                  **({"window_sequences": cfg.data.window_sequences, "reuse": cfg.data.reuse,
                                      "stream_ended_at_step": self.stream_ended_at}
                                     if isinstance(self.stream, WindowedStream) else {})},
                   **({"stream": {**self.spool.summary(), "tokens_trained": c.tokens_seen,
                                  "reuse_per_sequence": cfg.data.reuse,
                                  "train_tok_s": round(c.tokens_seen / max(seconds, 1e-9), 1),
                                  "live_at_end": self.spool.live()}}
                      if self.spool is not None else {}),
                   **({"colocation": self.colocation} if self.colocation else {})}
        self.metrics.summary({k: v for k, v in summary.items() if not isinstance(v, dict)})
        self.stage.publish(cfg, staged=tmp, members=[FINAL],
                           inputs={"capture": Path(cfg.capture_dir), "vocab": Path(cfg.vocab_dir)},
                           init_fingerprint=init_fingerprint(cfg), init_report=self.report, final=str(out / FINAL),
                           wandb_dir=self.metrics.wandb_dir, hf_indices=train.hf_indices,
                           aux_layers=train.manifest.get("aux_provenance"), **summary, resolved=self.resolved)

    def _elapsed(self) -> float:
        return self.counters.prior_s + time.time() - self.t_start


def stream_items(config, inputs):
    """What the batch plan's indices address: the store (data.order=epochs), the store in stream order
    (windows over an offline store), or the spool (data.source=stream)."""
    if config.data.source == "stream" or config.data.resolved_order() == "epochs":
        return inputs.train
    prepared = ((inputs.capture_manifest.get("inputs") or {}).get("prepare") or {}).get("path")
    if not prepared:
        raise TrainInputError(f"{config.capture_dir}: its manifest names no prepare stage: data.order=windows reads "
                              f"the prepared order from it")
    return StoreWindows(inputs.train, Path(prepared) / config.data.train_split)


def total_steps(config, stream) -> tuple[int, int]:
    """(total optimizer steps, optimizer steps per epoch); a windowed stream is one "epoch" (data.reuse
    passes per window replace epochs)."""
    per_epoch = max(1, -(-stream.batches_per_epoch() // config.grad_accum))
    epochs = 1 if isinstance(stream, WindowedStream) else config.epochs
    candidates = [s for s in (config.max_steps, None if epochs is None else epochs * per_epoch) if s]
    return min(candidates), per_epoch


def init_fingerprint(config) -> Optional[str]:
    """The init drafter's weights (eagle3/fingerprints.py; None for scratch): a finished run is reused only for
    the same init."""
    path = config.init.drafter_path
    if config.init.name == "scratch" or not path:
        return None
    return fp.drafter_weights(Path(path))


def _wrapper_name(accelerator) -> str:
    """'single process', 'MULTI_CPU' (DDP over gloo), 'MULTI_GPU' (DDP over NCCL), 'FSDP'."""
    name = str(accelerator.distributed_type).split(".")[-1]
    return "single process" if name == "NO" else name


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


def stream_padding_efficiency(lengths, stream: BatchStream) -> float:
    """Real tokens / padded tokens over one epoch's batches (1.0 = no padding)."""
    clipped = [min(n, stream.max_length) for n in lengths]
    real = padded = 0
    for b in stream.epoch_batches(0):
        real += sum(clipped[i] for i in b)
        padded += len(b) * max(clipped[i] for i in b)
    return round(real / max(1, padded), 4)
