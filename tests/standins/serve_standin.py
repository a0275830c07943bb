"""Stand-ins for a live SGLang or vLLM server (neither engine runs on the project's machines), speaking
the protocol of eagle3/engines/serve_protocol.py with each version's field names, for `make bench-serve`.

The model side really decodes: the baseline is the target's greedy decode, a speculative server runs
the target with the drafter through the eval stage's real loop (eagle3/real_loop/chain.py, tree.py),
so tokens, verify steps and accepted drafts per cycle come from a real draft/verify loop. Time is
injected: after the loop has run, the reply is streamed on a schedule where the prefill costs
`prefill_ms` and each verify cycle costs max(its real time, verify_ms + per_token_ms * num_draft_tokens
+ draft_step_ms * num_steps) (a plain decode step: a one-token verify), at absolute deadlines, so the
client's first-to-last token time is the injected cost split plus scheduling jitter of two events.

SGLang (`version` picks the names): GET /get_server_info (and /server_info from 0.5.21), /health;
POST /generate (stream or not; output_ids cumulative). vLLM 0.34.0: GET /v1/models, /metrics (the
spec-decode counters only with speculation); POST /v1/completions (token-id prompt, stream with
token_ids deltas and a usage chunk). Faults (data/openai_server.FaultPlan actions "500", "reset",
"hang") by request number.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Optional

import torch

from data.openai_server import FaultPlan, LocalServer
from eagle3.engines import serve_protocol as sp
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.real_loop.chain import greedy_decode, speculative_decode
from eagle3.real_loop.tree import tree_speculative_decode


@dataclass(frozen=True)
class InjectedCosts:
    verify_ms: float = 30.0
    per_token_ms: float = 10.0
    draft_step_ms: float = 20.0
    prefill_ms: float = 5.0

    def cycle_ms(self, num_draft_tokens: int, num_steps: int) -> float:
        return self.verify_ms + self.per_token_ms * num_draft_tokens + self.draft_step_ms * num_steps


@dataclass
class Decoded:
    tokens: list
    cycles: list              # tokens emitted per step after the prefill (1 each without speculation)
    accepted: list            # accepted drafts per cycle
    real_ms: list             # real time of each step


class ModelSide:
    """The target (+ drafter with knobs) behind a stand-in; one request at a time."""

    def __init__(self, target, drafter=None, knobs: Optional[SpecKnobs] = None, eos_token_id=None,
                 costs: InjectedCosts = InjectedCosts()):
        if (drafter is None) != (knobs is None):
            raise ValueError("a speculative stand-in needs both a drafter and knobs")
        self.target, self.drafter, self.knobs, self.eos, self.costs = target, drafter, knobs, eos_token_id, costs
        self.lock = threading.Lock()

    @property
    def speculative(self) -> bool:
        return self.knobs is not None

    def decode(self, prompt: list[int], max_new: int) -> Decoded:
        p = torch.tensor(prompt, dtype=torch.long)
        with self.lock, torch.no_grad():
            if not self.speculative:
                r = greedy_decode(self.target, p, max_new, self.eos)
                return Decoded(r.tokens, [1] * len(r.token_ms), [0] * len(r.token_ms), list(r.token_ms))
            k = self.knobs
            if k.topk == 1:
                r = speculative_decode(self.target, self.drafter, p, max_new, k.num_steps, k.num_draft_tokens, self.eos)
            else:
                r = tree_speculative_decode(self.target, self.drafter, p, max_new, k, self.eos)
        real = [a + b + c for a, b, c in zip(r.draft_ms, r.verify_ms, r.extend_ms)]
        return Decoded(r.tokens, list(r.emitted), list(r.accepted), real)

    def step_ms(self, real_ms: float) -> float:
        k = self.knobs
        injected = self.costs.cycle_ms(1, 0) if k is None else self.costs.cycle_ms(k.num_draft_tokens, k.num_steps)
        return max(injected, real_ms)


@dataclass
class Totals:
    """Server-wide counters (vLLM /metrics, SGLang avg_spec_accept_length)."""
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    completion_tokens: int = 0
    per_pos: list = field(default_factory=list)


class StandinServer(LocalServer):
    """`StandinServer(engine, model_side, version=...).start()`; `.url`; `.stop()` (or `with`)."""

    def __init__(self, engine: str, model: ModelSide, version: Optional[str] = None, model_path: str = "k25-mini",
                 drafter_path: Optional[str] = None, faults: Optional[FaultPlan] = None, port: int = 0):
        if engine not in ("sglang", "vllm"):
            raise ValueError(engine)
        self.engine, self.model, self.model_path, self.drafter_path = engine, model, model_path, drafter_path
        self.version = version or ("0.5.23" if engine == "sglang" else sp.VLLM_VERSION_READ)
        self.faults, self.requests, self.totals = faults or FaultPlan(), 0, Totals()
        depth = model.knobs.max_depth if model.speculative else 0
        self.totals.per_pos = [0] * depth
        self._lock = threading.Lock()
        super().__init__(_handler(self), "127.0.0.1", port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    # --- what the engine says ---------------------------------------------------------------------
    def server_info(self) -> dict:
        k = self.model.knobs
        info = {"model_path": self.model_path, "version": self.version, "tp_size": 1,
                "speculative_algorithm": "EAGLE3" if k else None,
                "speculative_draft_model_path": self.drafter_path if k else None,
                "speculative_num_steps": k.num_steps if k else None,
                "speculative_eagle_topk": k.topk if k else None,
                "speculative_num_draft_tokens": k.num_draft_tokens if k else None}
        state = {"memory_usage": {}}
        if k and self.totals.verify_steps:
            state[sp.AVG_ACCEPT_LENGTH] = self.totals.completion_tokens / self.totals.verify_steps
        return {**info, "internal_states": [state]}

    def metrics_text(self) -> str:
        head = (f'# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
                f'# TYPE vllm:num_requests_running gauge\n'
                f'vllm:num_requests_running{{engine="0",model_name="{self.model_path}"}} 0.0\n')
        if not self.model.speculative:
            return head
        t = self.totals
        return head + sp.vllm_metrics_text(self.model_path, t.verify_steps, t.draft_tokens, t.accepted, t.per_pos)

    def record(self, d: Decoded) -> dict:
        """Count one finished request into the server totals; its own counts for SGLang's meta_info."""
        k = self.model.knobs
        hist: list = []
        for a in d.accepted:
            if a >= len(hist):
                hist.extend([0] * (a + 1 - len(hist)))
            hist[a] += 1
        with self._lock:
            t = self.totals
            t.completion_tokens += len(d.tokens)
            if k:
                t.verify_steps += len(d.cycles)
                t.draft_tokens += len(d.cycles) * (k.num_draft_tokens - 1)
                t.accepted += sum(d.accepted)
                for j in range(len(t.per_pos)):
                    t.per_pos[j] += sum(1 for a in d.accepted if a > j)
        if not k:
            return {}
        return sp.sglang_spec_meta(self.version, verify_ct=len(d.cycles), completion_tokens=len(d.tokens),
                                   correct_drafts=sum(d.accepted), num_steps=k.num_steps,
                                   num_draft_tokens=k.num_draft_tokens, histogram=hist)

    def schedule(self, d: Decoded) -> list[tuple[float, int]]:
        """(seconds after the start of streaming, tokens so far) per event: prefill, then each step."""
        at, n = self.model.costs.prefill_ms, 1
        out = [(at / 1000.0, 1)]
        for emitted, real in zip(d.cycles, d.real_ms):
            at += self.model.step_ms(real)
            n += emitted
            out.append((at / 1000.0, n))
        return out


def _handler(server: StandinServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj) -> None:
            self._send(status, json.dumps(obj).encode())

        def do_GET(self):
            path = self.path.split("?")[0].rstrip("/")
            sg = server.engine == "sglang"
            if path == "/health":
                return self._send(200, b"")
            if sg and (path == "/get_server_info" or (path == "/server_info" and
                                                      sp.version_tuple(server.version) >= (0, 5, 21))):
                return self._json(200, server.server_info())
            if not sg and path == "/v1/models":
                return self._json(200, {"object": "list", "data": [{
                    "id": server.model_path, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                    "root": server.model_path, "parent": None, "max_model_len": 4096}]})
            if not sg and path == "/metrics":
                return self._send(200, server.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
            self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = self.path.rstrip("/")
            if path != ("/generate" if server.engine == "sglang" else "/v1/completions"):
                return self._json(404, {"detail": "Not Found"})
            with server._lock:
                n = server.requests
                server.requests += 1
            action = server.faults.action(n)
            if action in ("500", "502", "503"):
                return self._json(int(action), {"error": {"message": f"injected {action}"}})
            if action == "hang":
                server._stopping.wait(server.faults.hang_s)
                self.close_connection = True
                return
            if action == "reset":
                self.close_connection = True
                self.connection.close()
                return
            body = json.loads(raw)
            if server.engine == "sglang":
                prompt, params = body["input_ids"], body.get("sampling_params") or {}
                max_new = int(params.get("max_new_tokens", 128))
            else:
                prompt, max_new = body["prompt"], int(body.get("max_tokens", 16))
            d = server.model.decode(list(prompt), max_new)
            spec_meta = server.record(d)
            self._stream(d, prompt, max_new, spec_meta, body)

        def _stream(self, d: Decoded, prompt, max_new, spec_meta, body):
            stop = len(d.tokens) < max_new or (server.model.eos is not None and d.tokens[-1] == server.model.eos)
            finish = ({"type": "stop", "matched": d.tokens[-1]} if stop else {"type": "length", "length": max_new})
            events = server.schedule(d)
            rid = f"standin-{server.requests}"
            if not body.get("stream"):
                time.sleep(events[-1][0])
                return self._json(200, self._sglang_chunk(d.tokens, prompt, rid, finish, spec_meta)
                                  if server.engine == "sglang" else self._vllm_full(d.tokens, prompt, rid, finish))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            t0, sent = time.perf_counter(), 0
            for i, (at, n) in enumerate(events):
                time.sleep(max(0.0, t0 + at - time.perf_counter()))
                last = i == len(events) - 1
                if server.engine == "sglang":
                    ev = self._sglang_chunk(d.tokens[:n], prompt, rid, finish if last else None,
                                            spec_meta if last else {})
                else:
                    ev = self._vllm_chunk(d.tokens[sent:n], prompt if i == 0 else None, rid,
                                          ("stop" if stop else "length") if last else None)
                sent = n
                self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
                self.wfile.flush()
            if server.engine == "vllm" and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(d.tokens),
                         "completion_tokens": len(d.tokens), "prompt_tokens_details": None}
                self.wfile.write(f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'created': int(time.time()), 'model': server.model_path, 'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _sglang_chunk(self, ids, prompt, rid, finish, spec_meta) -> dict:
            meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "weight_version": "default",
                    "completion_tokens": len(ids), "cached_tokens": 0, **spec_meta}
            if finish is not None:
                meta["e2e_latency"] = 0.0
            return {"text": "", "output_ids": list(ids), "meta_info": meta}

        def _vllm_chunk(self, ids, prompt, rid, finish) -> dict:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish, "stop_reason": None,
                      "token_ids": list(ids)}
            if prompt is not None:
                choice["prompt_token_ids"] = list(prompt)
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": server.model_path,
                    "choices": [choice], "usage": None}

        def _vllm_full(self, ids, prompt, rid, finish) -> dict:
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": server.model_path,
                    "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": finish["type"],
                                 "stop_reason": None, "token_ids": list(ids), "prompt_token_ids": list(prompt)}],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                              "total_tokens": len(prompt) + len(ids)}}

    return Handler
