"""`capture.backend=vllm`: the target's forward runs in a vLLM engine (its `extract_hidden_states`
speculative method with the hidden-states KV connector, tensor parallel over the GPUs), this process
turns the connector's per-request files into the project's store.

Per sequence the engine writes the states at the layer ids of eagle3/engines/vllm_protocol.request_ids: the
aux states at h (vLLM reads an id as h) and the last decoder layer's output, un-normed. Here the
target's final norm (read from the checkpoint) makes that the post-norm `last`, and the target's
lm_head (every row, from the checkpoint) gives the argmax, with the same functions as the HF backend
(fast_kernels.rms_norm is HF's RMSNorm op for op; target_io.argmax_from_last). A file is deleted as
soon as its sequence is in the store writer, so disk holds at most one batch of files.

Two engines: a running `vllm serve` (engine=server, HTTP; the client needs no vllm package) or
`vllm.LLM(...)` in this process (engine=inprocess). Before any work: the package is importable
(inprocess) or the server answers and serves the target (server); otherwise the error prints the exact
`vllm serve ...` command. Faults: an engine that stops answering or a file missing / truncated after
`vllm.retries` re-requests stops the run with a CaptureError; everything committed stays, and the rerun
resumes (the writer's resume) after deleting the files the interrupted run left. A connector file is
never deleted while vLLM's writer still holds its lock (a read that times out on the lock re-requests and
leaves that file for a sweep once the lock is released). target.dtype=float16 is refused for DeepSeek-family
targets (vllm_protocol.fp16_rescale_problem).

Images (data/capture_vllm_images.py, eagle3/engines/vllm_images.py): a sequence whose kept tokens hold images goes
to the chat endpoint (LLM.chat in process) with its images as data URIs; the prompt ids the engine returns
must be prepare's exactly, else the sequence is a counted skip. The store keeps no fused rows
(image_rows="none": the connector has no h = 0), so only image_embeddings=placeholder trains on it.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from data.capture_plan import CaptureError, Seq, make_batches
from data.capture_vllm_images import ImageRequest, ImageSkip, build_requests, expansion_problem, skip
from eagle3.config import resolve
from eagle3.target_model import target_io
from eagle3.engines import vllm_images
from eagle3.engines import vllm_protocol
from eagle3.config.dtypes import torch_dtype
from eagle3.ttt.fast_kernels import rms_norm
from eagle3.formats.store import HiddenStateWriter, NonFiniteHiddenStateError
from eagle3.formats.store_format import NO_ROWS

PACKAGE = "vllm"
SHORT_FILE = "short_states_file"  # a skip reason: fewer rows than the prompt (vllm_protocol.ShortStatesFile)


class EngineError(CaptureError):
    """The vLLM engine did not answer, or answered outside the protocol."""


class RequestRefused(EngineError):
    """The engine refused one image request (a client error): that sequence is a counted skip, not the run's end."""


Request = "list[int] | ImageRequest"  # a token-id completion, or a chat request with images
Reply = "tuple[str, int | None, list[int] | None] | RequestRefused"  # (file, greedy token, engine prompt ids)


@dataclass
class VllmSetup:
    """What the engine must be started with and how its files are read."""
    ids: list[int]  # eagle_aux_hidden_state_layer_ids the engine lists (aux h..., L)
    aux_pos: list[int]  # positions of the aux states on the file's layer axis, in hf_indices order
    last_pos: int  # position of the last layer's (un-normed) output
    storage_dir: Path  # the connector's shared_storage_path
    model: str  # the server's model name
    serve_command: str  # the exact `vllm serve ...` line


def engine_max_model_len(cfg, max_len: int) -> int:
    """vllm.max_model_len, else room for the longest sequence plus the one token a request generates,
    within the target's max_position_embeddings (vLLM refuses a longer context; a sequence of exactly
    that many tokens is then refused per request, and the run stops naming it)."""
    if cfg.vllm.max_model_len:
        return int(cfg.vllm.max_model_len)
    max_pos = int(target_io.read_text_config(cfg.target.path, cfg.target.layout)["max_position_embeddings"])
    return min(max_len + 1, max_pos)


def setup_for(cfg, hf_indices: list[int], num_layers: int, max_len: int, images: bool = False) -> VllmSetup:
    """images: the data holds images, so the engine must accept the request chat template (vllm_images)."""
    v = cfg.vllm
    problem = vllm_protocol.fp16_rescale_problem(
        target_io.read_text_config(cfg.target.path, cfg.target.layout), cfg.target.dtype)
    if problem:
        raise CaptureError(problem)
    ids = vllm_protocol.request_ids(hf_indices, num_layers)
    aux_pos, last_pos = vllm_protocol.layer_positions(hf_indices, num_layers)
    root = Path(v.storage_dir) if v.storage_dir else Path(cfg.out_dir) / "vllm_hidden_states"
    storage = (root / ("ids-" + "-".join(str(i) for i in ids))).resolve()
    url = urlparse(v.url)
    cmd = vllm_protocol.serve_command(cfg.target.path, ids, storage, tensor_parallel_size=v.tensor_parallel_size,
                                      max_model_len=engine_max_model_len(cfg, max_len),
                                      trust_remote_code=cfg.target.trust_remote_code, dtype=cfg.target.dtype,
                                      host=url.hostname or "127.0.0.1", port=url.port or 8000,
                                      extra_flags=(vllm_images.SERVE_FLAG,) if images else ())
    return VllmSetup(ids, aux_pos, last_pos, storage, v.model or str(cfg.target.path), cmd)


class ServerEngine:
    """A running `vllm serve`: one /v1/completions request per sequence, `concurrency` in flight."""

    def __init__(self, setup: VllmSetup, cfg):
        import httpx

        self.setup, self.base = setup, cfg.vllm.url.rstrip("/")
        self._httpx = httpx
        self.http = httpx.Client(timeout=httpx.Timeout(cfg.vllm.timeout_s))
        self.pool = ThreadPoolExecutor(max_workers=cfg.vllm.concurrency, thread_name_prefix="vllm-capture")

    def preflight(self) -> None:
        """The server answers and serves the target, or a CaptureError with the command that starts one."""
        try:
            reply = self.http.get(self.base + "/v1/models", timeout=10.0)
            served = [m.get("id") for m in reply.json().get("data", [])] if reply.status_code == 200 else None
        except (self._httpx.HTTPError, ValueError) as e:
            raise EngineError(f"no vLLM server answers at {self.base} ({type(e).__name__}: {e}). Start one "
                              f"(vLLM {vllm_protocol.VLLM_VERSION} read for this backend) with: "
                              f"{self.setup.serve_command}") from None
        if served is None or self.setup.model not in served:
            raise EngineError(f"the server at {self.base} serves {served}, not {self.setup.model!r} (set "
                              f"vllm.model to its name, or start it with: {self.setup.serve_command})")

    def _one(self, request: Request) -> Reply:
        image = isinstance(request, ImageRequest)
        body = vllm_images.chat_body(self.setup.model, request.text, request.image_uris) if image else \
            vllm_protocol.completion_body(self.setup.model, request)
        try:
            reply = self.http.post(self.base + (vllm_images.CHAT_PATH if image else "/v1/completions"), json=body)
        except self._httpx.HTTPError as e:
            raise EngineError(f"the vLLM server at {self.base} stopped answering ({type(e).__name__}: {e})") from None
        if reply.status_code != 200:
            said = f"the vLLM server at {self.base} answered HTTP {reply.status_code}: {reply.text[:300]}"
            if image and reply.status_code == 400 and vllm_images.SERVE_FLAG not in reply.text:
                return RequestRefused(said)
            raise EngineError(said + (f" (restart it with: {self.setup.serve_command})" if image else ""))
        try:
            return vllm_images.parse_chat(reply.json()) if image else \
                (*vllm_protocol.parse_completion(reply.json(), request), None)
        except (ValueError, vllm_protocol.VllmProtocolError) as e:
            raise EngineError(f"the vLLM server at {self.base}: {e}") from None

    def capture(self, batch: list) -> list:
        """One Reply per Request of `batch`, in order."""
        futures = [self.pool.submit(self._one, r) for r in batch]
        results, first_error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except EngineError as e:
                first_error = first_error or e
        if first_error is not None:  # the files of the requests that did succeed are not needed any more
            for r in results:
                if not isinstance(r, RequestRefused):
                    vllm_protocol.remove_states_file(r[0])
            raise first_error
        return results

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.http.close()


class InProcessEngine:
    """`vllm.LLM(...)` in this process; a batch is one `generate` call."""

    def __init__(self, setup: VllmSetup, cfg, max_len: int):
        import vllm

        self.setup = setup
        kwargs = vllm_protocol.llm_kwargs(cfg.target.path, setup.ids, setup.storage_dir,
                                          tensor_parallel_size=cfg.vllm.tensor_parallel_size,
                                          max_model_len=engine_max_model_len(cfg, max_len),
                                          trust_remote_code=cfg.target.trust_remote_code, dtype=cfg.target.dtype)
        self.llm = vllm.LLM(**kwargs)
        self.params = vllm.SamplingParams(max_tokens=1, temperature=0.0)

    def capture(self, batch: list) -> list:
        """One Reply per Request of `batch`, in order: the token-id prompts in one `generate` call, each image
        request in a `chat` call of its own (an image the engine refuses is that sequence's skip)."""
        try:
            tokens = [r for r in batch if not isinstance(r, ImageRequest)]
            outs = iter(self.llm.generate([{"prompt_token_ids": ids} for ids in tokens], self.params,
                                          use_tqdm=False) if tokens else [])
            return [self._chat(r) if isinstance(r, ImageRequest) else
                    (*vllm_protocol.parse_request_output(next(outs)), None) for r in batch]
        except vllm_protocol.VllmProtocolError as e:
            raise EngineError(f"vLLM: {e}") from None
        except Exception as e:  # the engine's own failures (a dead worker, CUDA errors) have many types
            raise EngineError(f"the in-process vLLM engine failed ({type(e).__name__}: {e})") from e

    def _chat(self, request: ImageRequest) -> Reply:
        try:
            out = self.llm.chat(vllm_images.chat_messages(request.text, request.image_uris), self.params,
                                use_tqdm=False, **vllm_images.chat_kwargs())
        except Exception as e:  # noqa: BLE001 - only the request's own faults (client errors) become a skip
            if vllm_images.is_client_error(e):
                return RequestRefused(f"vLLM refused the request ({type(e).__name__}: {e})")
            raise
        return vllm_images.parse_chat_output(out[0])

    def close(self) -> None:
        pass


def check_engine(cfg, setup: VllmSetup, dist) -> None:
    """Before any work: one process (the engine parallelises), the package (inprocess), the server (server)."""
    if dist.world > 1:
        raise CaptureError(f"capture.backend=vllm drives one engine, which spreads the target over its own "
                           f"{cfg.vllm.tensor_parallel_size} GPUs (vllm.tensor_parallel_size); launch one process, "
                           f"not {dist.world}")
    if cfg.vllm.engine == "inprocess":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise CaptureError(f"capture.backend=vllm with vllm.engine=inprocess needs the `{PACKAGE}` package, which "
                               f"is not installed here (this backend was written against vLLM "
                               f"{vllm_protocol.VLLM_VERSION}: pip install {PACKAGE}=={vllm_protocol.VLLM_VERSION}); or "
                               f"start a server elsewhere and use vllm.engine=server: {setup.serve_command}") from None
    else:
        engine = ServerEngine(setup, cfg)
        try:
            engine.preflight()
        finally:
            engine.close()


def open_engine(cfg, setup: VllmSetup, max_len: int):
    if cfg.vllm.engine == "inprocess":
        return InProcessEngine(setup, cfg, max_len)
    engine = ServerEngine(setup, cfg)
    engine.preflight()
    return engine


class Teacher:
    """The target's final norm and full lm_head, read from the checkpoint: un-normed last state ->
    (post-norm `last`, argmax over the full vocabulary)."""

    def __init__(self, cfg, text_cfg: dict):
        dev = cfg.vllm.head_device  # auto | cpu | cuda
        self.device = torch.device(resolve.device(dev))
        dtype = torch_dtype(cfg.target.dtype)
        self.eps = float(text_cfg.get("rms_norm_eps", 1e-6))
        self.norm_weight = target_io.load_final_norm(cfg.target.path, cfg.target.layout).to(self.device, dtype)
        weight = target_io.load_lm_head_rows(cfg.target.path, cfg.target.layout).to(self.device, dtype)
        self.holder = torch.nn.Module()  # what argmax_from_last looks in for `lm_head`
        self.holder.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.holder.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.chunk = cfg.argmax_chunk_tokens

    @torch.no_grad()
    def __call__(self, raw_last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = raw_last.to(self.device)  # [T, H], the model dtype
        last = rms_norm(x, self.norm_weight, self.eps, x.dtype)
        return last, target_io.argmax_from_last(self.holder, last, self.chunk).cpu()


def clean_storage(storage_dir: Path) -> tuple[int, int]:
    """Delete the connector files an interrupted run left: (deleted, still being written). A file whose
    writer still holds its lock (an engine still running the old run's request) is left alone."""
    stale = {str(p)[: -len(vllm_protocol.LOCK_SUFFIX)] if p.name.endswith(vllm_protocol.LOCK_SUFFIX) else str(p)
             for p in vllm_protocol.leftover_files(storage_dir)}
    live = [p for p in sorted(stale) if not vllm_protocol.remove_states_file(p)]
    return len(stale) - len(live), len(live)


def unaccounted_files(storage_dir: Path, expected: list[str]) -> list[str]:
    """Connector files (or their locks) in `storage_dir` other than `expected` (paths of files whose
    writers were still live): after a split, any such file is one this run read and failed to delete."""
    names = {Path(p).name for p in expected}
    names |= {n + vllm_protocol.LOCK_SUFFIX for n in names}
    return [str(p) for p in vllm_protocol.leftover_files(storage_dir) if p.name not in names]


def sweep(deferred: list[str], wait_s: float = 0.0) -> list[str]:
    """Delete the files of `deferred` whose writers have released their locks (waiting up to `wait_s`
    for each); returns those still being written (left for the next sweep or the next run's clean-up)."""
    live = []
    for path in deferred:
        if wait_s > 0:
            vllm_protocol.wait_unlocked(path, wait_s)
        if not vllm_protocol.remove_states_file(path):
            live.append(path)
    return live


def _delete(path: str, stats: dict, deferred: list[str]) -> None:
    """Delete a file this run has read (counted); one whose lock is somehow held again is swept later."""
    if vllm_protocol.remove_states_file(path):
        stats["files_deleted"] += 1
    else:  # unreachable after a read (the lock was free); swept, never left silently
        deferred.append(path)


def _read(engine, setup: VllmSetup, x: torch.Tensor, request, path: str, H: int, cfg, stats: dict,
          deferred: list[str]) -> tuple[torch.Tensor, str]:
    """The sequence's [T, num_ids, H] states and the path of the file they were read from (a re-request
    answers with a new file: that one, not the first, is the caller's to delete); a missing / truncated /
    still-locked file is asked for again. A file whose writer still holds the lock is not deleted (the writer would leave it behind
    with no lock): it goes to `deferred`, swept once the writer releases it."""
    for attempt in range(cfg.vllm.retries + 1):
        try:
            if Path(path).parent.resolve() != setup.storage_dir:
                raise CaptureError(f"the engine wrote {path}, outside {setup.storage_dir}: it was started for other "
                                   f"layer ids or another directory; restart it with: {setup.serve_command}")
            return vllm_protocol.read_states_file(path, x, len(setup.ids), H, cfg.vllm.lock_timeout_s), path
        except vllm_protocol.ShortStatesFile:
            raise  # the caller's counted skip; asking again would get the same cached prefix
        except vllm_protocol.ConnectorFileError as e:
            if not vllm_protocol.remove_states_file(path):
                deferred.append(path)
            if not e.retryable:
                raise CaptureError(f"{e}; restart the engine with: {setup.serve_command}") from None
            if attempt == cfg.vllm.retries:
                raise CaptureError(f"{e} (asked {attempt + 1} times); nothing of it was stored: rerun to resume") from None
            print(f"[capture] {e}; asking the engine again")
            stats["re_requested"] += 1
            reply = engine.capture([request])[0]
            if isinstance(reply, RequestRefused):  # it was accepted the first time: the engine changed
                raise CaptureError(f"{reply} (on asking again); rerun to resume") from None
            path = reply[0]
    raise AssertionError("unreachable")


def capture_split(engine, teacher: Teacher, ds, seqs: list[Seq], writer: HiddenStateWriter, cfg, setup: VllmSetup,
                  desc: str, images: tuple | None = None) -> dict:
    """Capture one split through the engine into `writer` (resuming: committed sequences are skipped;
    unlike the HF backend a batch is not recomputed whole: the engine runs each request on its own).
    images: (image_token_id, tokenizer) when the prepared data holds images (data/capture_vllm_images.py)."""
    from tqdm import tqdm

    store_dtype = torch_dtype(cfg.dtype)
    removed, live = clean_storage(setup.storage_dir)
    live_at_start = [str(p) for p in vllm_protocol.leftover_files(setup.storage_dir)]  # an old run's live writers
    if removed or live:
        print(f"[capture] deleted {removed} connector files an interrupted run left in {setup.storage_dir}"
              + (f"; {live} still being written by the engine are left for the next run" if live else ""))
    H = teacher.norm_weight.shape[0]
    batches = make_batches(seqs, cfg.max_tokens_per_batch)
    todo = [[s for s in b if s.id not in writer.done_ids] for b in batches]
    todo = [b for b in todo if b]
    stats = {"re_requested": 0, "files_deleted": 0, "short_files": [], "engine_token_agrees": 0, "engine_token_checked": 0, "image_requests": 0,
             "image_skips": {}}
    deferred: list[str] = []  # files whose writers held the lock past vllm.lock_timeout_s
    non_finite: list[str] = []
    total, start, done = sum(s.length for b in todo for s in b), time.time(), 0
    with tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not cfg.progress, mininterval=1.0) as bar:
        for batch in todo:
            rows = [ds[s.index] for s in batch]
            ids = [torch.as_tensor(r["input_ids"][: s.length], dtype=torch.long) for r, s in zip(rows, batch)]
            masks = [torch.as_tensor(r["loss_mask"][: s.length], dtype=torch.bool) for r, s in zip(rows, batch)]
            requests = build_requests(batch, rows, ids, writer, images, stats)
            sent = [k for k, r in enumerate(requests) if r is not None]
            stats["image_requests"] += sum(isinstance(requests[k], ImageRequest) for k in sent)
            try:
                replies = dict(zip(sent, engine.capture([requests[k] for k in sent]) if sent else []))
            except EngineError as e:
                raise EngineError(f"{e}; {done} sequences captured this run, everything committed is kept: start "
                                  f"the engine again and rerun to resume ({setup.serve_command})") from None
            for k in sent:
                s, x, m, reply = batch[k], ids[k], masks[k], replies[k]
                problem = ImageSkip("engine_refused_image", str(reply)) if isinstance(reply, RequestRefused) else \
                    None if reply[2] is None else expansion_problem(x.tolist(), reply[2], images[0])
                if problem is not None:  # this sequence only: its file (if any) is not needed
                    if not isinstance(reply, RequestRefused) and not vllm_protocol.remove_states_file(reply[0]):
                        deferred.append(reply[0])
                    skip(writer, s.id, problem, stats)
                    continue
                path, greedy, _ = reply
                try:
                    hs, path = _read(engine, setup, x, requests[k], path, H, cfg, stats, deferred)  # [T, num_ids, H]
                except vllm_protocol.ShortStatesFile as e:  # never stored: a short file must not be trained on
                    _delete(e.path, stats, deferred)
                    writer.skip(s.id, SHORT_FILE)
                    stats["short_files"].append(s.id)
                    print(f"[capture] skipped {s.id!r} ({SHORT_FILE}): {e}")
                    done += 1
                    continue
                except CaptureError:
                    for later in sent[sent.index(k) + 1:]:  # a file still being written stays for the next run
                        if not isinstance(replies[later], RequestRefused):
                            vllm_protocol.remove_states_file(replies[later][0])
                    raise
                last, argmax = teacher(hs[:, setup.last_pos])
                aux = hs[:, setup.aux_pos].reshape(hs.shape[0], -1).to(store_dtype)  # [T, 3H], hf_indices order
                last = last.to(store_dtype)
                if greedy is not None:
                    stats["engine_token_checked"] += 1
                    stats["engine_token_agrees"] += int(argmax[-1]) == greedy
                if bool(torch.isfinite(aux).all()) and bool(torch.isfinite(last).all()):
                    writer.add(s.id, x, m, aux, last, argmax, order=s.order, check_finite=False)
                else:
                    writer.skip(s.id, "non_finite")
                    non_finite.append(s.id)
                    print(f"[capture] skipped: {NonFiniteHiddenStateError(s.id, 'aux/last')}")
                _delete(path, stats, deferred)
                done += 1
            bar.update(sum(s.length for s in batch))
            deferred = sweep(deferred)
    deferred = sweep(deferred, cfg.vllm.lock_timeout_s)
    left = unaccounted_files(setup.storage_dir, deferred + live_at_start)
    if left:  # every file this split read was deleted above: one left here is a bookkeeping bug, not the engine's
        raise CaptureError(f"{len(left)} connector files this run read were left in {setup.storage_dir} (first: "
                           f"{left[0]}); everything committed is kept: rerun to resume")
    if deferred:
        print(f"[capture] {len(deferred)} connector files are still being written by the engine (their writers "
              f"hold the lock): left in {setup.storage_dir} for the next run's clean-up")
    return {"left_for_sweep": len(deferred), "batches": len(batches), "batches_run": len(todo), "tokens_run": total,
            "seconds": round(time.time() - start, 3), "non_finite_this_run": non_finite, **stats}


class VllmBackend:
    """capture.backend=vllm as a `CaptureBackend` (data/capture_backends.py): set up and checked before any
    work (one process, the package or the server), then one engine and the checkpoint's teacher head."""
    name = "vllm"
    image_rows = NO_ROWS  # the connector has no h = 0: an image capture keeps no fused rows (eagle3/engines/vllm_images.py)

    def __init__(self) -> None:
        self.setup: VllmSetup | None = None
        self.engine = self.teacher = self.tokenizer = None

    def check(self, cfg, hf_indices: list[int], num_layers: int, max_len: int, dist,
              image_token_id: int | None = None) -> None:
        self.setup = setup_for(cfg, hf_indices, num_layers, max_len, images=image_token_id is not None)
        check_engine(cfg, self.setup, dist)

    def open(self, cfg, text_cfg: dict, max_len: int, dist) -> None:
        self.engine, self.teacher = open_engine(cfg, self.setup, max_len), Teacher(cfg, text_cfg)

    def capture_split(self, ds, seqs: list[Seq], writer: HiddenStateWriter, cfg, hf_indices: list[int], dist,
                      desc: str, image_token_id: int | None = None) -> dict:
        images = None
        if image_token_id is not None:  # the prompt text is decoded with the target's tokenizer
            if self.tokenizer is None:
                from data.prepare import load_tokenizer

                self.tokenizer = load_tokenizer(cfg.target)
            images = (image_token_id, self.tokenizer)
        return capture_split(self.engine, self.teacher, ds, seqs, writer, cfg, self.setup, desc, images)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
