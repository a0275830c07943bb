"""Measuring running servers for `make bench-serve`: the probe (reachable? speculation as configured?
which drafter?), the printed launch lines, and the resumable request loop (finished requests are kept
in <out_dir>/requests/<server>.jsonl and not sent again).
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from eagle3.engines import serve_protocol as sp
from eagle3.errors import StageError
from eval import serve_client as client
from eagle3.engines.serve_launch import ServeChoice, sglang_command, tensor_parallel, vllm_command


class BenchServeError(StageError):
    """A server that is not there, or not what the config says it is."""


def launch_line(cfg, server) -> str:
    """The exact command that starts `server` as configured (one line)."""
    tp = tensor_parallel(cfg.target, cfg.launch.tp)
    port = ["--port", str(server.port or urlparse(server.url).port or 30000)]
    trust = ["--trust-remote-code"] if cfg.target.trust_remote_code else []
    choice = ServeChoice(server.num_steps, server.topk, server.num_draft_tokens, source="bench-serve")
    if server.engine == "sglang":
        if server.speculative:
            cmd = sglang_command(cfg.target, cfg.drafter_dir, choice, tp, port)
        else:
            cmd = ["python", "-m", "sglang.launch_server", "--model-path", str(cfg.target.path), *trust,
                   *(["--tp", str(tp)] if tp else []), *port]
    elif server.speculative:
        cmd = vllm_command(cfg.target, cfg.launch.speculators_dir or cfg.drafter_dir, choice, tp) + port
    else:
        cmd = ["vllm", "serve", str(cfg.target.path), *trust, *(["--tensor-parallel-size", str(tp)] if tp else []),
               *port]
    return shlex.join(cmd)


def _same_dir(a: Optional[str], b: str) -> Optional[bool]:
    """Whether two drafter paths name one directory; None when `a` cannot be checked from here."""
    if not a:
        return None
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    pa, pb = Path(a) / "config.json", Path(b) / "config.json"
    if pa.is_file() and pb.is_file():
        return pa.read_bytes() == pb.read_bytes() and sorted(p.name for p in Path(a).iterdir()) == \
            sorted(p.name for p in Path(b).iterdir())
    return False


def probe(cfg, server, timeout: float = 10.0) -> dict:
    """What the server says of itself; raises client.Unreachable, or BenchServeError when speculation
    (or its knobs) is not as configured. Returns {engine facts..., "warnings": [...]}."""
    base, warnings = server.url.rstrip("/"), []
    want = f"EAGLE3 {server.label}" if server.speculative else "no speculation"
    if server.engine == "sglang":
        info = client.sglang_server_info(base, timeout)
        if info is None:
            return {"engine": "sglang", "server_info": None, "warnings": [
                f"{server.name}: no /server_info or /get_server_info: speculation is checked from the replies only"]}
        spec = sp.server_info_speculation(info)
        seen = spec["algorithm"]
        if bool(seen) != server.speculative:
            raise BenchServeError(f"server {server.name} at {server.url}: expected {want}, but its server info says "
                                  f"{sp.SPEC_ALGORITHM}={seen!r}; refusing to measure it as {server.label}")
        if server.speculative:
            knobs = [server.num_steps, server.topk, server.num_draft_tokens]
            if None not in spec["knobs"] and [int(k) for k in spec["knobs"]] != knobs:
                raise BenchServeError(f"server {server.name} at {server.url}: configured as {server.label} but it "
                                      f"serves {'/'.join(str(k) for k in spec['knobs'])} "
                                      f"({', '.join(sp.SPEC_KNOB_ARGS)}); refusing")
            if str(seen).upper() != "EAGLE3":
                warnings.append(f"{server.name}: speculative_algorithm={seen!r}, not EAGLE3")
            same = _same_dir(spec["draft_model_path"], cfg.drafter_dir)
            if same is False:
                warnings.append(f"{server.name}: the server loads the drafter {spec['draft_model_path']}, the replay "
                                f"uses {cfg.drafter_dir}: not the same directory (predicted vs served compares two "
                                f"drafters unless they hold the same weights)")
        return {"engine": "sglang", "version": spec["version"], "speculation": spec, "warnings": warnings}
    model = client.vllm_model(base, timeout)
    if model is None:
        raise BenchServeError(f"server {server.name} at {server.url}: /v1/models lists no model (is it vLLM?)")
    counters = client.vllm_metrics(base, timeout)
    if counters.present != server.speculative:
        seen = "spec-decode counters (speculation on)" if counters.present else f"no {sp.VLLM_DRAFTS} (speculation off)"
        raise BenchServeError(f"server {server.name} at {server.url}: expected {want}, but /metrics has {seen}; "
                              f"refusing to measure it as {server.label}")
    if server.speculative and counters.per_position and len(counters.per_position) != server.num_steps:
        raise BenchServeError(f"server {server.name} at {server.url}: configured with num_speculative_tokens="
                              f"{server.num_steps} but /metrics counts {len(counters.per_position)} draft positions")
    if server.speculative:
        warnings.append(f"{server.name}: which drafter directory a vLLM server loads is not visible from its API; "
                        f"make sure it was started with the launch line below")
    return {"engine": "vllm", "model": model.get("id"), "model_root": model.get("root"), "warnings": warnings}


def prompts_key(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


class RequestLog:
    """<out_dir>/requests/<server>.jsonl: a header naming what was measured, then one record per request.
    A run with another header (other prompts, knobs, sampling) or force=true starts the file again."""

    def __init__(self, path: Path, key: dict, force: bool, readonly: bool = False):
        self.path, self.key, self.done, self.failed = path, key, {}, []
        lines = path.read_text().splitlines() if path.is_file() and not force else []
        self.probe_path = path.with_suffix(".probe.json")
        try:
            header = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            header = None
        if header == {"key": key}:
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill: that request is measured again
                    continue
                if rec.get("ok"):
                    self.done[rec["i"]] = rec
                else:
                    self.failed.append(rec)
        elif not readonly:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"key": key}) + "\n")
            self.probe_path.unlink(missing_ok=True)

    def save_probe(self, info: dict) -> None:
        """What the server said of itself when it was measured (a later run may find it stopped)."""
        self.probe_path.write_text(json.dumps(info))

    def saved_probe(self) -> dict:
        try:
            return json.loads(self.probe_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {"warnings": []}

    def add(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if rec.get("ok"):
            self.done[rec["i"]] = rec
        else:
            self.failed.append(rec)

    def all_records(self) -> list[dict]:
        """Every attempt record of this measurement (failed ones of earlier runs too), for the retry counts."""
        return self.failed + [self.done[i] for i in sorted(self.done)]


def one_request(cfg, server, prompt: list[int], model: Optional[str]) -> dict:
    """Send one prompt; the record of what came back (tokens, times, speculative counts)."""
    base, r = server.url.rstrip("/"), cfg.request
    if server.engine == "sglang":
        s = client.sglang_generate(base, prompt, r.max_new_tokens, r.temperature, r.timeout_s)
        counts = sp.read_sglang_meta(s.final)
        completion = int(s.final.get(sp.COMPLETION_TOKENS, len(s.output_ids)))
        prompt_tokens = s.final.get(sp.PROMPT_TOKENS)
    else:
        try:
            before = client.vllm_metrics(base, r.timeout_s)
            s = client.vllm_complete(base, model, prompt, r.max_new_tokens, r.temperature, r.timeout_s)
            after = client.vllm_metrics(base, r.timeout_s)
        except client.Unreachable as e:
            raise client.RequestFailed(str(e), retryable=True) from None
        completion = int(s.final.get("completion_tokens", len(s.output_ids)))
        prompt_tokens = s.final.get("prompt_tokens")
        counts = after.minus(before).counts(completion) if after.present else None
    if server.speculative and (counts is None or counts.verify_steps == 0) and completion > 1:
        raise BenchServeError(f"server {server.name} at {server.url}: expected speculation but the reply to a "
                              f"{completion}-token request carries no verify steps "
                              f"({'meta_info without ' + sp.VERIFY_CT if server.engine == 'sglang' else 'no counter moved'})")
    if not server.speculative and counts is not None and counts.verify_steps > 0:
        raise BenchServeError(f"server {server.name} at {server.url}: the baseline replied with {counts.verify_steps} "
                              f"verify steps ({counts.naming}): it speculates; refusing")
    return {"output_ids": s.output_ids, "completion_tokens": completion, "prompt_tokens": prompt_tokens,
            "ttft_ms": s.ttft_ms, "decode_ms": s.last_token_ms - s.ttft_ms, "e2e_ms": s.e2e_ms,
            "finish_reason": s.finish_reason, "spec": None if counts is None else counts.__dict__}


def measure(cfg, server, prompts: list[list[int]], log: RequestLog, info: dict, bar=None) -> None:
    """Every prompt not yet in the log, in order; failures after the retries are logged and left for
    a rerun (the run is then partial)."""
    model = info.get("model")
    for i, prompt in enumerate(prompts):
        if i in log.done:
            continue
        tries = client.Attempts()
        try:
            rec = client.with_retries(lambda: one_request(cfg, server, prompt, model), cfg.request.retries,
                                      cfg.request.backoff_s, tries)
            rec["ok"] = True
        except client.RequestFailed as e:
            rec = {"ok": False, "error": str(e)}
        rec.update(i=i, attempts=tries.attempts, timeouts=tries.timeouts, errors=tries.errors)
        log.add(rec)
        if bar is not None:
            bar.update(1)
