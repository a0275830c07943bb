"""Regeneration: replace every assistant turn with the target's own response, so the drafter
learns the distribution it will have to predict at serving time.

Multi-turn: assistant turn k is generated from the conversation so far, in which the earlier
assistant turns are already the regenerated ones (the target answering its own history).
Two backends share one resumable store:
- `hf`: local batched generation with the target (`eagle3.target_model.target_io.load_target`);
- `openai`: any OpenAI-compatible `/v1/chat/completions` server (SGLang serving K2.5, vLLM,
  `data/openai_server.py`), a thread per conversation in flight, retries with exponential
  backoff and jitter on 5xx / 429 / connection errors / timeouts / malformed replies.
The store is a JSONL of finished conversations keyed by id, appended and fsynced per
conversation: a killed run loses at most the conversations in flight, and a rerun skips the
finished ones. Its name carries a hash of the generation settings, so changing the
temperature or the model never mixes two kinds of response in one dataset.

Modules: this one (the store, the turn-by-turn driver), data/hf_generator.py, data/chat_client.py,
data/regen_common.py (errors, finish reasons); every name is importable from here.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Optional

from data.chat_client import ChatClient
from data.conversations import Conversation, SkipCounter, unencodable
from data.hf_generator import HFGenerator, split_reasoning
from data.regen_common import PAST_MAX_LENGTH, ROUND_TRIP, GenerationFailed, RegenerateError
from data.template_encoder import TemplateEncoder

__all__ = ["ChatClient", "GenerationFailed", "HFGenerator", "PAST_MAX_LENGTH", "ROUND_TRIP", "RegenStore",
           "RegenerateError", "assistant_message", "regenerate_batch", "regenerate_conversations", "settings_of",
           "split_reasoning", "store_path"]


# ----------------------------------------------------------------------------------------------
# The resumable store
# ----------------------------------------------------------------------------------------------

class RegenStore:
    """Append-only JSONL: line 1 `{"header": settings}`, then one `{"id", "messages",
    "finish_reasons"}` per finished conversation. A partial last line (a kill mid-write) is
    cut off on open. Only offsets are kept in memory; `get` reads a record back."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.settings = Path(path), settings
        self.offsets: dict[str, int] = {}
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size > 0:
            self._load()
        else:
            with open(self.path, "wb") as f:
                f.write((json.dumps({"header": settings}) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())

    def _load(self) -> None:
        good_end = 0
        with open(self.path, "rb") as f:
            for n, line in enumerate(iter(f.readline, b"")):
                if not line.endswith(b"\n"):
                    break  # partial tail of a killed write
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    break
                if n == 0:
                    if obj.get("header") != self.settings:
                        raise RegenerateError(
                            f"{self.path} was written with other generation settings ({obj.get('header')}) than "
                            f"this run's ({self.settings}); remove it or set regenerate.out_file elsewhere")
                else:
                    self.offsets[obj["id"]] = good_end
                good_end += len(line)
        if good_end < self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good_end)

    def __contains__(self, conv_id: str) -> bool:
        return conv_id in self.offsets

    def append(self, conv_id: str, messages: list[dict], finish_reasons: list[str]) -> None:
        line = (json.dumps({"id": conv_id, "messages": messages, "finish_reasons": finish_reasons},
                           ensure_ascii=False) + "\n").encode()
        with self._lock, open(self.path, "ab") as f:
            offset = f.tell()
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
            self.offsets[conv_id] = offset

    def get(self, conv_id: str) -> dict:
        with open(self.path, "rb") as f:
            f.seek(self.offsets[conv_id])
            return json.loads(f.readline())


def settings_of(cfg) -> dict:
    """What decides the responses (and so the store's identity)."""
    r = cfg.regenerate
    s = {"backend": r.backend, "temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
         "seed": r.seed, "max_length": cfg.max_length}  # turns past max_length are kept as written
    # openai: the served model's name and the target, not the URL (a restarted server on another
    # port resumes the same store); hf: the target checkpoint itself.
    s["model"] = f"{r.openai.model} ({cfg.target.name})" if r.backend == "openai" else cfg.target.path
    if r.backend == "hf" and r.cut_at_round_trip:  # (absent when off: stores written before it stay valid)
        s["cut_at_round_trip"] = True
    if r.backend == "hf" and r.no_repeat_ngram_size:  # (absent when off, as above)
        s["no_repeat_ngram_size"] = r.no_repeat_ngram_size
    if r.backend == "hf" and r.sampled_opening_tokens:
        s["sampled_opening_tokens"] = r.sampled_opening_tokens
    if r.backend == "hf" and r.canonical_tokens:
        s["canonical_tokens"] = True
    if r.backend == "hf" and r.temperature > 0:  # sampled per prompt (data/row_sampling.py), not per batch as before
        s["sampling"] = "per_prompt"
    return s


def store_path(cfg, settings: dict) -> Path:
    if cfg.regenerate.out_file:
        return Path(cfg.regenerate.out_file)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cfg.out_dir) / "regenerated" / f"{settings['backend']}-{digest}.jsonl"


# ----------------------------------------------------------------------------------------------
# Turn-by-turn regeneration of one conversation (any backend)
# ----------------------------------------------------------------------------------------------

# generate(list of message lists) -> one (text, finish_reason[, reasoning]) per prompt.
BatchGenerate = Callable[[list[list[dict]]], list[tuple]]


def assistant_message(text: str, reasoning: Optional[str] = None) -> dict:
    """A thinking model's reasoning goes to `reasoning_content` (the field Kimi's template and
    SGLang's reasoning parser use), so the chat template decides how it is rendered."""
    msg = {"role": "assistant", "content": text}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg




def regenerate_batch(convs: list[Conversation], generate: BatchGenerate,
                     fits: Optional[Callable[[list[dict]], bool]] = None) -> list[tuple[list[dict], list[str]]]:
    """Regenerate the assistant turns of `convs` in lockstep: round j generates the j-th
    assistant turn of every conversation that has one, from its history so far (earlier
    turns already regenerated). Returns (new messages, finish reasons) per conversation.

    `fits(history)` says whether a turn starting after `history` can still reach the tokenized
    data; once it cannot (the history is already past prepare's max_length, so truncation drops
    everything after it), the rest of the conversation is kept as written, unregenerated, with
    finish reason `past_max_length`: generating text that is cut off anyway would only cost time.

    A reply that is not encodable Unicode (a server's JSON may spell a lone surrogate) fails its
    conversation with GenerationFailed: it could be neither stored nor tokenized."""
    new = [[] for _ in convs]  # messages built so far
    reasons = [[] for _ in convs]
    pos = [0] * len(convs)  # next source message to copy
    while True:
        batch = []
        for c, conv in enumerate(convs):
            msgs = conv.messages
            while pos[c] < len(msgs) and msgs[pos[c]]["role"] != "assistant":
                new[c].append(dict(msgs[pos[c]]))
                pos[c] += 1
            if pos[c] < len(msgs) and fits is not None and not fits(new[c]):
                for m in msgs[pos[c]:]:
                    new[c].append(dict(m))
                    reasons[c].extend([PAST_MAX_LENGTH] if m["role"] == "assistant" else [])
                pos[c] = len(msgs)
            if pos[c] < len(msgs):
                batch.append(c)
        if not batch:
            return list(zip(new, reasons))
        outs = generate([list(new[c]) for c in batch])  # copies: the lists grow after this
        for c, (text, reason, *reasoning) in zip(batch, outs):
            for part in (text, *reasoning):
                bad = unencodable(part) if isinstance(part, str) else None
                if bad is not None:
                    raise GenerationFailed(f"unencodable_text: the reply to message {pos[c]} is not encodable "
                                           f"Unicode ({bad})")
            new[c].append(assistant_message(text, *reasoning))
            reasons[c].append(reason)
            pos[c] += 1


def regenerate_conversations(convs: list[Conversation], cfg, tokenizer, skips: SkipCounter):
    """Regenerate `convs` (prepare config `cfg`), resuming from the store. Returns the
    regenerated conversations in input order and the stats for the manifest; a conversation
    that could not be regenerated is counted in `skips` as `regen_failed`."""
    from tqdm import tqdm

    r = cfg.regenerate
    if r.max_conversations is not None:
        convs = convs[: r.max_conversations]
    settings = settings_of(cfg)
    store = RegenStore(store_path(cfg, settings), settings)
    todo = [c for c in convs if c.id not in store]
    stats = {"backend": r.backend, "store": str(store.path), "conversations": len(convs),
             "resumed": len(convs) - len(todo), "generated": 0, "failed": 0, "turns": 0, "turns_hit_max_tokens": 0}
    failures: dict[str, str] = {}
    bar = tqdm(total=len(todo), desc=f"regenerate ({r.backend})", unit="conv", mininterval=2)

    def finished(conv: Conversation, msgs: list[dict], fins: list[str]) -> None:
        store.append(conv.id, msgs, fins)
        stats["generated"] += 1
        bar.update(1)

    encoder = TemplateEncoder(tokenizer, cfg.max_length)

    def fits(history: list[dict]) -> bool:
        try:
            return encoder.prompt_fits(history)
        except Exception as e:  # the template or tokenizer rejects this history: this conversation fails
            raise GenerationFailed(f"rendering the history for the next turn failed: {type(e).__name__}: {e}") from e

    if todo and r.backend == "hf":
        gen = HFGenerator.from_target(cfg.target, tokenizer, r)
        todo.sort(key=lambda c: sum(len(m["content"]) for m in c.messages))  # similar lengths: less padding
        for i in range(0, len(todo), r.batch_size):
            chunk = todo[i: i + r.batch_size]
            try:
                results = list(zip(chunk, regenerate_batch(chunk, gen.generate, fits)))
            except GenerationFailed:  # one conversation spoils the batch: redo them one by one
                results = []
                for conv in chunk:
                    try:
                        results.append((conv, regenerate_batch([conv], gen.generate, fits)[0]))
                    except GenerationFailed as e:
                        failures[conv.id] = str(e)
                        bar.update(1)
            for conv, (msgs, fins) in results:
                finished(conv, msgs, fins)
        if r.canonical_tokens:
            stats["canonical_vetoed_tokens"] = gen.vetoed_tokens  # picks refused for another candidate
    elif todo and r.backend == "openai":
        client = ChatClient.from_conf(r)
        client.preflight()
        pool = ThreadPoolExecutor(max_workers=r.openai.concurrency)
        try:
            futs = {pool.submit(regenerate_batch, [c], lambda ms: [client.complete(ms[0])], fits): c for c in todo}
            for fut in as_completed(futs):
                conv = futs[fut]
                try:
                    (msgs, fins), = fut.result()
                except GenerationFailed as e:
                    failures[conv.id] = str(e)
                    bar.update(1)
                    continue
                finished(conv, msgs, fins)  # only this thread writes the store
        finally:  # on Ctrl-C / an error: drop the queued conversations (finished ones are on disk)
            pool.shutdown(wait=False, cancel_futures=True)
            client.close()
        stats["retries"] = client.retries
        stats["retries_by_kind"] = dict(sorted(client.retries_by_kind.items()))
    bar.close()

    out = []
    for conv in convs:
        if conv.id not in store:
            stats["failed"] += 1
            skips.add("regen_failed", conv.location or conv.id, failures.get(conv.id, "not generated"))
            continue
        rec = store.get(conv.id)
        stats["turns"] += len(rec["finish_reasons"])
        stats["turns_hit_max_tokens"] += sum(f == "length" for f in rec["finish_reasons"])
        stats["turns_past_max_length"] = stats.get("turns_past_max_length", 0) + sum(
            f == PAST_MAX_LENGTH for f in rec["finish_reasons"])
        stats["turns_cut_at_round_trip"] = stats.get("turns_cut_at_round_trip", 0) + sum(
            f == ROUND_TRIP for f in rec["finish_reasons"])
        out.append(Conversation(conv.id, rec["messages"], conv.location))
    return out, stats
