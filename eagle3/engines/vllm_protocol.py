"""vLLM's hidden-state extraction protocol: the ONE home of every fact this project relies on about
vLLM's `extract_hidden_states` speculative method and its `ExampleHiddenStatesConnector` (config keys,
the connector's files, the request / response fields, the layer-id reading). A vLLM change is a fix
here; the capture backend (data/capture_vllm.py) and the test stand-in (tests/standins/vllm_standin.py)
only call these functions.

Read from vLLM 0.34.0's source, not run against a real engine: what was read where, and why chunked prefill
stays on and prefix caching goes off, is in docs/engines.md ("vLLM 0.34.0's extraction protocol, as read").
Image prompts go through the chat endpoint: eagle3/engines/vllm_images.py holds those facts.

Imports only torch, safetensors and the standard library (core code).
"""
from __future__ import annotations

import fcntl
import json
import os
import shlex
import time
from pathlib import Path
from typing import Sequence

import torch

from eagle3.engines import aux_layers

VLLM_VERSION = "0.34.0"  # the version whose source the facts below were read from
SPEC_METHOD = "extract_hidden_states"
CONNECTOR = "ExampleHiddenStatesConnector"
NO_PREFIX_CACHING_FLAG = "--no-enable-prefix-caching"  # why: the docstring
KV_ROLE = "kv_producer"
STORAGE_KEY = "shared_storage_path"  # kv_connector_extra_config key: where the connector writes
IDS_KEY = "eagle_aux_hidden_state_layer_ids"  # speculative_config.draft_model_config.hf_config key
PATH_PARAM = "hidden_states_path"  # kv_transfer_params key naming one request's file
STATES_KEY = "hidden_states"  # [T, num_ids, H], the model dtype, ids ascending
TOKENS_KEY = "token_ids"  # int64 [T], the prompt
FILE_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"


class VllmProtocolError(RuntimeError):
    """An engine reply or a connector file that does not follow the protocol."""


class ConnectorFileError(VllmProtocolError):
    """A connector file that cannot be used. `retryable`: asking the engine again may help (missing,
    truncated, still locked); otherwise the engine runs with other settings (layers, hidden size)."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


class ShortStatesFile(ConnectorFileError):
    """A complete, readable file with fewer hidden-state rows than the prompt has tokens (what a cached
    prefix does to a dump): deterministic for that prompt, so never retried and never stored."""

    def __init__(self, message: str, path: str, rows: int, expected: int):
        super().__init__(message, retryable=False)
        self.path, self.rows, self.expected = path, rows, expected


def request_ids(hf_indices: Sequence[int], num_layers: int) -> list[int]:
    """The ids to list in the engine's `eagle_aux_hidden_state_layer_ids` for aux states `hf_indices`
    plus the teacher's last state: the aux ids by the "vllm" rule (h = id), then id L (the last decoder
    layer's output, un-normed). Sorted: the file's layer axis follows the decoder loop anyway."""
    L = int(num_layers)
    h = aux_layers.validate_hf_indices(hf_indices, L)
    return sorted(aux_layers.ids_for_rule(h, "vllm")) + [L]


def layer_positions(hf_indices: Sequence[int], num_layers: int) -> tuple[list[int], int]:
    """(positions of the aux states on the file's layer axis, in `hf_indices` order; position of the
    last layer's state)."""
    ids = request_ids(hf_indices, num_layers)
    return [ids.index(i) for i in aux_layers.ids_for_rule(hf_indices, "vllm")], len(ids) - 1


# vLLM routes these text models through deepseek_v2.py (Kimi-K2 / K2.5's text model is "kimi_k2" /
# "deepseek_v3"): the model types whose fp16 residual stream vLLM rescales
DEEPSEEK_FAMILY = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")


def fp16_rescale_problem(text_config: dict, dtype: str) -> str | None:
    """Why the engine's aux states would not be HF's at `dtype`, or None. vLLM 0.34.0's
    DeepseekV2DecoderLayer.forward (model_executor/models/deepseek_v2.py 1382-1393 and 1415-1421) "fixes
    FP16 overflow" in float16 only: with MLA / V2 attention (not the plain `deepseek` model type, not all
    qk head dims 0: lines 1280-1292) it multiplies each layer's attention output, the layer-0 residual and
    the dense MLP output by 1 / routed_scaling_factor, so the residual stream, which is what an aux state
    is (`hidden_states + residual`, lines 1561-1562), is not HF's (scaled, in fp16 rounding). The final
    norm hides a common factor; the aux states do not."""
    if dtype != "float16" or text_config.get("model_type") not in DEEPSEEK_FAMILY:
        return None
    factor = float(text_config.get("routed_scaling_factor") or 1.0)
    plain_mha = all(int(text_config.get(k) or 0) == 0 for k in ("qk_nope_head_dim", "qk_rope_head_dim"))
    if factor == 1.0 or plain_mha:
        return None
    return (f"target.dtype=float16 with capture.backend=vllm: vLLM {VLLM_VERSION} runs this "
            f"{text_config.get('model_type')} target's residual stream divided by routed_scaling_factor="
            f"{factor:g} in fp16 (deepseek_v2.py, DeepseekV2DecoderLayer.forward), so its aux states would not "
            f"be the HF model's; capture in bfloat16 (what Kimi serves) or float32, or use backend=hf")


def speculative_config(ids: Sequence[int]) -> dict:
    return {"method": SPEC_METHOD, "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {IDS_KEY: [int(i) for i in ids]}}}


def kv_transfer_config(storage_dir: str | Path) -> dict:
    return {"kv_connector": CONNECTOR, "kv_role": KV_ROLE, "kv_connector_extra_config": {STORAGE_KEY: str(storage_dir)}}


def llm_kwargs(target_path: str | Path, ids: Sequence[int], storage_dir: str | Path, *, tensor_parallel_size: int,
               max_model_len: int | None, trust_remote_code: bool, dtype: str) -> dict:
    """Keyword arguments of `vllm.LLM(...)` for an in-process capture engine."""
    kw = {"model": str(target_path), "tensor_parallel_size": int(tensor_parallel_size), "dtype": dtype,
          "trust_remote_code": bool(trust_remote_code), "enable_prefix_caching": False,
          "speculative_config": speculative_config(ids), "kv_transfer_config": kv_transfer_config(storage_dir)}
    if max_model_len is not None:
        kw["max_model_len"] = int(max_model_len)
    return kw


def serve_command(target_path: str | Path, ids: Sequence[int], storage_dir: str | Path, *, tensor_parallel_size: int,
                  max_model_len: int | None, trust_remote_code: bool, dtype: str, host: str, port: int,
                  extra_flags: Sequence[str] = ()) -> str:
    """The exact `vllm serve ...` line (shell-quoted) that starts an engine this backend can use (`extra_flags`:
    more switches, e.g. eagle3/engines/vllm_images.SERVE_FLAG for image captures)."""
    args = ["vllm", "serve", str(target_path), "--tensor-parallel-size", str(int(tensor_parallel_size)),
            "--dtype", dtype]
    if max_model_len is not None:
        args += ["--max-model-len", str(int(max_model_len))]
    args.append(NO_PREFIX_CACHING_FLAG)
    if trust_remote_code:
        args.append("--trust-remote-code")
    args += list(extra_flags)
    args += ["--speculative-config", json.dumps(speculative_config(ids), separators=(",", ":")),
             "--kv-transfer-config", json.dumps(kv_transfer_config(storage_dir), separators=(",", ":")),
             "--host", host, "--port", str(int(port))]
    return " ".join(shlex.quote(a) for a in args)


def completion_body(model: str, token_ids: Sequence[int]) -> dict:
    """POST /v1/completions body: the prompt as token ids, one greedy token (the engine's own argmax at
    the last position, a cross-check of ours), the prompt ids echoed back."""
    return {"model": model, "prompt": [int(t) for t in token_ids], "max_tokens": 1, "temperature": 0.0,
            "return_token_ids": True}


def parse_completion(reply: dict, token_ids: Sequence[int]) -> tuple[str, int | None]:
    """(connector file path, the engine's greedy next token or None) from a /v1/completions reply."""
    params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
    path = params.get(PATH_PARAM) if isinstance(params, dict) else None
    if not isinstance(path, str):
        raise VllmProtocolError(f"engine reply has no kv_transfer_params.{PATH_PARAM} (is the server running "
                                f"with --kv-transfer-config {CONNECTOR}?): {str(reply)[:200]}")
    choice = (reply.get("choices") or [{}])[0]
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and list(echoed) != [int(t) for t in token_ids]:
        raise VllmProtocolError(f"engine echoed other prompt ids than sent ({len(echoed)} vs {len(token_ids)} tokens)")
    generated = choice.get("token_ids") or []
    return path, (int(generated[0]) if generated else None)


def parse_request_output(output) -> tuple[str, int | None]:
    """(connector file path, greedy next token or None) from an in-process `vllm.RequestOutput`."""
    params = getattr(output, "kv_transfer_params", None) or {}
    path = params.get(PATH_PARAM)
    if not isinstance(path, str):
        raise VllmProtocolError(f"vLLM RequestOutput has no kv_transfer_params.{PATH_PARAM}")
    outs = getattr(output, "outputs", None) or []
    tokens = list(getattr(outs[0], "token_ids", []) or []) if outs else []
    return path, (int(tokens[0]) if tokens else None)


def wait_unlocked(path: str | Path, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Wait until the connector's writer has released the exclusive lock of `<path>.lock` (a shared
    lock succeeds); False if it still holds it after `timeout_s`."""
    try:
        fd = os.open(str(path) + LOCK_SUFFIX, os.O_RDONLY)
    except FileNotFoundError:
        return True  # no lock file: written without synchronisation, or already released and removed
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(poll_s)
    finally:
        os.close(fd)


def read_states_file(path: str | Path, token_ids: torch.Tensor, num_ids: int, hidden_size: int,
                     lock_timeout_s: float = 60.0) -> torch.Tensor:
    """The `hidden_states` [T, num_ids, H] of one connector file, after its write lock is released;
    checked: readable and complete, both keys, the prompt's token ids, the layer count and width."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not wait_unlocked(path, lock_timeout_s):
        raise ConnectorFileError(f"{path}{LOCK_SUFFIX}: the engine still holds the write lock after "
                                 f"{lock_timeout_s:g}s", retryable=True)
    if not path.is_file():
        raise ConnectorFileError(f"{path}: connector file missing (the engine named it in its reply)", retryable=True)
    try:
        data = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ConnectorFileError(f"{path}: unreadable connector file (truncated?): {e}", retryable=True) from e
    missing = [k for k in (STATES_KEY, TOKENS_KEY) if k not in data]
    if missing:
        raise ConnectorFileError(f"{path}: connector file lacks {missing} (has {sorted(data)})", retryable=False)
    hs, toks = data[STATES_KEY], data[TOKENS_KEY]
    T = int(token_ids.shape[0])
    if hs.dim() == 3 and hs.shape[0] < T:
        raise ShortStatesFile(f"{path}: hidden_states has {hs.shape[0]} rows for a {T}-token prompt (short by "
                              f"{T - hs.shape[0]}: a cached prefix? the engine must run with "
                              f"{NO_PREFIX_CACHING_FLAG})", str(path), int(hs.shape[0]), T)
    if toks.shape != (T,) or not torch.equal(toks.long(), token_ids.long().cpu()):
        raise ConnectorFileError(f"{path}: token_ids are not this sequence's ({tuple(toks.shape)} vs ({T},))",
                                 retryable=True)
    if hs.dim() != 3 or hs.shape[0] != T:
        raise ConnectorFileError(f"{path}: hidden_states shape {tuple(hs.shape)}, expected ({T}, {num_ids}, "
                                 f"{hidden_size})", retryable=True)
    if hs.shape[1:] != (num_ids, hidden_size):
        raise ConnectorFileError(f"{path}: hidden_states has {hs.shape[1]} layers of width {hs.shape[2]}, expected "
                                 f"{num_ids} of {hidden_size}: the engine was started with other layer ids or "
                                 f"another target", retryable=False)
    return hs


def writer_holds_lock(path: str | Path) -> bool:
    """True while the connector's writer still holds the exclusive lock of `<file>.lock`."""
    try:
        fd = os.open(str(path) + LOCK_SUFFIX, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove_states_file(path: str | Path) -> bool:
    """Delete one connector file and its lock (what vLLM's cleanup_hidden_states does), but never under
    a live writer: while the writer holds the lock nothing is deleted and False comes back (deleting
    then would leave the writer's file behind with no lock; the caller leaves it for a later sweep).
    The check and the deletion happen under our own exclusive lock, so no writer can be mid-write."""
    lock = Path(str(path) + LOCK_SUFFIX)
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        Path(path).unlink(missing_ok=True)  # no lock: written without synchronisation, or already released
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        Path(path).unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def leftover_files(storage_dir: str | Path) -> list[Path]:
    """Connector files (and locks) in `storage_dir`: what an interrupted capture left behind."""
    d = Path(storage_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_file() and (p.name.endswith(FILE_SUFFIX)
                                                              or p.name.endswith(FILE_SUFFIX + LOCK_SUFFIX)))


def lock_for_write(path: str | Path) -> int:
    """Create `<file>.lock` and hold its exclusive lock (the connector does this before the client learns
    the path). Returns the descriptor; closing it releases the lock."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(path) + LOCK_SUFFIX, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def write_states_file(path: str | Path, hidden_states: torch.Tensor, token_ids: torch.Tensor,
                      lock_fd: int | None = None) -> None:
    """Write one file exactly as the connector does (for stand-ins): under the exclusive lock of
    `<file>.lock` (`lock_fd` from lock_for_write, or taken here), save {hidden_states [T, num_ids, H],
    token_ids int64 [T]}, then release the lock."""
    from safetensors.torch import save_file

    fd = lock_for_write(path) if lock_fd is None else lock_fd
    try:
        save_file({STATES_KEY: hidden_states.contiguous().cpu(), TOKENS_KEY: token_ids.to(torch.int64).cpu()},
                  str(path))
    finally:
        os.close(fd)
