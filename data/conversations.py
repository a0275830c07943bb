"""Prepare's records: raw conversation records (ShareGPT / OpenAI messages) -> validated
`Conversation`s, every dropped record counted by reason (`SKIP_REASONS`)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from data.image_messages import image_part_source, load_image, place_record_images, record_images
from eagle3.errors import StageError


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
    "ambiguous_record",  # both `conversations` and `messages` (or a turn's `from`/`role`, `value`/`content`) differ
    "empty_conversation",  # no messages, or only empty ones
    "no_assistant_turn",  # no assistant turn after a user turn
    "unknown_role",
    "non_string_content",
    "unencodable_text",  # text or id that is not encodable Unicode (a lone surrogate such as "\ud800")
    "duplicate_id",
    "too_long",  # nothing trainable fits in max_length (or on_overlong=skip and it is longer)
    "template_error",  # the chat template raised on this conversation
    "tokenizer_error",  # the tokenizer raised on this conversation's rendering
    "template_not_prefix_stable",  # the loss mask cannot be derived from the template (see module doc)
    "regen_failed",  # regeneration gave up on this conversation (after retries)
    "missing_image",  # an image reference that names no file (or is not a string)
    "undecodable_image",  # bytes no image decoder reads (or a data URI that is not base64)
    "oversized_image",  # an image file / decoded image over the size limit (eagle3/target_model/images.py)
    "remote_image",  # an http(s) image URL: nothing is downloaded; inline it as a data URI
    "image_unsupported",  # an image for a target that reads none (text-only K2), or one outside a user turn
    "image_token_mismatch",  # <|media_pad|> runs that do not match the images' counts, or <image> markers the images
)


class PrepareError(StageError, RuntimeError):
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
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str[, "images": [data URI]]}, ...]
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


def unencodable(text: str) -> Optional[str]:
    """None for text that is encodable Unicode, else where it is not. JSON can spell lone surrogates
    (`"\\ud800"` is valid JSON) that no UTF-8 file, Arrow column or tokenizer accepts; found here, one
    such record is skipped instead of failing the batch it would be tokenized or written with."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return f"lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"


def _check_encodable(text: str, what: str) -> str:
    bad = unencodable(text)
    if bad is not None:
        raise Skip("unencodable_text", f"{what} is not encodable Unicode ({bad})")
    return text


def _one_of(d: dict, keys: tuple[str, str], what: str, same=lambda v: v) -> Any:
    """The value under whichever of two synonymous keys is set (not null); both set to values that
    differ (by `same`) is ambiguous: which one the author meant is unknown, so the record is skipped."""
    present = [k for k in keys if d.get(k) is not None]
    if len(present) == 2 and same(d[keys[0]]) != same(d[keys[1]]):
        raise Skip("ambiguous_record", f"{what} has both {keys[0]!r} and {keys[1]!r}, with different values")
    return d[present[0]] if present else None


def _role(role: Any) -> Any:
    return ROLE_MAP.get(role.strip().lower(), role) if isinstance(role, str) else role


def _content_text(content: Any, k: int) -> tuple[str, list]:
    """A message's content as a string and its image references. OpenAI-style lists of text and image
    parts (data/image_messages.py) are split into the joined text and the images; anything else that is
    not a string (null, numbers, dicts, unknown parts) is a `non_string_content` skip."""
    if isinstance(content, str):
        return content, []
    if isinstance(content, list) and content and all(isinstance(p, dict) for p in content):
        texts, refs = [], []
        for p in content:
            if p.get("type") == "text" and isinstance(p.get("text"), str):
                texts.append(p["text"])
            elif (ref := image_part_source(p)) is not None:
                refs.append(ref)
            else:
                break
        else:
            return "".join(texts), refs
    raise Skip("non_string_content", f"message {k} has content of type {type(content).__name__}")


def _load_images(messages: list[dict], base_dir: Optional[Path]) -> None:
    """Read, decode and size-check every image of the messages (data/image_messages.py), in place."""
    from eagle3.target_model.images import ImageError

    for k, m in enumerate(messages):
        if not m.get("images"):
            continue
        if m["role"] != "user":
            raise Skip("image_unsupported", f"message {k} ({m['role']}) has an image; images go in user turns")
        try:
            m["images"] = [load_image(ref, base_dir) for ref in m["images"]]
        except ImageError as e:
            raise Skip(e.reason, f"message {k}: {e.detail}") from e


def conversation_from_record(value: Any, fallback_id: str, location: str = "",
                             base_dir: Optional[Path] = None) -> tuple[Conversation, int, int]:
    """Validate one raw record (ShareGPT `{"id", "conversations": [{"from", "value"}]}` or
    OpenAI-style `{"id", "messages": [{"role", "content"}]}`) into a Conversation.

    Assistant turns before the first user turn answer nothing the model saw (ShareGPT splits long
    chats into parts that start mid-way; a system prompt is context, not a question): they are
    dropped, and a system prompt before them is kept. Messages after the last assistant turn carry
    no loss and are dropped too. Returns the conversation, the number of leading assistant turns
    dropped and the number of trailing messages dropped; raises Skip for a bad record. Images (relative
    paths resolved against `base_dir`) are read and checked here (data/image_messages.py)."""
    if not isinstance(value, dict):
        raise Skip("not_a_conversation", f"record is a {type(value).__name__}, not an object")
    turns = _one_of(value, ("conversations", "messages"), "the record")
    if turns is None:
        raise Skip("not_a_conversation", f"no 'conversations' or 'messages' key (keys: {sorted(value)[:8]})")
    if not isinstance(turns, list):
        key = "conversations" if value.get("conversations") is not None else "messages"
        raise Skip("not_a_conversation", f"{key!r} is a {type(turns).__name__}, not a list")
    raw_id = value.get("id")
    conv_id = str(raw_id) if isinstance(raw_id, (str, int)) and str(raw_id) != "" else fallback_id
    _check_encodable(conv_id, "the id")
    messages = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise Skip("not_a_conversation", f"message {k} is a {type(turn).__name__}, not an object")
        role = _role(_one_of(turn, ("from", "role"), f"message {k}", _role))
        if role not in ("user", "assistant", "system"):
            raise Skip("unknown_role", f"message {k} has role {role!r}")
        content, refs = _content_text(_one_of(turn, ("value", "content"), f"message {k}"), k)
        messages.append({"role": role, "content": _check_encodable(content, f"message {k}")})
        if refs:
            messages[-1]["images"] = refs
    if (problem := place_record_images(messages, record_images(value))) is not None:
        raise Skip("image_token_mismatch", problem)
    _load_images(messages, base_dir)
    if not messages or all(not m["content"].strip() for m in messages):
        raise Skip("empty_conversation", f"{len(messages)} messages, none with text")
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    leading = sum(m["role"] == "assistant" for m in messages[:first_user])
    kept = [m for m in messages[:first_user] if m["role"] != "assistant"] + messages[first_user:]
    assistant = [i for i, m in enumerate(kept) if m["role"] == "assistant"]
    if not assistant:
        roles = [m["role"] for m in messages][:8]
        raise Skip("no_assistant_turn", f"no assistant turn after a user turn (roles: {roles})")
    return Conversation(conv_id, kept[: assistant[-1] + 1], location), leading, len(kept) - 1 - assistant[-1]


@dataclass
class ReadInfo:
    """What reading the input found, besides the conversations themselves."""
    stats: Any = None  # data.corpus.ReadStats
    records: int = 0  # raw records looked at (good + malformed)
    leading_dropped: int = 0  # assistant turns before the first user turn, dropped (kept records only)
    trailing_dropped: int = 0  # messages after the last assistant turn, dropped (kept records only)


def read_conversations(path, skips: SkipCounter, info: ReadInfo, max_records: Optional[int] = None):
    """Yield validated Conversations from a JSON / JSONL file or HF dataset dir, counting
    every dropped record in `skips` and the totals in `info`."""
    from data.corpus import ReadStats, iter_raw_records

    info.stats, seen = ReadStats(), set()
    name = Path(path).name
    base_dir = Path(path).parent if Path(path).is_file() else Path(path)
    for rec in iter_raw_records(path, info.stats):
        if max_records is not None and info.records >= max_records:
            break
        info.records += 1
        if rec.error is not None:
            skips.add("malformed", rec.location, rec.error)
            continue
        try:
            conv, leading, trailing = conversation_from_record(rec.value, f"{name}:{rec.index}", rec.location,
                                                               base_dir)
        except Skip as s:
            skips.add(s.reason, rec.location, s.detail)
            continue
        if conv.id in seen:
            skips.add("duplicate_id", rec.location, f"id {conv.id!r} seen before")
            continue
        seen.add(conv.id)
        info.leading_dropped += leading
        info.trailing_dropped += trailing
        yield conv
