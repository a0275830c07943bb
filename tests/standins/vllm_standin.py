"""A stand-in for vLLM's hidden-state extraction (vLLM cannot run on the project's machines), built on
the HF mini targets and speaking the protocol of eagle3/engines/vllm_protocol.py (vLLM 0.34.0's facts):

- `StandinEngine`: what the engine does per request. Listed ids are read as vLLM's DeepSeek-V2 model
  reads them (id = h: the residual stream entering layer id; id = L the last layer's output before the
  final norm), stacked ascending as [T, num_ids, H] in the model dtype, written with `token_ids` as
  `<storage>/<request id>.safetensors` under the `.lock` protocol. The engine's config is validated the
  way vLLM does (method, num_speculative_tokens, connector, role, storage key, ids present and distinct).
- `StandinServer`: `vllm serve` over HTTP (/v1/models, /v1/completions with a token-id prompt,
  max_tokens 1, return_token_ids, kv_transfer_params in the reply), started from the argv of the exact
  `vllm serve ...` line the backend prints (`StandinServer.from_command`), so that line is checked too.
- `fake_vllm_module()`: a module with `LLM` / `SamplingParams` for the in-process engine.
- Image prompts (eagle3/engines/vllm_images.py's facts): /v1/chat/completions and `LLM.chat` render the messages the
  way vLLM does for a "string"-content template (text parts joined by "\n", placeholders missing from the
  text put in front, a request chat template refused without --trust-request-chat-template), tokenize
  without special tokens, expand each `<|media_pad|>` by the image rule (eagle3/target_model/images.py, what K2.5's
  processor computes), run the multimodal forward (vision tower, fused embeddings, text model) and return the
  expanded `prompt_token_ids`; an image that does not decode is a 400.

Faults, by request number (0-based, re-requests count): `drop` (reply, no file), `truncate` (reply, file
cut short), `die_after` (the server stops answering after that many completions), `write_delay_s`
(the reply comes first and the file later, under the lock, as vLLM's writer thread does), `hold` (the
writer holds the lock, file unwritten, until the test sets `release`: a writer slower than any timeout),
`extra_pads` (image request n -> merged patch rows its engine adds to the first image: an engine whose
image rule differs, so its expansion and its features both differ from prepare's), `refuse_images` (image requests answered 400, as an image vLLM cannot load). Prefix caching is on
unless the command (or `LLM(enable_prefix_caching=False)`) turns it off, as in vLLM: a prompt whose leading
full blocks (`--block-size`, 16) an earlier request computed gets a file short by those rows. Image requests are
numbered on their own (0-based), in arrival order.
"""
from __future__ import annotations

import argparse
import json
import shlex
import threading
import time
import types
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import torch

from data.openai_server import _QuietServer
from eagle3.target_model import target_io
from eagle3.engines import vllm_protocol


@dataclass
class Faults:
    drop: set = field(default_factory=set)
    truncate: set = field(default_factory=set)
    die_after: int | None = None
    write_delay_s: float = 0.0
    hold: set = field(default_factory=set)  # these requests' writers hold the lock until `release` is set
    extra_pads: dict = field(default_factory=dict)  # image request n -> merged patch rows added to its first image
    refuse_images: set = field(default_factory=set)  # image requests answered "Failed to load image" (400)
    release: threading.Event = field(default_factory=threading.Event)


class StandinError(ValueError):
    """What vLLM would refuse at start-up or per request."""


def engine_settings(speculative_config: dict, kv_transfer_config: dict, num_layers: int) -> tuple[list[int], Path]:
    """(ids, storage dir) from the two configs, checked as vLLM checks them."""
    if speculative_config.get("method") != vllm_protocol.SPEC_METHOD:
        raise StandinError(f"speculative method {speculative_config.get('method')!r}")
    if speculative_config.get("num_speculative_tokens") != 1:
        raise StandinError("extract_hidden_states requires num_speculative_tokens to be 1")
    ids = ((speculative_config.get("draft_model_config") or {}).get("hf_config") or {}).get(vllm_protocol.IDS_KEY)
    if not ids:
        raise StandinError(f"{vllm_protocol.IDS_KEY} must be set in the draft model config")
    if len(set(ids)) != len(ids) or not all(1 <= i <= num_layers for i in ids):
        # vLLM would capture fewer states than listed (or fail at id 0, where the residual is None)
        raise StandinError(f"Expected {len(ids)} auxiliary hidden states for ids {ids} of {num_layers} layers")
    if (kv_transfer_config.get("kv_connector"), kv_transfer_config.get("kv_role")) != (vllm_protocol.CONNECTOR,
                                                                                       vllm_protocol.KV_ROLE):
        raise StandinError(f"kv_transfer_config {kv_transfer_config}")
    storage = (kv_transfer_config.get("kv_connector_extra_config") or {}).get(vllm_protocol.STORAGE_KEY, "/tmp")
    return [int(i) for i in ids], Path(storage)


class StandinEngine:
    def __init__(self, target_path, layout: str, dtype: str, speculative_config: dict, kv_transfer_config: dict,
                 max_model_len: int | None = None, faults: Faults | None = None, prefix_caching: bool = True,
                 block_size: int = 16):
        L = target_io.read_text_config(target_path, layout)["num_hidden_layers"]
        self.prefix_caching, self.block_size = prefix_caching, block_size  # vLLM's defaults: on, 16
        self._cached_blocks: set[tuple] = set()  # the prompt prefixes of every full block served so far
        self.ids, self.storage = engine_settings(speculative_config, kv_transfer_config, L)
        self.model, _ = target_io.load_target(target_path, layout, dtype)
        self.target_path = target_path
        self.max_model_len, self.faults = max_model_len, faults or Faults()
        self.requests = 0
        self.image_requests = 0
        self._tokenizer = None
        self.max_files_seen = 0  # connector files on disk after a write: the client must keep this bounded
        self.writers: list[threading.Thread] = []
        self._lock = threading.Lock()

    @torch.no_grad()
    def run(self, token_ids: list[int], images: list | None = None) -> tuple[str, int]:
        """One request: (file path, greedy next token). The file is complete when the lock is released.
        images: the request's decoded images (PIL), their rows already expanded in `token_ids`."""
        if self.max_model_len is not None and len(token_ids) + 1 > self.max_model_len:
            raise StandinError(f"prompt of {len(token_ids)} tokens + 1 > max_model_len {self.max_model_len}")
        with self._lock:
            n, self.requests = self.requests, self.requests + 1
            x = torch.tensor([token_ids], dtype=torch.long)
            inputs = {"input_ids": x}
            if images:  # the multimodal forward: the text model reads the fused input embeddings
                inputs = {"inputs_embeds": self._fused(x, images)}
            with target_io.AuxHiddenCapture(self.model, sorted(self.ids)) as cap:
                target_io.text_model(self.model)(**inputs, attention_mask=torch.ones_like(x), use_cache=False)
                states = torch.stack([a[0] for a in cap.aux], dim=1)  # [T, num_ids, H], ascending ids
                greedy = int(target_io.argmax_from_last(self.model, cap.last[0, -1:])[0])
            states = states[self._cached_prefix(token_ids):]
        path = self.storage / f"standin-{n}{vllm_protocol.FILE_SUFFIX}"
        fd = vllm_protocol.lock_for_write(path)  # before the reply, as the connector does
        write = threading.Thread(target=self._write, args=(n, path, states, x[0], fd), daemon=True)
        write.start()
        self.writers.append(write)
        if not self.faults.write_delay_s and n not in self.faults.hold:
            write.join()
        return str(path), greedy

    def _cached_prefix(self, token_ids: list[int]) -> int:
        """Rows a dump loses to prefix caching: the leading full blocks an earlier request already computed
        (never the whole prompt: one token is always run). The failure NVIDIA ModelOpt reports ("short by
        N*block_size"), not vLLM 0.34.0's own bookkeeping, which is why the backend turns caching off."""
        if not self.prefix_caching:
            return 0
        bs, hit = self.block_size, 0
        while (hit + 1) * bs < len(token_ids) and tuple(token_ids[:(hit + 1) * bs]) in self._cached_blocks:
            hit += 1
        self._cached_blocks.update(tuple(token_ids[:(b + 1) * bs]) for b in range(len(token_ids) // bs))
        return hit * bs

    def _fused(self, x: torch.Tensor, images: list) -> torch.Tensor:
        from eagle3.target_model import images as rule
        from eagle3.target_model import target_images

        pv, thw = rule.preprocess_many(images)
        features = target_images.image_features(self.model, torch.from_numpy(pv), torch.from_numpy(thw))
        try:
            return target_images.fused_input_embeddings(self.model, x, self.model.config.image_token_id, features)
        except target_io.TargetError as e:  # vLLM's processor checks the placeholder count the same way
            raise StandinError(str(e)) from None

    def chat(self, body: dict, trust_request_chat_template: bool) -> tuple[str, int, list[int]]:
        """A chat request (the HTTP body or LLM.chat's arguments): (file, greedy token, the engine's prompt ids)."""
        from transformers import AutoTokenizer

        from eagle3.target_model import images as rule
        from eagle3.engines import vllm_images

        template = body.get("chat_template")
        if template is not None and not trust_request_chat_template:
            raise StandinError("Chat template is passed with request, but --trust-request-chat-template is not "
                               "set. Refused request with untrusted chat template.")
        with self._lock:
            n, self.image_requests = self.image_requests, self.image_requests + 1
            self._tokenizer = self._tokenizer or AutoTokenizer.from_pretrained(str(self.target_path))
        tok = self._tokenizer
        conversation, uris = [], []
        for m in body["messages"]:  # the "string" content format (renderers/chat_utils/chat_message.py)
            parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            text = "\n".join(p["text"] for p in parts if p["type"] == "text")
            mine = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
            missing = len(mine) - text.count(vllm_images.PLACEHOLDER)
            if missing < 0:
                raise StandinError(f"Found more '{vllm_images.PLACEHOLDER}' placeholders in input prompt than "
                                   "actual multimodal data items.")
            conversation.append({"role": m["role"], "content": "\n".join([vllm_images.PLACEHOLDER] * missing
                                                                          + ([text] if text else []))})
            uris += mine
        prompt = tok.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                         add_generation_prompt=body.get("add_generation_prompt", True))
        ids = tok(prompt, add_special_tokens=bool(body.get("add_special_tokens", False)))["input_ids"]
        try:
            if n in self.faults.refuse_images:
                raise rule.ImageError("undecodable_image", "cannot identify image file")
            images = [rule.decode_image(rule.image_bytes(u)) for u in uris]
        except rule.ImageError as e:
            raise StandinError(f"Failed to load image: {e}") from None
        if self.faults.extra_pads.get(n):  # another image rule: the first image comes out `extra` patch rows taller
            w, h = images[0].size
            images[0] = images[0].resize((w, h + 2 * rule.PATCH_SIZE * self.faults.extra_pads[n]))
        pad, expanded, k = self.model.config.image_token_id, [], 0
        for t in ids:  # KimiK25MultiModalProcessor: each <|media_pad|> -> media_tokens_calculator(image) pads
            if t == pad:
                if k >= len(images):
                    raise StandinError("more <|media_pad|> than images")
                w, h = images[k].size
                expanded += [pad] * rule.media_pad_count(rule.grid_thw(h, w))
                k += 1
            else:
                expanded.append(t)
        if k != len(images):
            raise StandinError(f"{len(images)} images for {k} placeholders")
        path, greedy = self.run(expanded, images)
        return path, greedy, expanded

    def _write(self, n: int, path: Path, states: torch.Tensor, tokens: torch.Tensor, fd: int) -> None:
        time.sleep(self.faults.write_delay_s)
        if n in self.faults.hold:
            self.faults.release.wait()
        if n in self.faults.drop:
            import os
            os.close(fd)
            return
        vllm_protocol.write_states_file(path, states, tokens, lock_fd=fd)
        files = len(list(self.storage.glob("*" + vllm_protocol.FILE_SUFFIX)))
        self.max_files_seen = max(self.max_files_seen, files)  # (a racy count is still a lower bound)
        if n in self.faults.truncate:
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])


@dataclass
class _Completion:  # what vllm.RequestOutput carries that the backend reads
    prompt_token_ids: list
    outputs: list
    kv_transfer_params: dict


def fake_vllm_module(faults: Faults | None = None, layout: str = "kimi_k25") -> types.ModuleType:
    """A module standing in for `vllm` (LLM, SamplingParams) in the in-process engine; `.engines` lists
    the engines built."""
    mod = types.ModuleType("vllm")
    mod.engines = []

    class SamplingParams:
        def __init__(self, max_tokens: int = 16, temperature: float = 1.0):
            self.max_tokens, self.temperature = max_tokens, temperature

    class LLM:
        def __init__(self, model, *, tensor_parallel_size=1, dtype="auto", trust_remote_code=False,
                     speculative_config=None, kv_transfer_config=None, max_model_len=None,
                     enable_prefix_caching=None, block_size=None):
            self.engine = StandinEngine(model, layout, dtype, speculative_config or {}, kv_transfer_config or {},
                                        max_model_len, faults, enable_prefix_caching is not False, block_size or 16)
            self.tensor_parallel_size = tensor_parallel_size
            mod.engines.append(self.engine)

        def chat(self, messages, sampling_params, *, use_tqdm=True, chat_template=None, add_generation_prompt=True):
            assert sampling_params.max_tokens == 1
            body = {"messages": messages, "chat_template": chat_template, "add_generation_prompt": add_generation_prompt}
            try:
                path, greedy, ids = self.engine.chat(body, trust_request_chat_template=True)  # offline: no check
            except StandinError as e:
                raise ValueError(str(e)) from None  # vLLM's processor / media errors are ValueErrors
            return [_Completion(ids, [types.SimpleNamespace(token_ids=[greedy])], {vllm_protocol.PATH_PARAM: path})]

        def generate(self, prompts, sampling_params, *, use_tqdm=True):
            assert sampling_params.max_tokens == 1
            out = []
            for p in prompts:
                path, greedy = self.engine.run(list(p["prompt_token_ids"]))
                out.append(_Completion(list(p["prompt_token_ids"]), [types.SimpleNamespace(token_ids=[greedy])],
                                       {vllm_protocol.PATH_PARAM: path}))
            return out

    mod.LLM, mod.SamplingParams = LLM, SamplingParams
    return mod


def parse_serve_command(command: str) -> argparse.Namespace:
    """The arguments of a `vllm serve ...` line, with the flags vLLM 0.34.0 accepts for them (an
    unknown flag is an error, as in vLLM)."""
    argv = shlex.split(command)
    if argv[:2] != ["vllm", "serve"]:
        raise StandinError(f"not a `vllm serve` command: {command[:80]}")
    p = argparse.ArgumentParser(prog="vllm serve", exit_on_error=False)
    p.add_argument("model")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--trust-request-chat-template", action="store_true")
    p.add_argument("--speculative-config", type=json.loads, required=True)
    p.add_argument("--kv-transfer-config", type=json.loads, required=True)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    args, unknown = p.parse_known_args(argv[2:])
    if unknown:
        raise StandinError(f"unrecognized arguments: {' '.join(unknown)}")
    return args


class StandinServer:
    """`vllm serve` for the stand-in engine on 127.0.0.1 (`with StandinServer.from_command(...) as s`)."""

    def __init__(self, engine: StandinEngine, model_name: str, port: int = 0, trust_request_chat_template=False):
        self.engine, self.model_name = engine, model_name
        self.trust_request_chat_template = trust_request_chat_template
        self.completions = 0
        self.httpd = _QuietServer(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True

    @classmethod
    def from_command(cls, command: str, layout: str, faults: Faults | None = None) -> "StandinServer":
        a = parse_serve_command(command)
        engine = StandinEngine(a.model, layout, a.dtype, a.speculative_config, a.kv_transfer_config,
                               a.max_model_len, faults, a.enable_prefix_caching, a.block_size)
        return cls(engine, a.model, a.port, a.trust_request_chat_template)

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.httpd.server_address[1]

    def __enter__(self) -> "StandinServer":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.faults.release.set()  # the engine stops: held writers finish
        for w in self.engine.writers:
            w.join()

    def complete(self, body: dict) -> dict:
        if body.get("model") != self.model_name:
            raise StandinError(f"The model `{body.get('model')}` does not exist.")
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise StandinError("prompt must be a list of token ids")
        path, greedy = self.engine.run(prompt)
        choice = {"index": 0, "text": "", "finish_reason": "length", "token_ids": [greedy]}
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = prompt
        return {"id": f"cmpl-{self.completions}", "object": "text_completion", "model": self.model_name,
                "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1},
                "kv_transfer_params": {vllm_protocol.PATH_PARAM: path}}


    def chat(self, body: dict) -> dict:
        if body.get("model") != self.model_name:
            raise StandinError(f"The model `{body.get('model')}` does not exist.")
        if body.get("max_completion_tokens", body.get("max_tokens")) != 1:
            raise StandinError("the stand-in serves capture requests only (one token)")
        path, greedy, ids = self.engine.chat(body, self.trust_request_chat_template)
        choice = {"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length",
                  "token_ids": [greedy] if body.get("return_token_ids") else None}
        return {"id": f"chatcmpl-{self.completions}", "object": "chat.completion", "model": self.model_name,
                "choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": 1},
                "prompt_token_ids": ids if body.get("return_token_ids") else None,
                "kv_transfer_params": {vllm_protocol.PATH_PARAM: path}}


def _handler(server: StandinServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _json(self, status: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._json(200, {"object": "list", "data": [{"id": server.model_name, "object": "model"}]})
            self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                return self._json(404, {"detail": "Not Found"})
            die = server.engine.faults.die_after
            if die is not None and server.completions >= die:  # the engine died: no reply, no server
                self.close_connection = True
                threading.Thread(target=server.httpd.shutdown, daemon=True).start()
                return
            try:
                reply = server.complete(body) if self.path == "/v1/completions" else server.chat(body)
            except StandinError as e:
                return self._json(400, {"object": "error", "message": str(e), "code": 400})
            server.completions += 1
            self._json(200, reply)

    return Handler
