"""Turning raw ShareGPT records into the mini world's two distributions and their parts.

K2 ("prose"): conversations without code; K2.5 ("code"): conversations with a ``` fence or
several code-like tokens. The shift is large and visible in token frequencies (identifiers,
punctuation, indentation), which is what the vocab stage and the drafter fine-tune react to.

Roles are assigned per *conversation group* (ShareGPT's split parts `X_0`, `X_1`, ... share a
root `X`) in a seeded hash order: held-out parts (eval, corpus) are filled first, the rest is
training data, so no held-out record shares a conversation with a training record.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from data.corpus import RawRecord

PROSE, CODE = "k2", "k25"  # distribution names = the targets trained on them
ROLES = ("eval", "corpus", "train")
# ShareGPT speaker -> chat-template role (the mini world's own, small mapping; prepare has the full one)
ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
           "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
# Literal code markers counted with str.count (C speed: a regex alternation over ~110M chars
# takes minutes on a small CPU). Chosen to be rare in prose.
CODE_MARKERS = ("def ", "import ", "#include", "console.log", "public static", "=>", "();", ") {", "};", "</",
                "npm ", "pip install", "sudo ", "const ", "var ", "print(", "SELECT ", "self.", "this.",
                " == ", " != ", "function(", "return ")


@dataclass
class Conversation:
    id: str
    group: str  # ShareGPT root id (before the last "_")
    turns: list  # [{"from": ShareGPT speaker, "value": str}] as in the source
    kind: str = ""  # PROSE | CODE

    def messages(self, max_chars: int | None = None) -> list[dict]:
        """Chat-template messages; with `max_chars`, turns are cut so the total stays under it
        (the tail is dropped, the structure of the first turns kept)."""
        out, left = [], max_chars
        for t in self.turns:
            text = t["value"]
            if left is not None:
                if left <= 0:
                    break
                text = text[:left]
                left -= len(text)
            out.append({"role": ROLE_OF[t["from"].lower()], "content": text})
        return out

    def sharegpt(self) -> dict:
        return {"id": self.id, "conversations": [{"from": t["from"], "value": t["value"]} for t in self.turns]}


@dataclass
class SplitResult:
    parts: dict  # (kind, role) -> list[Conversation]
    skipped: Counter = field(default_factory=Counter)  # reason -> count

    def counts(self) -> dict:
        return {f"{k}/{r}": len(v) for (k, r), v in sorted(self.parts.items())}


def conversation_of(rec: RawRecord) -> tuple[Conversation | None, str]:
    """A usable Conversation from a raw record, or (None, skip reason)."""
    if rec.error is not None:
        return None, "malformed"
    v = rec.value
    if not isinstance(v, dict) or not isinstance(v.get("conversations"), list):
        return None, "no_conversations"
    turns = []
    for t in v["conversations"]:
        if not isinstance(t, dict) or not isinstance(t.get("value"), str) or not isinstance(t.get("from"), str):
            return None, "bad_turn"
        if t["from"].lower() not in ROLE_OF:
            return None, "unknown_role"
        if t["value"].strip():
            turns.append({"from": t["from"], "value": t["value"]})
    roles = {ROLE_OF[t["from"].lower()] for t in turns}
    if not {"user", "assistant"} <= roles:
        return None, "no_user_or_assistant_turn"
    cid = str(v.get("id", rec.index))
    return Conversation(id=cid, group=cid.rsplit("_", 1)[0], turns=turns), ""


def classify(conv: Conversation, code_min_hits: int) -> str:
    """CODE if the conversation has a ``` fence or >= `code_min_hits` code markers, else PROSE."""
    text = "\n".join(t["value"] for t in conv.turns)
    if "```" in text:
        return CODE
    hits = 0
    for marker in CODE_MARKERS:
        hits += text.count(marker)
        if hits >= code_min_hits:
            return CODE
    return PROSE


def non_ascii_fraction(conv: Conversation) -> float:
    text = "".join(t["value"] for t in conv.turns)
    return (len(text) - len(text.encode("ascii", "ignore"))) / max(1, len(text))  # exact count, in C


def _rank(seed: int, group: str) -> str:
    return hashlib.sha256(f"{seed}:{group}".encode()).hexdigest()


def split_conversations(records: Iterable[RawRecord], *, seed: int, code_min_hits: int,
                        max_non_ascii_fraction: float, quotas: dict) -> SplitResult:
    """`quotas[(kind, role)]` for role in ("eval", "corpus") = records wanted; "train" gets the
    rest. Deterministic in (records, seed, settings)."""
    groups: dict[str, list[Conversation]] = {}
    skipped: Counter = Counter()
    seen_ids: set[str] = set()
    for rec in records:
        conv, why = conversation_of(rec)
        if conv is None:
            skipped[why] += 1
            continue
        if conv.id in seen_ids:
            skipped["duplicate_id"] += 1
            continue
        seen_ids.add(conv.id)
        if non_ascii_fraction(conv) > max_non_ascii_fraction:
            skipped["mostly_non_ascii"] += 1
            continue
        conv.kind = classify(conv, code_min_hits)
        groups.setdefault(conv.group, []).append(conv)

    parts: dict = {(k, r): [] for k in (PROSE, CODE) for r in ROLES}
    held_out = [r for r in ROLES if r != "train"]
    for group in sorted(groups, key=lambda g: _rank(seed, g)):
        convs = groups[group]
        # the first held-out role whose quota is still open for any distribution takes the group
        role = next((r for r in held_out if any(len(parts[(k, r)]) < quotas[(k, r)] for k in (PROSE, CODE))),
                    "train")
        for conv in convs:
            if role != "train" and len(parts[(conv.kind, role)]) >= quotas[(conv.kind, role)]:
                skipped[f"held_out_overflow"] += 1  # held out (never trained on), beyond the quota
                continue
            parts[(conv.kind, role)].append(conv)
    return SplitResult(parts=parts, skipped=skipped)
