"""Keeping a generated answer only as far as its text re-tokenizes to the generated tokens.

Regeneration stores text (the OpenAI API returns text, and prepare renders it with the chat
template); prepare tokenizes that text again. When the target generated a token sequence that is
not the tokenizer's own encoding of its text, the re-tokenized turn differs from what the target
produced: a weak model looping on single "\\n" tokens comes back as "\\n\\n" tokens, a special token
vanishes with `skip_special_tokens`. At every such position `input_ids[t+1] != target_argmax[t]`,
so the data is no longer the target's greedy output, and the accept-length replay (which scores
only greedy-consistent stretches) has little left to score.

`round_trip_len` finds the longest prefix of a generated row whose decoded text encodes back to
exactly that prefix; `RoundTripStop` stops a row's generation once it has left that regime (no
decoding is wasted on text that would be cut). A decoded text that ends in a partial UTF-8
character ("\\ufffd") is not judged yet: the next token may complete it.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"  # what decoding a partial UTF-8 byte sequence yields


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def round_trip_len(tokenizer, ids: Sequence[int]) -> int:
    """The largest n <= len(ids) such that encode(decode(ids[:n])) == ids[:n] (0 if none). Checked
    from the full row down: a row cut by `round_trip_stop` round-trips one token short of its end."""
    ids = list(ids)
    for n in range(len(ids), 0, -1):
        if _encode(tokenizer, [tokenizer.decode(ids[:n], skip_special_tokens=True)])[0] == ids[:n]:
            return n
    return 0


def survives_round_trip(tokenizer, rows: Sequence[Sequence[int]]) -> list[bool | None]:
    """Per row: True if its text encodes back to exactly its ids; None when it does not yet but the text
    ends in its only partial character (undecided: the next token may complete it); False otherwise (a
    partial character before the end can never be completed). The one rule of the stop and the veto."""
    texts = [tokenizer.decode(list(r), skip_special_tokens=True) for r in rows]
    verdicts: list[bool | None] = []
    for text, row, back in zip(texts, rows, _encode(tokenizer, texts)):
        if back == list(row):
            verdicts.append(True)
        else:
            verdicts.append(None if text.endswith(REPLACEMENT) and REPLACEMENT not in text[:-1] else False)
    return verdicts


def last_segment(ids: Sequence[int], separator) -> list[int]:
    """The ids after the last `separator` (a thinking model's `</think>`: reasoning and answer are
    stored as separate texts, so each must survive on its own); all of them if it is absent."""
    ids = list(ids)
    if separator is None or separator not in ids:
        return ids
    return ids[len(ids) - ids[::-1].index(separator):]


def round_trip_stop(tokenizer, prompt_len: int, stop_ids: Sequence[int], separator=None):
    """A transformers StoppingCriteria: a row is done once the segment it is generating (its ids
    after `prompt_len`, up to a stop token, after the last `separator`) no longer survives the round
    trip. Earlier segments were the last one when they were generated, so they were checked then."""
    import torch
    from transformers import StoppingCriteria

    stops = set(stop_ids)

    class RoundTripStop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            rows = []
            for row in input_ids[:, prompt_len:].tolist():
                cut = next((j for j, t in enumerate(row) if t in stops), len(row))
                rows.append(last_segment(row[:cut], separator))
            done = [ok is False for ok in survives_round_trip(tokenizer, rows)]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return RoundTripStop()


def canonical_veto(tokenizer, prompt_len: int, stop_ids: Sequence[int], separator=None):
    """A `PerRowSampler` veto (data/row_sampling.py): a row may take a token only if the segment it is
    generating, with that token, still survives the round trip, so the answer goes on as text that
    re-tokenizes to itself instead of being cut where the first non-canonical token would have stood.
    A text ending in one partial character is allowed (the next token may complete it); one holding a
    replacement character before its end never can be, so it is refused. A stop token and a row
    already stopped are allowed."""
    stops = set(stop_ids)

    def veto(input_ids, picks: list[int]) -> list[bool]:
        ok: list[bool] = [True] * len(picks)
        judged, rows = [], []
        for i, (row, pick) in enumerate(zip(input_ids[:, prompt_len:].tolist(), picks)):
            if pick in stops or any(t in stops for t in row):
                continue
            judged.append(i)
            rows.append(last_segment(row + [pick], separator))
        for i, verdict in zip(judged, survives_round_trip(tokenizer, rows)):
            ok[i] = verdict is not False
        return ok

    return veto
