"""A real speculative-decoding loop: the target (transformers) verifies the drafter's chain with real
forward passes. Greedy, batch 1, KV caches for both models; chain drafts (topk = 1) here, trees
(topk > 1) in eagle3/real_loop/tree.py.

One cycle, with x_q the last verified token (the target's cache holds positions 0..q-1, the
drafter's cache the extend pairs (aux_t, x_{t+1}) for t = 0..q-1 and its output at q-1):
  1. draft: d_1 = argmax of the drafter's output at q-1; d_j (j >= 2) from a step on its own pre-norm
     output and d_{j-1} at position q+j-2 (num_steps tokens; num_draft_tokens - 1 of them verified);
  2. verify: the target runs [x_q, d_1..d_n] at positions q..q+n with forward hooks capturing the aux
     states; g_j = its argmax after position q+j; k = longest prefix with d_{j+1} == g_j;
  3. accept d_1..d_k plus the bonus g_k; crop the target cache to q+k+1 entries, truncate the drafter
     cache back to q entries and extend it with pairs (aux_{q..q+k}, [d_1..d_k, g_k]).
Emitted per cycle: k+1, capped by the tokens still wanted (as the replay in eagle3/replay/accept_sim.py
counts the last cycle of a segment), so for the target's own greedy output the simulated accept
length on the same sequence is the same number (tests/test_eval_real_loop.py).

A prompt with images (`PromptImages`): the target's prefill reads its fused input embeddings (the store's
rows at the image positions), and the drafter's prefill reads what the image_embeddings convention feeds
(eagle3/drafter/image_embeddings.py); every generated token is text, so later cycles are unchanged.

Imports torch, transformers (through the target model) and eagle3 core only.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from eagle3.drafter.image_embeddings import check_convention, token_embeddings
from eagle3.target_model.target_io import AuxHiddenCapture, lm_head, text_model
from eagle3.drafter.attention import KVCache


@dataclass
class PromptImages:
    """A prompt's image rows: image_token_id, the target's fused input embeddings there (rows [n, H], in order;
    the store's `image_embeds`) and the convention the drafter reads them with."""
    image_token_id: int
    rows: torch.Tensor
    convention: str

    def __post_init__(self):
        check_convention(self.convention)

    def target_embeds(self, embed_tokens, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings [1, L, H] of ids [L] (image rows fused, as its multimodal forward)."""
        emb = token_embeddings(embed_tokens, ids, "fused", self.image_token_id, self.rows)
        return (embed_tokens(ids) if emb is None else emb)[None]

    def drafter_embeds(self, drafter, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """The drafter's input embeddings [L, H] of ids [L] under the convention (None: embed_tokens(ids))."""
        return token_embeddings(drafter.embed_tokens, ids, self.convention, self.image_token_id, self.rows)


def prefill_inputs(drafter, prompt: torch.Tensor, first: int, images: Optional[PromptImages]):
    """The drafter's prefill: pairs x_{t+1} (t = 0..L-1) of prompt + the first generated token, and their input
    embeddings [1, L, H] when not embed_tokens(pairs) (shifted by one like the ids)."""
    dev = drafter.fc.weight.device
    seq = torch.cat([prompt, torch.tensor([first])]).to(dev)
    emb = None if images is None else images.drafter_embeds(drafter, seq)
    return seq[None, 1:], None if emb is None else emb[None, 1:]


@dataclass
class DecodeResult:
    tokens: list[int]                       # generated tokens (prompt excluded)
    token_ms: list[float] = field(default_factory=list)  # plain greedy: per decode step after the prefill
    prefill_ms: float = 0.0

    @property
    def baseline_token_ms(self) -> float:
        return sum(self.token_ms) / len(self.token_ms) if self.token_ms else float("nan")


@dataclass
class SpecResult:
    tokens: list[int]                       # generated tokens (prompt excluded), first = the prefill's
    emitted: list[int] = field(default_factory=list)        # tokens per verify cycle (bonus included)
    accepted: list[int] = field(default_factory=list)       # draft tokens accepted per cycle
    draft_ms: list[float] = field(default_factory=list)     # per cycle: all draft steps
    verify_ms: list[float] = field(default_factory=list)    # per cycle: the target's verify pass
    extend_ms: list[float] = field(default_factory=list)    # per cycle: drafter extend over accepted tokens
    num_steps: int = 0
    num_draft_tokens: int = 0

    @property
    def accept_length(self) -> float:
        return sum(self.emitted) / len(self.emitted) if self.emitted else float("nan")

    def summary(self) -> dict:
        n = len(self.emitted)
        mean = (lambda xs: sum(xs) / len(xs) if xs else float("nan"))
        cycle_ms = [a + b + c for a, b, c in zip(self.draft_ms, self.verify_ms, self.extend_ms)]
        return {"accept_length": self.accept_length, "cycles": n, "tokens": sum(self.emitted),
                "draft_ms": mean(self.draft_ms), "draft_step_ms": mean(self.draft_ms) / max(self.num_steps, 1),
                "verify_ms": mean(self.verify_ms), "extend_ms": mean(self.extend_ms), "cycle_ms": mean(cycle_ms),
                "tok_s": 1000.0 * sum(self.emitted) / sum(cycle_ms) if cycle_ms and sum(cycle_ms) > 0 else float("nan")}


def eos_ids(eos_token_id) -> set[int]:
    """The stop ids of a config's `eos_token_id`: None | int | list of ints (HF allows all three) -> set.
    Every real decode loop (chain here, tree in eagle3/real_loop/tree.py) stops on them as the baseline does."""
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


def elapsed_ms(t0: float) -> float:
    """Milliseconds since `t0` (a time.perf_counter() value): the unit of every timing the loops record."""
    return 1000.0 * (time.perf_counter() - t0)


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a timing covers the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TargetRunner:
    """The target's text path with a DynamicCache and aux-state hooks."""

    def __init__(self, target, hf_indices: list[int]):
        from transformers import DynamicCache

        self.decoder, self.head = text_model(target), lm_head(target)
        self.target, self.hf_indices = target, list(hf_indices)
        self.device = self.decoder.embed_tokens.weight.device
        self.cache = DynamicCache(config=getattr(target.config, "text_config", None) or target.config)

    @classmethod
    def for_drafter(cls, target, drafter) -> "TargetRunner":
        """A runner capturing the hidden states h the drafter reads (its config's aux layers)."""
        hf_indices = drafter.config.aux_hf_indices
        if hf_indices is None:
            raise ValueError("drafter config has no eagle_aux_hidden_state_layer_ids: cannot pick the target layers")
        return cls(target, hf_indices)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, capture: bool, images: Optional[PromptImages] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """ids Long [n] at the next n positions -> (argmax Long [n], aux [n, 3*Ht] or None). images: the image
        rows of these ids (a prompt's prefill), read as fused input embeddings."""
        ids = ids.to(self.device)
        inputs = {"input_ids": ids[None]} if images is None else \
            {"inputs_embeds": images.target_embeds(self.decoder.embed_tokens, ids)}
        if capture:
            with AuxHiddenCapture(self.target, self.hf_indices) as cap:
                out = self.decoder(**inputs, cache=self.cache, use_cache=True)
                aux = cap.aux_concat(self.device)[0]
        else:
            out, aux = self.decoder(**inputs, cache=self.cache, use_cache=True), None
        return self.head(out.last_hidden_state[0]).argmax(-1), aux

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (transformers 5 `crop` takes minus the number to remove)."""
        remove = self.cache.get_seq_length() - length
        if remove < 0:
            raise ValueError(f"cannot crop a target cache of {self.cache.get_seq_length()} positions to {length}")
        if remove:
            self.cache.crop(-remove)


@torch.no_grad()
def greedy_decode(target, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None,
                  images: Optional[PromptImages] = None) -> DecodeResult:
    """The target's own greedy decode (the reference and the baseline timing); stops after
    max_new_tokens or at an EOS id (int or list). images: the prompt's image rows."""
    eos = eos_ids(eos_token_id)
    run = TargetRunner(target, [])
    t0 = time.perf_counter()
    g, _ = run.forward(prompt, capture=False, images=images)
    sync_device(run.device)
    res = DecodeResult(tokens=[int(g[-1])], prefill_ms=elapsed_ms(t0))
    while len(res.tokens) < max_new_tokens and res.tokens[-1] not in eos:
        t0 = time.perf_counter()
        g, _ = run.forward(torch.tensor([res.tokens[-1]]), capture=False)
        sync_device(run.device)
        res.token_ms.append(elapsed_ms(t0))
        res.tokens.append(int(g[-1]))
    return res


@torch.no_grad()
def speculative_decode(target, drafter, prompt: torch.Tensor, max_new_tokens: int, num_steps: int = 2,
                       num_draft_tokens: int = 3, eos_token_id=None, images: Optional[PromptImages] = None
                       ) -> SpecResult:
    """Chain speculative decoding (module docstring). prompt Long [L] (L >= 1); images: its image rows."""
    if not 2 <= num_draft_tokens <= num_steps + 1:
        raise ValueError(f"chain decoding needs 2 <= num_draft_tokens <= num_steps + 1, got "
                         f"{num_steps}/1/{num_draft_tokens}")
    eos = eos_ids(eos_token_id)
    run = TargetRunner.for_drafter(target, drafter)
    dev = drafter.fc.weight.device
    prompt = prompt.long().reshape(-1)
    L, n = prompt.numel(), num_draft_tokens - 1
    res = SpecResult(tokens=[], num_steps=num_steps, num_draft_tokens=num_draft_tokens)

    g, aux = run.forward(prompt, capture=True, images=images)                     # prefill
    res.tokens.append(int(g[-1]))
    dcache = KVCache()
    pairs, emb = prefill_inputs(drafter, prompt, res.tokens[0], images)          # x_{t+1} for t = 0..L-1
    h = drafter.step(pairs, drafter.project_aux(aux[None].to(dev)), torch.arange(L, device=dev)[None],
                     dcache, embeds=emb)[:, -1:]                                 # output at position q-1
    q = L                                                                        # position of the last verified token
    while len(res.tokens) < max_new_tokens and res.tokens[-1] not in eos:
        remaining = max_new_tokens - len(res.tokens)
        sync_device(dev)
        t0 = time.perf_counter()
        drafts, hj = [], h
        for j in range(num_steps):
            tok = drafter.draft_ids_to_target(drafter.logits(hj)[0, -1].argmax())
            drafts.append(int(tok))
            if j + 1 < num_steps:
                hj = drafter.step(tok.view(1, 1).to(dev), hj, torch.tensor([[q + j]], device=dev), dcache)
        sync_device(dev)
        res.draft_ms.append(elapsed_ms(t0))
        drafts = drafts[:n]

        t0 = time.perf_counter()
        verify_in = torch.tensor([res.tokens[-1]] + drafts)
        g, aux = run.forward(verify_in, capture=True)                             # g[j]: target after position q+j
        sync_device(run.device)
        res.verify_ms.append(elapsed_ms(t0))
        g = g.tolist()
        k = 0
        while k < n and drafts[k] == g[k]:
            k += 1
        new = drafts[:k] + [g[k]]
        stop = [i for i, t in enumerate(new) if t in eos]                       # stop at EOS like the baseline
        if stop:
            new = new[: stop[0] + 1]
        new = new[:remaining]
        res.accepted.append(min(k, len(new)))
        res.emitted.append(len(new))
        res.tokens.extend(new)
        run.crop(q + k + 1)

        t0 = time.perf_counter()
        dcache.truncate(q)
        m = len(new)  # pairs (aux_{q+i}, new[i]) for i < m; the verified prefix grows by m positions
        h = drafter.step(torch.tensor(new, device=dev)[None], drafter.project_aux(aux[None, :m].to(dev)),
                         torch.arange(q, q + m, device=dev)[None], dcache)[:, -1:]
        sync_device(dev)
        res.extend_ms.append(elapsed_ms(t0))
        q += m
    return res


def to_dict(result) -> dict:
    return asdict(result)
