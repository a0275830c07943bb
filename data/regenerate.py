"""Regeneration: replace every assistant turn with the target's own response, so the drafter
learns the distribution it will have to predict at serving time.

Multi-turn: assistant turn k is generated from the conversation so far, in which the earlier
assistant turns are already the regenerated ones (the target answering its own history).
Two backends share one resumable store:
- `hf`: local batched generation with the target (`eagle3.target_io.load_target`);
- `openai`: any OpenAI-compatible `/v1/chat/completions` server (SGLang serving K2.5, vLLM,
  `data/openai_server.py`), a thread per conversation in flight, retries with exponential
  backoff and jitter on 5xx / 429 / connection errors / timeouts / malformed replies.
The store is a JSONL of finished conversations keyed by id, appended and fsynced per
conversation: a killed run loses at most the conversations in flight, and a rerun skips the
finished ones. Its name carries a hash of the generation settings, so changing the
temperature or the model never mixes two kinds of response in one dataset.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Optional

from data.prepare import Conversation, SkipCounter
from data.round_trip import last_segment, round_trip_len, round_trip_stop


class RegenerateError(RuntimeError):
    """Regeneration cannot run (bad store, unreachable model); the message says what to do."""


class GenerationFailed(Exception):
    """One conversation could not be regenerated (after retries); counted as `regen_failed`."""


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


PAST_MAX_LENGTH = "past_max_length"  # finish reason of a turn kept as written (see regenerate_batch)
ROUND_TRIP = "round_trip"  # finish reason of an answer cut where its text stops re-tokenizing to its tokens


def regenerate_batch(convs: list[Conversation], generate: BatchGenerate,
                     fits: Optional[Callable[[list[dict]], bool]] = None) -> list[tuple[list[dict], list[str]]]:
    """Regenerate the assistant turns of `convs` in lockstep: round j generates the j-th
    assistant turn of every conversation that has one, from its history so far (earlier
    turns already regenerated). Returns (new messages, finish reasons) per conversation.

    `fits(history)` says whether a turn starting after `history` can still reach the tokenized
    data; once it cannot (the history is already past prepare's max_length, so truncation drops
    everything after it), the rest of the conversation is kept as written, unregenerated, with
    finish reason `past_max_length`: generating text that is cut off anyway would only cost time."""
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

    def fits(history: list[dict]) -> bool:
        prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) < cfg.max_length

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


# ----------------------------------------------------------------------------------------------
# Local generation with the target (also what data/openai_server.py serves)
# ----------------------------------------------------------------------------------------------

class HFGenerator:
    """Batched chat generation with a loaded HF target: left-padded prompts rendered with the
    tokenizer's chat template (`add_generation_prompt=True`), stopping at the template's
    end-of-turn (`<|im_end|>` when the vocab has it) or the tokenizer's eos.

    `cut_at_round_trip`: an answer is kept (and generated) only as far as its text re-tokenizes to
    the generated tokens (data/round_trip.py), finish reason `round_trip` where it was cut; the
    stored text is then exactly the target's greedy tokens."""

    def __init__(self, model, tokenizer, *, temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int = 256,
                 seed: int = 0, max_positions: Optional[int] = None, cut_at_round_trip: bool = False):
        import torch

        self.model, self.tok = model, tokenizer
        self.cut_at_round_trip = cut_at_round_trip
        self.temperature, self.top_p, self.max_new_tokens, self.seed = temperature, top_p, max_new_tokens, seed
        self.max_positions = max_positions
        stop = {tokenizer.eos_token_id}
        vocab = tokenizer.get_vocab()
        end_turn = vocab.get("<|im_end|>")
        self.end_think = vocab.get("</think>")  # thinking models: reasoning ends here
        stop.add(end_turn)
        self.stop_ids = sorted(i for i in stop if i is not None)
        if not self.stop_ids:
            raise RegenerateError("the tokenizer has neither an eos token nor <|im_end|>: generation could not stop")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self._device = next(model.parameters()).device
        self._torch = torch

    @classmethod
    def from_target(cls, target, tokenizer, regen_conf) -> "HFGenerator":
        from eagle3.target_io import load_target

        model, text_config = load_target(target.path, target.layout, dtype=target.dtype, device_map=target.device_map,
                                         trust_remote_code=target.trust_remote_code)
        return cls(model, tokenizer, temperature=regen_conf.temperature, top_p=regen_conf.top_p,
                   max_new_tokens=regen_conf.max_new_tokens, seed=regen_conf.seed,
                   max_positions=text_config.get("max_position_embeddings"),
                   cut_at_round_trip=regen_conf.cut_at_round_trip)

    def generate(self, prompts: list[list[dict]], *, max_new_tokens: Optional[int] = None,
                 temperature: Optional[float] = None, top_p: Optional[float] = None,
                 seed: Optional[int] = None) -> list[tuple[str, str, Optional[str]]]:
        """(text, finish_reason "stop" | "length", reasoning or None) per message list."""
        torch = self._torch
        max_new = max_new_tokens or self.max_new_tokens
        temp = self.temperature if temperature is None else temperature
        texts = [self.tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        longest = max(len(x) for x in ids)
        if self.max_positions and longest + max_new > self.max_positions:
            raise GenerationFailed(f"prompt of {longest} tokens + {max_new} new exceeds the target's "
                                   f"{self.max_positions} positions")
        batch = torch.full((len(ids), longest), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(batch)
        for i, x in enumerate(ids):  # left padding: every prompt ends at the last column
            batch[i, longest - len(x):] = torch.tensor(x)
            attn[i, longest - len(x):] = 1
        kwargs = dict(do_sample=temp > 0, max_new_tokens=max_new, eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
        if temp > 0:
            kwargs.update(temperature=temp, top_p=self.top_p if top_p is None else top_p)
            torch.manual_seed(self.seed if seed is None else seed)
        if self.cut_at_round_trip:
            from transformers import StoppingCriteriaList

            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [round_trip_stop(self.tok, longest, self.stop_ids, self.end_think)])
        with torch.no_grad():
            out = self.model.generate(input_ids=batch.to(self._device), attention_mask=attn.to(self._device), **kwargs)
        results = []
        for row in out[:, longest:].tolist():
            stop_at = next((j for j, t in enumerate(row) if t in self.stop_ids), None)
            reason = "length" if stop_at is None else "stop"
            row = row if stop_at is None else row[:stop_at]
            if self.cut_at_round_trip:
                row, reason = self._cut_row(row, reason)
            reasoning, answer = split_reasoning(row, self.end_think)
            decode = lambda ids: self.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
            results.append((decode(answer), reason, decode(reasoning) if reasoning is not None else None))
        return results

    def _cut_row(self, row: list[int], reason: str) -> tuple[list[int], str]:
        """The row up to where its last segment (the answer, or the reasoning still open) stops
        surviving the round trip; rows stopped by `round_trip_stop` end in padding, dropped here."""
        if reason == "length":
            while row and row[-1] == self.pad_id:
                row = row[:-1]
        seg = last_segment(row, self.end_think)
        keep = round_trip_len(self.tok, seg)
        if keep == len(seg):
            return row, reason
        return row[: len(row) - len(seg) + keep], ROUND_TRIP


def split_reasoning(ids: list[int], end_think: Optional[int]) -> tuple[Optional[list[int]], list[int]]:
    """(reasoning ids or None, answer ids): a generation that closes a thinking block (the
    prompt of a thinking template ends with `<think>`) is split at its last `</think>`."""
    if end_think is None or end_think not in ids:
        return None, ids
    j = len(ids) - 1 - ids[::-1].index(end_think)
    return ids[:j], ids[j + 1:]


# ----------------------------------------------------------------------------------------------
# The OpenAI-compatible client
# ----------------------------------------------------------------------------------------------

RETRYABLE_STATUS = {408, 409, 425, 429}  # and every 5xx


class ChatClient:
    """`/v1/chat/completions` over httpx (thread-safe; one instance serves all worker threads).
    Retries 5xx / 429 / timeouts / connection errors / malformed replies with exponential
    backoff (base * 2^attempt, capped, x[0.5, 1) jitter; a 429's Retry-After is honoured up to
    the cap); other 4xx fail the conversation at once (retrying cannot help). Retries are
    counted in total and by kind (`retries_by_kind`)."""

    def __init__(self, base_url: str, model: str, *, api_key: Optional[str] = None, timeout_s: float = 300.0,
                 max_retries: int = 5, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 temperature: float = 0.0, top_p: float = 1.0, max_tokens: int = 256, seed: Optional[int] = None,
                 sleep: Callable[[float], None] = time.sleep):
        import httpx

        self.url = base_url.rstrip("/") + "/chat/completions"
        self.base_url = base_url.rstrip("/")
        self.model, self.max_retries, self.backoff_s, self.backoff_max_s = model, max_retries, backoff_s, backoff_max_s
        self.params = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        if seed is not None:
            self.params["seed"] = seed
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._httpx = httpx
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers)
        self.sleep = sleep
        self.retries = 0
        self.retries_by_kind: dict[str, int] = {}  # timeout | connection | malformed | 5xx | 429 | 408 ...
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    @classmethod
    def from_conf(cls, r) -> "ChatClient":
        o = r.openai
        return cls(o.base_url, o.model, api_key=os.environ.get(o.api_key_env) or None, timeout_s=o.timeout_s,
                   max_retries=o.max_retries, backoff_s=o.backoff_s, backoff_max_s=o.backoff_max_s,
                   temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens, seed=r.seed)

    def preflight(self) -> None:
        """Fail the stage early, naming the URL, if nothing listens there at all."""
        for attempt in range(self.max_retries + 1):
            try:
                self.http.get(self.base_url + "/models")
                return
            except self._httpx.TransportError as e:
                last = e
                self._backoff(attempt, None, "connection")
        raise RegenerateError(f"cannot reach the OpenAI-compatible server at {self.base_url} ({last!r}); "
                              "start it (e.g. SGLang, or python data/openai_server.py) or fix regenerate.openai.base_url")

    def _backoff(self, attempt: int, retry_after: Optional[str], kind: str) -> None:
        if attempt >= self.max_retries:
            return
        with self._lock:
            self.retries += 1
            self.retries_by_kind[kind] = self.retries_by_kind.get(kind, 0) + 1
            jitter = 0.5 + 0.5 * self._rng.random()
        wait = min(self.backoff_max_s, self.backoff_s * 2 ** attempt) * jitter
        if retry_after:
            try:
                wait = max(wait, min(float(retry_after), self.backoff_max_s))
            except ValueError:
                pass
        self.sleep(wait)

    def complete(self, messages: list[dict]) -> tuple[str, str, Optional[str]]:
        """(assistant text, finish_reason, reasoning or None) for one prompt; GenerationFailed
        after the retries."""
        httpx = self._httpx
        body = {"model": self.model, "messages": messages, "stream": False, **self.params}
        last = "no attempt made"
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                resp = self.http.post(self.url, json=body)
            except httpx.TimeoutException as e:
                kind, last = "timeout", f"timeout ({type(e).__name__})"
            except httpx.TransportError as e:  # refused, reset, a reply cut short
                kind, last = "connection", f"connection error ({type(e).__name__}: {e})"
            else:
                if resp.status_code == 200:
                    try:
                        return _parse_completion(resp)
                    except (ValueError, KeyError, IndexError, TypeError) as e:
                        kind, last = "malformed", f"malformed reply ({e})"
                elif resp.status_code >= 500 or resp.status_code in RETRYABLE_STATUS:
                    kind = "5xx" if resp.status_code >= 500 else str(resp.status_code)
                    last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    retry_after = resp.headers.get("retry-after")
                else:
                    raise GenerationFailed(f"HTTP {resp.status_code} from {self.url}: {resp.text[:300]}")
            self._backoff(attempt, retry_after, kind)
        raise GenerationFailed(f"gave up after {self.max_retries + 1} attempts; last: {last}")

    def close(self) -> None:
        self.http.close()


def _parse_completion(resp) -> tuple[str, str]:
    data = resp.json()  # ValueError on a body that is not JSON
    choice = data["choices"][0]
    text = choice["message"]["content"]
    if not isinstance(text, str):
        raise TypeError(f"message.content is {type(text).__name__}, not a string")
    reasoning = choice["message"].get("reasoning_content")  # SGLang / vLLM with a reasoning parser
    return text, str(choice.get("finish_reason") or "stop"), reasoning if isinstance(reasoning, str) else None
