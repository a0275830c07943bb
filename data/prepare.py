"""Prepare: raw conversation records -> validated conversations -> token ids with an
assistant-only loss mask built from the target tokenizer's own chat template.

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

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

# ShareGPT / OpenAI role names -> chat template roles.
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
}

# Every reason a record can be skipped for, in the order the summary lists them.
SKIP_REASONS = (
    "malformed",  # a line / element that is not valid JSON (or UTF-8)
    "not_a_conversation",  # valid JSON, but no list of messages under `conversations` / `messages`
    "empty_conversation",  # no messages, or only empty ones
    "no_assistant_turn",
    "unknown_role",
    "non_string_content",
    "duplicate_id",
    "too_long",  # nothing trainable fits in max_length (or on_overlong=skip and it is longer)
    "template_error",  # the chat template raised on this conversation
    "template_not_prefix_stable",  # the loss mask cannot be derived from the template (see module doc)
    "regen_failed",  # regeneration gave up on this conversation (after retries)
)


class PrepareError(RuntimeError):
    """The prepare stage cannot produce a usable dataset; the message says why."""


class Skip(Exception):
    """A record that is dropped, with its counted reason and a human-readable detail."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in SKIP_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class Conversation:
    """A validated conversation: template roles, string contents, ends with an assistant turn."""
    id: str
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}, ...]
    location: str = ""  # where it came from (file:line), for messages

    @property
    def assistant_indices(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


@dataclass
class SkipCounter:
    """Skipped records by reason, with the first few examples of each (location + detail)."""
    max_examples: int = 5
    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def add(self, reason: str, location: str, detail: str = "") -> None:
        self.counts[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < self.max_examples:
            ex.append(f"{location}: {detail}" if detail else location)

    def as_dict(self) -> dict:
        return {r: self.counts.get(r, 0) for r in SKIP_REASONS}

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _content_text(content: Any, k: int) -> str:
    """A message's content as a string. OpenAI-style lists of text parts are joined; anything
    else that is not a string (null, numbers, images, dicts) is a `non_string_content` skip."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise Skip("non_string_content", f"message {k} has content of type {type(content).__name__}")


def conversation_from_record(value: Any, fallback_id: str, location: str = "") -> tuple[Conversation, int]:
    """Validate one raw record (ShareGPT `{"id", "conversations": [{"from", "value"}]}` or
    OpenAI-style `{"id", "messages": [{"role", "content"}]}`) into a Conversation.

    Messages after the last assistant turn, and assistant turns before the first user/system
    message, are dropped (no loss / no prompt). Returns the conversation and the number of
    messages dropped; raises Skip for a bad record."""
    if not isinstance(value, dict):
        raise Skip("not_a_conversation", f"record is a {type(value).__name__}, not an object")
    turns = value.get("conversations", value.get("messages"))
    if turns is None:
        raise Skip("not_a_conversation", f"no 'conversations' or 'messages' key (keys: {sorted(value)[:8]})")
    if not isinstance(turns, list):
        raise Skip("not_a_conversation", f"'conversations' is a {type(turns).__name__}, not a list")
    raw_id = value.get("id")
    conv_id = str(raw_id) if isinstance(raw_id, (str, int)) and str(raw_id) != "" else fallback_id
    messages = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise Skip("not_a_conversation", f"message {k} is a {type(turn).__name__}, not an object")
        role = turn.get("from", turn.get("role"))
        if not isinstance(role, str) or role.strip().lower() not in ROLE_MAP:
            raise Skip("unknown_role", f"message {k} has role {role!r}")
        content = turn["value"] if "value" in turn else turn.get("content")
        messages.append({"role": ROLE_MAP[role.strip().lower()], "content": _content_text(content, k)})
    if not messages or all(not m["content"].strip() for m in messages):
        raise Skip("empty_conversation", f"{len(messages)} messages, none with text")
    # Assistant turns before any user/system message answer nothing the model can see (ShareGPT
    # splits long chats into parts that start mid-way): they are dropped like trailing turns.
    lead = next((i for i, m in enumerate(messages) if m["role"] != "assistant"), len(messages))
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > lead]
    if not assistant:
        raise Skip("no_assistant_turn", f"roles: {[m['role'] for m in messages][:8]}")
    dropped = lead + len(messages) - 1 - assistant[-1]
    return Conversation(conv_id, messages[lead: assistant[-1] + 1], location), dropped


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


def is_validation(conv_id: str, fraction: float, salt: str) -> bool:
    """Deterministic, order-independent split by conversation id: a uniform hash in [0, 1)."""
    if fraction <= 0:
        return False
    h = hashlib.sha256(f"{salt}\x00{conv_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64 < fraction


# ----------------------------------------------------------------------------------------------
# The stage: read -> validate -> (regenerate) -> encode -> split -> write
# ----------------------------------------------------------------------------------------------

FEATURES_SPEC = {"id": "string", "input_ids": "int32", "loss_mask": "uint8", "prompt_len": "int32"}


@dataclass
class ReadInfo:
    """What reading the input found, besides the conversations themselves."""
    stats: Any = None  # data.corpus.ReadStats
    records: int = 0  # raw records looked at (good + malformed)
    trailing_dropped: int = 0  # messages after the last assistant turn (or leading assistant turns), dropped


def read_conversations(path, skips: SkipCounter, info: ReadInfo, max_records: Optional[int] = None):
    """Yield validated Conversations from a JSON / JSONL file or HF dataset dir, counting
    every dropped record in `skips` and the totals in `info`."""
    from data.corpus import ReadStats, iter_raw_records

    info.stats, seen = ReadStats(), set()
    name = Path(path).name
    for rec in iter_raw_records(path, info.stats):
        if max_records is not None and info.records >= max_records:
            break
        info.records += 1
        if rec.error is not None:
            skips.add("malformed", rec.location, rec.error)
            continue
        try:
            conv, dropped = conversation_from_record(rec.value, f"{name}:{rec.index}", rec.location)
        except Skip as s:
            skips.add(s.reason, rec.location, s.detail)
            continue
        if conv.id in seen:
            skips.add("duplicate_id", rec.location, f"id {conv.id!r} seen before")
            continue
        seen.add(conv.id)
        info.trailing_dropped += dropped
        yield conv


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides the token ids: the vocab, the special tokens and the chat
    template (independent of where the files live; the real target dir holds 600 GB)."""
    import json

    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([str(t) for t in tokenizer.all_special_tokens]).encode())
    h.update(str(tokenizer.chat_template).encode())
    return h.hexdigest()


def input_fingerprint(path) -> str:
    """sha256 over a file, or over every file (relative name + content) of a directory."""
    from eagle3.manifest import sha256_file

    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(path)).encode() + b"\x00" + sha256_file(p).encode())
    return h.hexdigest()


class SplitWriter:
    """Streams encoded rows of one split into an Arrow file (bounded memory), then saves a
    `datasets` directory with `save_to_disk`."""

    def __init__(self, tmp_dir):
        import datasets
        from datasets.arrow_writer import ArrowWriter

        self.features = datasets.Features({k: datasets.Value(v) if k in ("id", "prompt_len") else
                                           datasets.Sequence(datasets.Value(v)) for k, v in FEATURES_SPEC.items()})
        self.path = str(tmp_dir) + ".arrow"
        self.writer = ArrowWriter(features=self.features, path=self.path)
        self.rows = self.tokens = self.loss_tokens = self.truncated = 0

    def add(self, conv_id: str, enc: Encoded) -> None:
        self.writer.write({"id": conv_id, "input_ids": enc.input_ids, "loss_mask": enc.loss_mask,
                           "prompt_len": enc.prompt_len})
        self.rows += 1
        self.tokens += len(enc.input_ids)
        self.loss_tokens += int(enc.loss_mask.sum())
        self.truncated += int(enc.truncated)

    def save(self, out_dir) -> dict:
        import datasets

        self.writer.finalize()
        ds = datasets.Dataset.from_file(self.path)
        # datasets writes an empty dataset as zero shards, which load_from_disk cannot open
        # (IndexError): one explicit shard keeps an empty split loadable.
        ds.save_to_disk(str(out_dir), num_shards=1 if self.rows == 0 else None)
        del ds
        return {"conversations": self.rows, "tokens": self.tokens, "loss_tokens": self.loss_tokens,
                "truncated": self.truncated}


ENCODE_CHUNK = 256  # conversations tokenized per tokenizer call


def _chunks(items, n: int):
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def load_tokenizer(target):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target.tokenizer, trust_remote_code=target.trust_remote_code)
    except Exception as e:
        raise PrepareError(f"cannot load the target tokenizer from target.tokenizer={target.tokenizer}: {e}") from e


def _reusable(out, config_dict: dict, fingerprints: dict) -> bool:
    from eagle3.manifest import ManifestError, read_manifest

    try:
        m = read_manifest(out, "prepare")
    except ManifestError:
        return False
    # A run in which some regenerations failed is never reused: rerunning is how they get retried.
    return (m.get("config") == config_dict and m.get("fingerprints") == fingerprints
            and not m.get("counts", {}).get("skipped", {}).get("regen_failed")
            and (out / "train").is_dir() and (out / "validation").is_dir())


def run_prepare(cfg) -> Path:
    """The prepare stage (`cfg`: eagle3.schema.prepare.PrepareConfig). Returns the stage dir."""
    import os
    import shutil
    from tqdm import tqdm

    from eagle3.conf import as_plain_dict
    from eagle3.manifest import MANIFEST, write_manifest

    out, src = Path(cfg.out_dir), Path(cfg.input)
    if not src.exists():
        raise PrepareError(f"input {src} does not exist (set input=... to a ShareGPT JSON/JSONL file or a HF "
                           "dataset dir; the mini world's corpus is written by `make mini-world`)")
    tokenizer = load_tokenizer(cfg.target)
    fingerprints = {"input": input_fingerprint(src), "tokenizer": tokenizer_fingerprint(tokenizer)}
    config_dict = as_plain_dict(cfg)
    if _reusable(out, config_dict, fingerprints):
        print(f"[prepare] {out} is up to date with this config and input; reusing it")
        return out

    encoder = TemplateEncoder(tokenizer, cfg.max_length, cfg.on_overlong)
    skips, info = SkipCounter(cfg.num_examples_shown), ReadInfo()
    convs = read_conversations(src, skips, info, cfg.max_records)
    regen_stats = None
    if cfg.regenerate.backend != "none":
        from data.regenerate import regenerate_conversations

        convs, regen_stats = regenerate_conversations(list(convs), cfg, tokenizer, skips)

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-prepare-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    writers = {"train": SplitWriter(tmp / "train"), "validation": SplitWriter(tmp / "validation")}
    bar = tqdm(desc="prepare: tokenize", unit="conv", mininterval=2)
    for chunk in _chunks(convs, ENCODE_CHUNK):
        for conv, enc in zip(chunk, encoder.encode_many(chunk)):
            if isinstance(enc, Skip):
                skips.add(enc.reason, conv.location or conv.id, enc.detail)
                continue
            split = "validation" if is_validation(conv.id, cfg.validation_fraction, cfg.split_salt) else "train"
            writers[split].add(conv.id, enc)
        bar.update(len(chunk))
    bar.close()
    kept = sum(w.rows for w in writers.values())
    if kept == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PrepareError(f"no usable conversation in {src}: {info.records} records read, skipped by reason "
                           f"{ {k: v for k, v in skips.as_dict().items() if v} }; examples: {skips.examples}")
    if writers["train"].rows == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PrepareError(f"all {kept} usable conversations fell into the validation split; "
                           f"lower validation_fraction={cfg.validation_fraction} or add data")
    splits = {name: w.save(tmp / name) for name, w in writers.items()}
    # Swap the new splits in; the old manifest goes first so a crash never leaves a manifest
    # that describes different data. (The regenerated/ cache is left alone.)
    (out / MANIFEST).unlink(missing_ok=True)
    for name in writers:
        shutil.rmtree(out / name, ignore_errors=True)
        os.replace(tmp / name, out / name)
    shutil.rmtree(tmp, ignore_errors=True)
    counts = {"records_read": info.records, "kept": kept, "skipped_total": skips.total,
              "skipped": skips.as_dict(), "trailing_messages_dropped": info.trailing_dropped,
              "tokens": sum(s["tokens"] for s in splits.values()),
              "loss_tokens": sum(s["loss_tokens"] for s in splits.values()),
              "truncated": sum(s["truncated"] for s in splits.values())}
    write_manifest(out, "prepare", cfg, counts=counts, splits=splits, skip_examples=skips.examples,
                   reader=info.stats.as_dict(), fingerprints=fingerprints, regenerate=regen_stats,
                   tokenizer={"path": cfg.target.tokenizer, "len": len(tokenizer)},
                   columns={**FEATURES_SPEC, "prompt_len": "int32: tokens before the first assistant reply"})
    print(summary(info, counts, splits, regen_stats))
    return out


def summary(info: ReadInfo, counts: dict, splits: dict, regen_stats: Optional[dict]) -> str:
    lines = [f"[prepare] {info.stats.summary()}",
             f"[prepare] records read {counts['records_read']:,}, kept {counts['kept']:,}, "
             f"skipped {counts['skipped_total']:,}"]
    lines += [f"[prepare]   skipped {reason:<28} {n:,}" for reason, n in counts["skipped"].items() if n]
    for name, s in splits.items():
        lines.append(f"[prepare] {name:<10} {s['conversations']:,} conversations, {s['tokens']:,} tokens, "
                     f"{s['loss_tokens']:,} loss tokens, {s['truncated']:,} truncated")
    if regen_stats:
        lines.append(f"[prepare] regenerated with {regen_stats.get('backend')}: " +
                     ", ".join(f"{k} {v}" for k, v in regen_stats.items() if isinstance(v, int)))
    return "\n".join(lines)
