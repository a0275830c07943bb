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

Memory is bounded by max_length, not by the record: a rendering longer than a character budget is
cut before it is tokenized (a 5 MB record would otherwise become millions of tokens, ~0.7 KB each in
the tokenizer's output), then the tokens are truncated exactly at max_length. The budget starts at
CHARS_PER_TOKEN_GUESS characters per token of max_length + MARGIN_TOKENS and doubles for a text
whose tokens are longer than that, until the cut text holds MARGIN_TOKENS more tokens than are kept:
the tokens near a cut may differ from the whole text's (a word cut in two), those far before it do
not. Prefix renderings past the cut are not made at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.conversations import Conversation, PrepareError, Skip
from data.image_messages import template_messages

CHARS_PER_TOKEN_GUESS = 8  # first character budget per token kept; English text needs ~4, denser text less
MARGIN_TOKENS = 64  # tokens past max_length a cut text must reach (a cut only changes the tokens near it)


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
        """The template's text; a user turn's images are K2.5 image blocks before its text."""
        return self.tok.apply_chat_template(template_messages(messages), tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def encode(self, conv: Conversation) -> Encoded:
        """Encode one conversation; raises Skip."""
        result = self.encode_many([conv])[0]
        if isinstance(result, Skip):
            raise result
        return result

    def char_budget(self, attempt: int) -> int:
        """Characters of a rendering tokenized at the `attempt`-th try (module docstring)."""
        return (self.max_length + MARGIN_TOKENS) * CHARS_PER_TOKEN_GUESS * 2 ** attempt

    def _enough(self, text_len: int, budget: int, n_tokens: int) -> bool:
        """Are the tokens of a text cut at `budget` characters enough to decide its first max_length?"""
        return text_len <= budget or n_tokens >= self.max_length + MARGIN_TOKENS

    def encode_many(self, convs: list[Conversation]) -> list:
        """Encoded or Skip per conversation. All texts of the chunk go to the (Rust, multi-
        threaded) tokenizer in one call, which is where the time goes; a conversation whose cut
        rendering holds too few tokens is redone with a doubled budget."""
        results: list = [None] * len(convs)
        pending, attempt = list(range(len(convs))), 0
        while pending:
            budget, redo = self.char_budget(attempt), []
            jobs = []  # (index, text cut at the budget, char ends of the prefix renderings, full length)
            for i in pending:
                try:
                    jobs.append((i, *self._render_prefixes(convs[i], budget)))
                except Skip as s:
                    results[i] = s
            pieces_of = [_pieces(text, ends) for _, text, ends, _ in jobs]
            flat = [t for (_, text, _, _), pieces in zip(jobs, pieces_of) for t in [text] + pieces]
            enc = self._tokenize(flat)
            pos = 0
            for (i, text, ends, full_len), pieces in zip(jobs, pieces_of):
                full_ids, piece_ids = enc[pos], enc[pos + 1: pos + 1 + len(pieces)]
                pos += 1 + len(pieces)
                failed = next((e for e in [full_ids, *piece_ids] if isinstance(e, Exception)), None)
                if failed is not None:
                    results[i] = Skip("tokenizer_error", f"{type(failed).__name__}: {failed}")
                elif not self._enough(full_len, budget, len(full_ids)):
                    redo.append(i)
                else:
                    try:
                        cuts = self._token_cuts(text, full_ids, ends, piece_ids, convs[i])
                        results[i] = self._mask_and_truncate(full_ids, cuts, full_len > budget)
                    except Skip as s:
                        results[i] = s
            pending, attempt = redo, attempt + 1
        return results

    def _tokenize(self, texts: list[str]) -> list:
        """Token ids per text, in one call; if that call fails, text by text, so that one text the
        tokenizer rejects is that conversation's `tokenizer_error` (its exception in the list)
        instead of the whole chunk's."""
        if not texts:
            return []
        try:
            return self.tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
        except Exception:
            out = []
            for t in texts:
                try:
                    out.append(self.tok([t], add_special_tokens=False, verbose=False)["input_ids"][0])
                except Exception as e:  # noqa: PERF203 - only after the batch failed
                    out.append(e)
            return out

    def prompt_fits(self, messages: list[dict]) -> bool:
        """Does `messages` + the generation prompt render to fewer than max_length tokens? (Whether
        an answer after it can still reach the data.) Tokenizes at most a budget's worth of it."""
        text, attempt = self._render(messages, True), 0
        while True:
            budget = self.char_budget(attempt)
            n = len(self.tok(text[:budget], add_special_tokens=False, verbose=False)["input_ids"])
            if self._enough(len(text), budget, n):
                return len(text) <= budget and n < self.max_length
            attempt += 1

    def _render_prefixes(self, conv: Conversation, budget: int) -> tuple[str, list[int], int]:
        """The full rendering cut at `budget` characters; per assistant turn k that starts before
        the cut, the char lengths of the renderings of msgs[:k] + generation prompt (start of the
        answer) and of msgs[:k+1] (its end, at most the cut); and the full rendering's length.
        Each rendering is checked to be a prefix of the full one and then dropped (a long
        conversation would otherwise hold one per turn)."""
        msgs = conv.messages
        try:
            full = self._render(msgs, False)
            ends = []
            for k in conv.assistant_indices:
                start = self._prefix_len(full, msgs[:k], True, k, "prompt")
                if start >= budget:
                    break  # this answer and the later ones lie past the cut
                ends += [start, min(self._prefix_len(full, msgs[: k + 1], False, k, "answer"), budget)]
                if ends[-1] >= budget:
                    break
        except Skip:
            raise
        except Exception as e:  # jinja2 errors, template-raised exceptions
            raise Skip("template_error", f"{type(e).__name__}: {e}") from e
        return full[:budget], ends, len(full)

    def _prefix_len(self, full: str, msgs: list[dict], generation_prompt: bool, k: int, part: str) -> int:
        t = self._render(msgs, generation_prompt)
        if not full.startswith(t):
            raise Skip("template_not_prefix_stable", f"rendering up to message {k} ({part}) is not a text prefix "
                       "of the whole conversation's rendering")
        return len(t)

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

    def _mask_and_truncate(self, full_ids: list[int], cuts: list[int], text_was_cut: bool = False) -> Encoded:
        if not cuts:  # (a cut text: no answer starts before the cut)
            raise Skip("too_long", f"the prompt fills max_length {self.max_length}: nothing to train")
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
                n = f"more than {len(input_ids)}" if text_was_cut else f"{len(input_ids)}"
                raise Skip("too_long", f"{n} tokens > max_length {self.max_length}")
            input_ids, mask, truncated = input_ids[: self.max_length], mask[: self.max_length], True
            if not mask.any():
                raise Skip("too_long", f"the {prompt_len}-token prompt fills max_length {self.max_length}: nothing to train")
        return Encoded(input_ids, mask, prompt_len, truncated)


def _pieces(full: str, ends: list[int]) -> list[str]:
    bounds = sorted(set([0, len(full)] + ends))
    return [full[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
