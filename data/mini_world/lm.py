"""Training and scoring the mini language models (CPU, or CUDA for a larger world): chat-template
rendering, packing into fixed-length blocks, a plain AdamW loop with warmup + cosine decay, and
held-out perplexity. Training and scoring take a `device`; the model comes back on the CPU."""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from data.mini_world.split import Conversation


def encode_conversations(tokenizer, convs: Sequence[Conversation], *, max_tokens: int,
                         max_chars: int) -> list[list[int]]:
    """Each conversation rendered with the tokenizer's chat template (text cut to `max_chars`
    first so rendering stays cheap), tokenized, and cut to its first `max_tokens` tokens."""
    texts = [tokenizer.apply_chat_template(c.messages(max_chars), tokenize=False) for c in convs]
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [ids[:max_tokens] for ids in enc]


def encode_until(tokenizer, convs: Sequence[Conversation], need_tokens: int, *, max_tokens: int,
                 max_chars: int, chunk: int = 256) -> list[list[int]]:
    """`encode_conversations` over `convs` in order, stopping once `need_tokens` tokens are
    encoded (training uses a fraction of a pass, so encoding everything would be wasted)."""
    out: list[list[int]] = []
    total = 0
    for i in range(0, len(convs), chunk):
        seqs = encode_conversations(tokenizer, convs[i: i + chunk], max_tokens=max_tokens, max_chars=max_chars)
        out.extend(seqs)
        total += sum(len(s) for s in seqs)
        if total >= need_tokens:
            break
    return out


def pack_blocks(seqs: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """Concatenate sequences and cut into [N, seq_len] blocks (the ragged tail is dropped).
    Blocks may span conversations; each conversation starts with its own role header."""
    flat = [t for s in seqs for t in s]
    n = len(flat) // seq_len
    if n == 0:
        raise ValueError(f"only {len(flat)} tokens: not enough for one block of {seq_len}")
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


def lr_at(step: int, *, steps: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_ratio` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def resolve_device(name: str) -> torch.device:
    """`auto` = CUDA when present, else the CPU; `cuda` without a GPU is an error, not a fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device; use device=cpu or device=auto")
    return torch.device(name)


def train_lm(model, blocks: torch.Tensor, cfg, *, seed: int, desc: str,
             device: torch.device = torch.device("cpu")) -> dict:
    """Train `model` in place on `device` for `cfg.steps` steps of `cfg.batch_size` blocks (seeded
    order, reshuffled each pass over the data); the model ends on the CPU. Returns loss figures and
    tokens seen."""
    sampler = BatchSampler(len(blocks), cfg.batch_size, seed)

    def loss_at(step: int) -> torch.Tensor:
        batch = blocks[sampler.next()].to(device, non_blocking=True)
        return model(input_ids=batch, labels=batch).loss

    stats = optimise(model, cfg, loss_at, desc=desc, device=device)
    return {**stats, "tokens": cfg.steps * cfg.batch_size * blocks.shape[1]}


class BatchSampler:
    """Indices of `batch_size` items per step out of `n`: a seeded permutation, reshuffled when used up."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size = n, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.cursor = torch.randperm(n, generator=self.gen), 0

    def next(self) -> torch.Tensor:
        if self.cursor + self.batch_size > len(self.order):
            self.order, self.cursor = torch.randperm(self.n, generator=self.gen), 0
        idx = self.order[self.cursor: self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return idx


def _read_losses(pending: list, losses: list, step: int, desc: str) -> None:
    """Move the device losses of the last steps to `losses` (one host sync) and refuse a non-finite one."""
    values = torch.stack(pending).tolist()
    first = len(losses)
    losses.extend(values)
    pending.clear()
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise FloatingPointError(f"{desc}: loss became {v} at step {first + i} (found at step {step}); "
                                     "lower the lr")


def optimise(model, cfg, loss_at, *, desc: str, device: torch.device = torch.device("cpu"),
             lr_scale: Optional[Callable[[str], float]] = None, check_every: int = 20) -> dict:
    """AdamW (decay on matrices only) with warmup + cosine decay for `cfg.steps` steps of `loss_at(step)`
    (a scalar loss of the model on `device`); the model ends on the CPU in eval mode. `lr_scale(name)`: a
    parameter's learning rate as a multiple of the schedule's (default 1). The losses stay on the device and
    are read every `check_every` steps (a host sync per step would stall a GPU that small steps keep
    launch-bound); a non-finite loss fails the run at the next read, naming its step."""
    model.to(device)
    groups: dict[tuple, list] = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((p.ndim >= 2, lr_scale(n) if lr_scale else 1.0), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": cfg.weight_decay if decays else 0.0, "scale": scale}
                             for (decays, scale), ps in groups.items()], lr=cfg.lr, betas=(0.9, 0.95))
    pending: list[torch.Tensor] = []  # this stretch's losses, on the device (read every `check_every` steps)
    losses: list[float] = []
    model.train()
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", dynamic_ncols=True)
    for step in bar:
        lr = lr_at(step, steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup_steps, min_ratio=cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr * group["scale"]
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        pending.append(loss.detach())
        if len(pending) == check_every or step == cfg.steps - 1:
            _read_losses(pending, losses, step, desc)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval().to("cpu")
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": cfg.steps, "first_loss": losses[0], "final_loss": sum(tail) / len(tail)}


@torch.no_grad()
def perplexity(model, seqs: Sequence[Sequence[int]], *, max_tokens: int, batch_size: int = 8,
               device: torch.device = torch.device("cpu")) -> dict:
    """Token-level perplexity over whole conversations (each scored on its own, no packing),
    predicting tokens 1.. of each, until `max_tokens` targets are scored, on `device` (the model
    ends on the CPU)."""
    model.eval().to(device)
    picked, total = [], 0
    for s in seqs:
        if len(s) < 2 or total >= max_tokens:
            continue
        s = list(s[: max_tokens - total + 1])
        picked.append(s)
        total += len(s) - 1
    nll, count = 0.0, 0
    for i in range(0, len(picked), batch_size):
        chunk = picked[i: i + batch_size]
        T = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.bool)
        for j, s in enumerate(chunk):
            ids[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = True
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask.long()).logits[:, :-1].float()  # [B, T-1, V]
        tgt, valid = ids[:, 1:], mask[:, 1:]
        lp = torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # [B, T-1]
        nll -= lp[valid].sum().item()
        count += int(valid.sum())
    model.to("cpu")
    return {"tokens": count, "nll": nll / max(1, count), "ppl": math.exp(nll / max(1, count))}


def unigram_perplexity(train_seqs: Sequence[Sequence[int]], eval_seqs: Sequence[Sequence[int]],
                       vocab_size: int, *, max_tokens: int) -> float:
    """Perplexity of an add-one unigram model fitted on `train_seqs`: the bar a real LM must beat."""
    counts = torch.ones(vocab_size, dtype=torch.float64)
    for s in train_seqs:
        counts += torch.bincount(torch.tensor(s, dtype=torch.long), minlength=vocab_size).double()
    logp = torch.log(counts / counts.sum())
    nll, n = 0.0, 0
    for s in eval_seqs:
        if n >= max_tokens or len(s) < 2:
            continue
        tgt = torch.tensor(s[1: 1 + max_tokens - n], dtype=torch.long)
        nll -= logp[tgt].sum().item()
        n += len(tgt)
    return math.exp(nll / max(1, n))
