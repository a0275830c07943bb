"""A small OpenAI-compatible chat server over a local HF target, with fault injection.

Serves `POST /v1/chat/completions` (non-streaming), `GET /v1/models` and `GET /health` on a
local target (the mini world's k25-mini by default), so `regenerate.backend=openai` can be run
and tested end to end without SGLang:

    python data/openai_server.py --target runs/mini_world/k25-mini --tokenizer runs/mini_world/tokenizer \\
        --layout kimi_k25 --port 30000
    python data/run_prepare.py regenerate.backend=openai regenerate.openai.base_url=http://127.0.0.1:30000/v1
    python data/openai_server.py --echo --port 0 --fault-rate 500=0.2   # model-free, for fault drills

Faults (for the fault suite): a `FaultPlan` picks an action for every completion request, from
an exact `script` (request n gets script[n]) and then at random by `rates`:
  ok | 500 | 502 | 503 | 429 | reset (TCP RST, no reply) | hang (no reply until hang_s) |
  malformed (200 with a cut JSON body) | truncated (Content-Length longer than the body) |
  empty (200 with valid JSON but no choices) | slow (answers after slow_s)
`server.request_log` records (request number, action) for assertions. Generation is serialised
(one request at a time) so greedy answers are deterministic.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from eagle3.config.choices import TARGET_LAYOUTS

ACTIONS = ("ok", "500", "502", "503", "429", "reset", "hang", "malformed", "truncated", "empty", "slow")

# generate(messages, max_tokens, temperature, top_p, seed) -> (text, finish_reason[, reasoning])
GenerateFn = Callable[[list, int, float, float, Optional[int]], tuple]


@dataclass
class FaultPlan:
    script: list = field(default_factory=list)  # exact action of request 0, 1, ...
    rates: dict = field(default_factory=dict)  # after the script: action -> probability (rest: ok)
    slow_s: float = 2.0
    hang_s: float = 60.0
    seed: int = 0

    def __post_init__(self):
        bad = [a for a in list(self.script) + list(self.rates) if a not in ACTIONS]
        if bad:
            raise ValueError(f"unknown fault actions {bad}; known: {ACTIONS}")
        if sum(self.rates.values()) > 1:
            raise ValueError(f"fault rates sum to {sum(self.rates.values())} > 1")
        self._rng = random.Random(self.seed)

    def action(self, n: int) -> str:
        if n < len(self.script):
            return self.script[n]
        u, acc = self._rng.random(), 0.0
        for name, p in sorted(self.rates.items()):
            acc += p
            if u < acc:
                return name
        return "ok"


class LocalServer:
    """A local HTTP server on its own thread (one thread per request): `.start()`, `.stop()` or `with`. The
    chat server below and the test stand-in of a serving engine (tests/standins/serve_standin.py) extend it;
    `_stopping` wakes handlers that hang or are slow on purpose."""

    def __init__(self, handler: type, host: str = "127.0.0.1", port: int = 0):
        self._stopping = threading.Event()
        self.httpd = _QuietServer((host, port), handler)
        self.httpd.daemon_threads = True

    def start(self):
        threading.Thread(target=self.httpd.serve_forever, name=type(self).__name__, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class ChatServer(LocalServer):
    """`ChatServer(generate).start()`; `.url` is the `/v1` base URL; `.stop()` (or `with`)."""

    def __init__(self, generate: GenerateFn, host: str = "127.0.0.1", port: int = 0,
                 faults: Optional[FaultPlan] = None, model_name: str = "local"):
        self.generate, self.faults, self.model_name = generate, faults or FaultPlan(), model_name
        self.request_log: list[tuple[int, str]] = []
        self._count = 0
        self._lock = threading.Lock()  # request numbering
        self._gen_lock = threading.Lock()  # one generation at a time
        super().__init__(_make_handler(self), host, port)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def next_action(self) -> tuple[int, str]:
        with self._lock:
            n = self._count
            self._count += 1
            action = self.faults.action(n)
            self.request_log.append((n, action))
        return n, action

    def completion(self, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise _BadRequest("'messages' must be a non-empty list of {role: str, content: str}")
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 256)
        temperature = float(body.get("temperature", 1.0))
        top_p = float(body.get("top_p", 1.0))
        seed = body.get("seed")
        with self._gen_lock:
            text, finish, *reasoning = self.generate(messages, max_tokens, temperature, top_p, seed)
        message = {"role": "assistant", "content": text}
        if reasoning and reasoning[0]:
            message["reasoning_content"] = reasoning[0]
        return {"id": f"chatcmpl-{self._count}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", self.model_name),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}]}


class _BadRequest(ValueError):
    pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # A client that gave up (its timeout) or a socket reset on purpose is part of the job;
        # anything else is still printed.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def _make_handler(server: ChatServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

        def log_message(self, *args):  # quiet: tests and the prepare progress bar own the console
            pass

        def _send_json(self, status: int, obj, headers: Optional[dict] = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _reset(self) -> None:
            # SO_LINGER 0 + close sends a TCP RST: the client sees "connection reset by peer".
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True

        def finish(self):
            try:
                super().finish()
            except OSError:
                pass  # the socket was reset on purpose

        def do_GET(self):
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send_json(200, {"object": "list", "data": [{"id": server.model_name, "object": "model"}]})
            elif self.path.rstrip("/") == "/health":
                self._send_json(200, {"status": "ok"})
            else:
                self._send_json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                return self._send_json(404, {"error": {"message": f"no route {self.path}"}})
            n, action = server.next_action()
            if action in ("500", "502", "503", "429"):
                headers = {"Retry-After": "0"} if action == "429" else None
                return self._send_json(int(action), {"error": {"message": f"injected {action} (request {n})"}}, headers)
            if action == "reset":
                return self._reset()
            if action == "hang":
                server._stopping.wait(server.faults.hang_s)
                return self._reset()
            if action == "slow":
                server._stopping.wait(server.faults.slow_s)
            try:
                body = json.loads(raw)
                reply = server.completion(body)
            except (json.JSONDecodeError, _BadRequest, TypeError, ValueError) as e:
                return self._send_json(400, {"error": {"message": f"bad request: {e}"}})
            if action == "malformed":
                data = json.dumps(reply).encode()[: 20]
            elif action == "empty":
                data = json.dumps({"id": reply["id"], "object": "chat.completion"}).encode()
            else:
                data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data) + (50 if action == "truncated" else 0)))
            self.end_headers()
            self.wfile.write(data)
            if action == "truncated":
                self.wfile.flush()
                self._reset()

    return Handler


def echo_generate(messages, max_tokens, temperature, top_p, seed):
    """A model-free GenerateFn (fault tests, smoke tests): echoes the last message's words,
    at most `max_tokens` of them; finish_reason "length" when it had to cut."""
    words = messages[-1]["content"].split()
    return " ".join(words[:max_tokens]), "length" if len(words) > max_tokens else "stop"


def hf_generate_fn(target_path: str, tokenizer_path: str, layout: str, dtype: str = "float32",
                   device_map: Optional[str] = None, trust_remote_code: bool = False) -> GenerateFn:
    """A GenerateFn over a local target, through the same HFGenerator the hf backend uses."""
    from data.regenerate import HFGenerator
    from eagle3.target_model.target_io import load_target, tokenizer_from

    tok = tokenizer_from(tokenizer_path, trust_remote_code, "tokenizer_path")
    model, text_config = load_target(target_path, layout, dtype=dtype, device_map=device_map,
                                     trust_remote_code=trust_remote_code)
    gen = HFGenerator(model, tok, max_positions=text_config.get("max_position_embeddings"))

    def generate(messages, max_tokens, temperature, top_p, seed):
        (text, finish, reasoning), = gen.generate([messages], max_new_tokens=max_tokens, temperature=temperature,
                                                  top_p=top_p, seed=seed if seed is not None else 0)
        return text, finish, reasoning

    return generate


def _parse_rates(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, _, p = item.partition("=")
        out[name] = float(p)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target model directory")
    ap.add_argument("--echo", action="store_true", help="serve the model-free echo generator instead of a target")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: --target)")
    ap.add_argument("--layout", default="kimi_k25", choices=TARGET_LAYOUTS)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model-name", default="default")
    ap.add_argument("--fault-script", default="", help="comma-separated actions of the first requests")
    ap.add_argument("--fault-rate", action="append", default=[], help="ACTION=P, e.g. 500=0.1 (repeatable)")
    ap.add_argument("--slow-s", type=float, default=2.0)
    ap.add_argument("--hang-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    faults = FaultPlan(script=[s for s in a.fault_script.split(",") if s], rates=_parse_rates(a.fault_rate),
                       slow_s=a.slow_s, hang_s=a.hang_s, seed=a.seed)
    if not a.echo and not a.target:
        ap.error("give --target DIR (or --echo)")
    gen = echo_generate if a.echo else hf_generate_fn(a.target, a.tokenizer or a.target, a.layout, a.dtype)
    server = ChatServer(gen, a.host, a.port, faults, a.model_name)
    print(f"serving {'echo' if a.echo else a.target} at {server.url} (POST /chat/completions); Ctrl-C stops", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()


if __name__ == "__main__":
    main()
