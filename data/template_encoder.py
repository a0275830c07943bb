"""Prepare's encoder: a conversation -> token ids with an assistant-only loss mask built from the
target tokenizer's own chat template.

The loss mask is derived from the template, never from hand-written header strings: for the
k-th message (an assistant turn) we render `messages[:k]` with `add_generation_prompt=True`
(everything the model sees before it starts answering) and `messages[:k+1]` (the answer
closed by the template's end-of-turn). The tokens between the two are the assistant's: its
content and its end-of-turn token (`<|im_end|>` for Kimi), which the drafter must learn to
predict; the role header (`<|im_assistant|>assistant<|im_middle|>`, and a `<think>` prefill
where a template adds one) is not. This only works if the template is *prefix-stable*: each
rendering must be a token prefix of the full conversation's rendering. That is checked for
every turn; a conversation for which it fails is skipped with the reason
`template_not_prefix_stable` (and the whole stage fails if no conversation survives).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.conversations import Conversation, PrepareError, Skip


@dataclass
class Encoded:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 on assistant content + end-of-turn tokens
    prompt_len: int  # tokens before the first assistant reply
    truncated: bool = False


class TemplateEncoder:
    """Renders conversations with the tokenizer's chat template and derives the loss mask
    from prefix renderings (module docstring). `tokenizer` is a HF (fast) tokenizer."""

    def __init__(self, tokenizer, max_length: int, on_overlong: str = "truncate"):
        if not getattr(tokenizer, "chat_template", None):
            raise PrepareError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                               "prepare renders conversations with the target's own template")
        self.tok, self.max_length, self.on_overlong = tokenizer, max_length, on_overlong

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, conv: Conversation) -> Encoded:
        """Encode one conversation; raises Skip."""
        result = self.encode_many([conv])[0]
        if isinstance(result, Skip):
            raise result
        return result

    def encode_many(self, convs: list[Conversation]) -> list:
        """Encoded or Skip per conversation. All texts of the chunk go to the (Rust, multi-
        threaded) tokenizer in one call, which is where the time goes."""
        results: list = [None] * len(convs)
        jobs = []  # (index, full text, char ends of the prefix renderings)
        for i, conv in enumerate(convs):
            try:
                jobs.append((i, *self._render_prefixes(conv)))
            except Skip as s:
                results[i] = s
        pieces_of = [_pieces(full, ends) for _, full, ends in jobs]
        flat = [t for (_, full, _), pieces in zip(jobs, pieces_of) for t in [full] + pieces]
        enc = self.tok(flat, add_special_tokens=False, verbose=False)["input_ids"] if flat else []
        pos = 0
        for (i, full, ends), pieces in zip(jobs, pieces_of):
            full_ids, piece_ids = enc[pos], enc[pos + 1: pos + 1 + len(pieces)]
            pos += 1 + len(pieces)
            try:
                cuts = self._token_cuts(full, full_ids, ends, piece_ids, convs[i])
                results[i] = self._mask_and_truncate(full_ids, cuts)
            except Skip as s:
                results[i] = s
        return results

    def _render_prefixes(self, conv: Conversation) -> tuple[str, list[int]]:
        """The full rendering and, per assistant turn k, the char length of the renderings of
        msgs[:k] + generation prompt (start of the answer) and msgs[:k+1] (its end)."""
        msgs = conv.messages
        try:
            full = self._render(msgs, False)
            prefixes = [t for k in conv.assistant_indices
                        for t in (self._render(msgs[:k], True), self._render(msgs[: k + 1], False))]
        except Exception as e:  # jinja2 errors, template-raised exceptions
            raise Skip("template_error", f"{type(e).__name__}: {e}") from e
        for i, t in enumerate(prefixes):
            if not full.startswith(t):
                k = conv.assistant_indices[i // 2]
                raise Skip("template_not_prefix_stable",
                           f"rendering up to message {k} ({'prompt' if i % 2 == 0 else 'answer'}) is not a text prefix "
                           "of the whole conversation's rendering")
        return full, [len(t) for t in prefixes]

    def _token_cuts(self, full: str, full_ids: list[int], ends: list[int], piece_ids: list[list[int]],
                    conv: Conversation) -> list[int]:
        """Token index at which each prefix rendering ends.

        Fast path: the pieces between consecutive prefix ends, tokenized alone, concatenate to
        exactly the full rendering's tokens; then every cut is a token boundary and each
        prefix's tokens are the leading pieces'. Otherwise (a token may merge across a cut),
        tokenize every prefix alone and require it to be a token prefix of the full rendering."""
        bounds = sorted(set([0, len(full)] + ends))
        at, n = {0: 0}, 0
        for b, ids in zip(bounds[1:], piece_ids):  # token index at each char bound
            n += len(ids)
            at[b] = n
        if [t for ids in piece_ids for t in ids] == full_ids:
            return [at[c] for c in ends]
        cuts = []
        prefixes = [full[:c] for c in ends]
        for i, t_ids in enumerate(self.tok(prefixes, add_special_tokens=False, verbose=False)["input_ids"]):
            if full_ids[: len(t_ids)] != t_ids:
                k = conv.assistant_indices[i // 2]
                raise Skip("template_not_prefix_stable",
                           f"tokens up to message {k} are not a token prefix of the whole conversation "
                           "(a token merges across the turn boundary)")
            cuts.append(len(t_ids))
        return cuts

    def _mask_and_truncate(self, full_ids: list[int], cuts: list[int]) -> Encoded:
        mask = np.zeros(len(full_ids), dtype=np.uint8)
        for start, end in zip(cuts[0::2], cuts[1::2]):
            if end <= start:
                raise Skip("template_not_prefix_stable", "an assistant turn renders to no tokens")
            mask[start:end] = 1
        prompt_len = cuts[0]
        input_ids = np.asarray(full_ids, dtype=np.int32)
        truncated = False
        if len(input_ids) > self.max_length:
            if self.on_overlong == "skip":
                raise Skip("too_long", f"{len(input_ids)} tokens > max_length {self.max_length}")
            input_ids, mask, truncated = input_ids[: self.max_length], mask[: self.max_length], True
            if not mask.any():
                raise Skip("too_long", f"the {prompt_len}-token prompt fills max_length {self.max_length}: nothing to train")
        return Encoded(input_ids, mask, prompt_len, truncated)


def _pieces(full: str, ends: list[int]) -> list[str]:
    bounds = sorted(set([0, len(full)] + ends))
    return [full[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
