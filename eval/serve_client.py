"""HTTP to a running SGLang or vLLM server for `make bench-serve` (standard library only): probes,
one streamed request with its timings, and retries that are counted. Field names come from
eagle3/engines/serve_protocol.py.

SGLang: POST /generate {"input_ids", "sampling_params", "stream": true}; server-sent events
`data: {"text", "output_ids", "meta_info"}` (output_ids cumulative by default, incremental with
--incremental-streaming-output: both are read), `data: [DONE]`.
vLLM: POST /v1/completions {"prompt": token ids, "stream": true, "return_token_ids": true,
"stream_options": {"include_usage": true}}; chunks carry choices[0].token_ids (the delta), the last
one `usage`; GET /metrics before and after each request gives that request's spec-decode counts
(concurrency 1).
"""
from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from eagle3.engines import serve_protocol as sp


class Unreachable(OSError):
    """No HTTP answer from the server at all."""


class RequestFailed(RuntimeError):
    def __init__(self, message: str, retryable: bool, timeout: bool = False):
        super().__init__(message)
        self.retryable, self.timeout = retryable, timeout


def get(url: str, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, ConnectionError, socket.timeout, http.client.HTTPException) as e:
        raise Unreachable(f"{url}: {getattr(e, 'reason', e)}") from None


def get_json(url: str, timeout: float) -> Optional[dict]:
    """The JSON body of a 200 answer, None for any other status (the endpoint does not exist there)."""
    status, body = get(url, timeout)
    if status != 200:
        return None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return None


def sglang_server_info(base: str, timeout: float) -> Optional[dict]:
    for path in sp.SERVER_INFO_PATHS:
        info = get_json(base + path, timeout)
        if info is not None:
            return info
    return None


def vllm_metrics(base: str, timeout: float) -> sp.VllmCounters:
    status, body = get(base + "/metrics", timeout)
    if status != 200:
        raise RequestFailed(f"{base}/metrics answered {status}", retryable=True)
    return sp.read_vllm_counters(body)


def vllm_model(base: str, timeout: float) -> Optional[dict]:
    models = get_json(base + "/v1/models", timeout)
    data = (models or {}).get("data") or []
    return data[0] if data else None


@dataclass
class Streamed:
    """One streamed request as the client saw it (times in ms from sending)."""
    output_ids: list
    ttft_ms: float
    last_token_ms: float
    e2e_ms: float
    final: dict = field(default_factory=dict)   # SGLang: the last meta_info; vLLM: the usage object
    finish_reason: Optional[str] = None


def _sse_events(resp) -> Iterator[tuple[float, object]]:
    """(time, parsed JSON) per `data:` line until [DONE]."""
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            yield time.perf_counter(), json.loads(data)
        except json.JSONDecodeError:
            raise RequestFailed(f"malformed stream event {data[:80]!r}", retryable=True) from None


def _post_stream(url: str, body: dict, timeout: float, on_event: Callable[[float, object], None]) -> float:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for t, ev in _sse_events(resp):
                on_event(t, ev)
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")[:200]
        raise RequestFailed(f"HTTP {e.code}: {detail}", retryable=e.code >= 500 or e.code == 429) from None
    except (socket.timeout, TimeoutError) as e:
        raise RequestFailed(f"timed out after {timeout:g} s ({e})", retryable=True, timeout=True) from None
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise RequestFailed(f"timed out after {timeout:g} s ({reason})", retryable=True, timeout=True) from None
        raise RequestFailed(f"connection: {reason}", retryable=True) from None
    return t0


def sglang_generate(base: str, input_ids: list, max_new_tokens: int, temperature: float, timeout: float) -> Streamed:
    acc: list = []
    marks: dict = {"first": None, "last": None, "meta": {}}

    def on_event(t, ev):
        ids = list(ev.get("output_ids") or [])
        before = len(acc)
        if len(ids) >= len(acc) and ids[:len(acc)] == acc:
            acc[:] = ids                       # cumulative (SGLang's default)
        else:
            acc.extend(ids)                    # incremental streaming
        if len(acc) > before:
            marks["first"] = marks["first"] or t
            marks["last"] = t
        marks["meta"] = ev.get("meta_info") or marks["meta"]

    body = {"input_ids": list(input_ids), "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature}}
    t0 = _post_stream(base + "/generate", body, timeout, on_event)
    return _finish(t0, acc, marks, marks["meta"], (marks["meta"].get("finish_reason") or {}))


def vllm_complete(base: str, model: str, input_ids: list, max_new_tokens: int, temperature: float,
                  timeout: float) -> Streamed:
    acc: list = []
    marks: dict = {"first": None, "last": None, "usage": {}, "finish": None}

    def on_event(t, ev):
        for ch in ev.get("choices") or []:
            ids = ch.get("token_ids") or []
            if ids:
                acc.extend(ids)
                marks["first"] = marks["first"] or t
                marks["last"] = t
            marks["finish"] = ch.get("finish_reason") or marks["finish"]
        marks["usage"] = ev.get("usage") or marks["usage"]

    body = {"model": model, "prompt": list(input_ids), "max_tokens": max_new_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    t0 = _post_stream(base + "/v1/completions", body, timeout, on_event)
    return _finish(t0, acc, marks, marks["usage"], {"type": marks["finish"]})


def _finish(t0: float, acc: list, marks: dict, final: dict, finish) -> Streamed:
    if not acc or marks["first"] is None:
        raise RequestFailed("the stream ended without a token", retryable=True)
    ms = lambda t: 1000.0 * (t - t0)  # noqa: E731
    reason = finish.get("type") if isinstance(finish, dict) else finish
    return Streamed(acc, ms(marks["first"]), ms(marks["last"]), ms(time.perf_counter()), dict(final), reason)


@dataclass
class Attempts:
    attempts: int = 0
    timeouts: int = 0
    errors: list = field(default_factory=list)


def with_retries(call: Callable[[], object], retries: int, backoff_s: float, log: Attempts):
    """call() until it succeeds or `retries` re-tries are spent; every failure is counted in `log`.
    Raises the last RequestFailed."""
    while True:
        log.attempts += 1
        try:
            return call()
        except RequestFailed as e:
            log.timeouts += int(e.timeout)
            log.errors.append(str(e))
            if not e.retryable or log.attempts > retries:
                raise
            time.sleep(backoff_s * log.attempts)
