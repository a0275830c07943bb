"""Regeneration's `openai` backend: a retrying client of any OpenAI-compatible
`/v1/chat/completions` server (SGLang serving K2.5, vLLM, data/openai_server.py)."""
from __future__ import annotations

import os
import random
import threading
import time
from typing import Callable, Optional

from data.image_messages import openai_messages
from data.regen_common import GenerationFailed, RegenerateError


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
        # a user turn's images travel as image_url parts (data URIs) before its text
        body = {"model": self.model, "messages": openai_messages(messages), "stream": False, **self.params}
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
