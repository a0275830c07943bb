"""capture.backend=vllm against vLLM 0.34.0's own Python (optional: skips unless the sources are present).

Run it on purpose (downloads the 239 MB wheel once, keeps its ~64 MB of .py in .cache/vllm-0.34.0):

    .venv/bin/python -m tests.fixtures.vllm_sources
    .venv/bin/python -m pytest tests/test_vllm_sources.py -q -p no:cacheprovider

What runs is vLLM's code, on CPU: the CLI parser and EngineArgs on the printed `vllm serve` line,
EngineArgs on the in-process kwargs, ExtractHiddenStatesSpeculatorConfig.configure() and the eagle3 aux
layer lookup, DeepseekV2Model.forward / DeepseekV2DecoderLayer.forward over the tiny DeepSeek-V3 target,
the extract_hidden_states speculator's propose() into a hidden-state KV cache through
CacheOnlyAttentionImpl (a scattered block table; the prefill in chunks), ExampleHiddenStatesConnector in
both roles (lock, slot extraction, thread-pool save_file), CompletionRequest / CompletionResponse. Fakes
stand only for what needs a GPU: the attention, MLP and norm submodules of each layer (they call the HF
model's own modules, with vLLM's fused-residual norm contract), the CUDA stream / event / pinned memory
of the connector's copy, and the distributed groups (one rank). The project's parse_completion,
read_states_file and capture_split ingest the result; the store must equal the HF backend's bit for bit.
"""
from __future__ import annotations

import contextlib
import json
import shlex
import types
from pathlib import Path

import pytest
import torch

from data import capture_vllm
from data.capture import run_capture
from data.capture_setup import Dist
from eagle3.target_model import target_io
from eagle3.engines import vllm_images
from eagle3.engines import vllm_protocol
from tests.fixtures import vllm_sources
from tests.fixtures.capture import LAYOUT, capture_config, prepared, targets  # noqa: F401 (fixtures)
from tests.fixtures.vllm_capture import LIMIT, assert_no_connector_files, assert_same_store, hf_store  # noqa: F401

SOURCES = vllm_sources.find()
pytestmark = pytest.mark.skipif(SOURCES is None, reason=f"vLLM {vllm_protocol.VLLM_VERSION} sources not present "
                                                        f"(python -m tests.fixtures.vllm_sources)")
BLOCK = 4  # the hidden-state cache's block size: sequences span many blocks
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def vllm():
    """vLLM's modules used here, imported from the sources; removed from sys.modules afterwards."""
    with vllm_sources.loaded(SOURCES):
        import importlib

        names = {"serve_args": "vllm.entrypoints.common.cli_args", "argparse": "vllm.utils.argparse_utils",
                 "arg_utils": "vllm.engine.arg_utils", "kv_transfer": "vllm.config.kv_transfer",
                 "spec_cfg": "vllm.v1.worker.gpu.spec_decode.extract_hidden_states_config",
                 "eagle3_utils": "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
                 "speculator": "vllm.v1.worker.gpu.spec_decode.extract_hidden_states",
                 "cache_model": "vllm.model_executor.models.extract_hidden_states",
                 "deepseek": "vllm.model_executor.models.deepseek_v2",
                 "connector": "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
                 "base": "vllm.distributed.kv_transfer.kv_connector.v1.base",
                 "kv_iface": "vllm.v1.kv_cache_interface", "forward_context": "vllm.forward_context",
                 "protocol": "vllm.entrypoints.openai.completion.protocol", "version": "vllm._version",
                 # the image facts (eagle3/engines/vllm_images.py)
                 "hf": "vllm.renderers.hf", "chat_message": "vllm.renderers.chat_utils.chat_message",
                 "content_parser": "vllm.renderers.chat_utils.content_parser",
                 "chat": "vllm.entrypoints.openai.chat_completion.protocol",
                 "engine_protocol": "vllm.entrypoints.serve.engine.protocol"}
        yield types.SimpleNamespace(**{k: importlib.import_module(v) for k, v in names.items()})


def vllm_cfg(tmp_path, targets, prepared, overrides=()):  # noqa: F811
    return capture_config(tmp_path, targets, prepared, out="vllm", overrides=[
        "backend=vllm", "vllm.url=http://127.0.0.1:1", "vllm.tensor_parallel_size=8", "vllm.lock_timeout_s=30",
        f"limit={LIMIT}", *overrides])


def printed_setup(cfg):
    """The setup run_capture makes: its `vllm serve` line is the one printed when no server answers."""
    from data.capture_setup import choose_aux_layers

    text = target_io.read_text_config(cfg.target.path, cfg.target.layout)
    h = choose_aux_layers(cfg, text["num_hidden_layers"]).hf_indices
    return capture_vllm.setup_for(cfg, h, text["num_hidden_layers"], 96), text


def test_the_sources_are_vllm_0_34_0(vllm):
    assert vllm.version.__version__ == vllm_protocol.VLLM_VERSION
    assert not list(Path(SOURCES).rglob("*.so"))  # nothing compiled was unzipped


def test_the_printed_serve_line_parses_with_vllm_cli_and_engine_args(vllm, tmp_path, targets, prepared):  # noqa: F811
    setup, _ = printed_setup(vllm_cfg(tmp_path, targets, prepared))
    argv = shlex.split(setup.serve_command)
    assert argv[:2] == ["vllm", "serve"]
    parser = vllm.serve_args.make_arg_parser(vllm.argparse.FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(argv[2:])
    args.model = args.model_tag  # what ServeSubcommand.cmd does (entrypoints/cli/serve.py 56-57)
    e = vllm.arg_utils.EngineArgs.from_cli_args(args)
    assert e.model == str(setup.model) and e.tensor_parallel_size == 8 and e.dtype == "float32"
    assert e.max_model_len == 97 and e.enable_chunked_prefill is None  # None: vLLM's default (on)
    assert (args.host, args.port) == ("127.0.0.1", 1)
    assert e.speculative_config == vllm_protocol.speculative_config(setup.ids)
    kv = e.kv_transfer_config
    assert isinstance(kv, vllm.kv_transfer.KVTransferConfig) and kv.kv_connector == vllm_protocol.CONNECTOR
    assert kv.kv_role == vllm_protocol.KV_ROLE and kv.get_from_extra_config("shared_storage_path", "/tmp") == str(
        setup.storage_dir)
    kwargs = vllm_protocol.llm_kwargs(setup.model, setup.ids, setup.storage_dir, tensor_parallel_size=8,
                                      max_model_len=97, trust_remote_code=True, dtype="bfloat16")
    e2 = vllm.arg_utils.EngineArgs(**kwargs)  # vllm.LLM(**kwargs) builds EngineArgs(model=..., **kwargs)
    assert e2.speculative_config == e.speculative_config and e2.enable_chunked_prefill is None


# ---- the engine: vLLM's forward, speculator and connector on CPU ----------------------------------------

class _FusedNorm(torch.nn.Module):
    """vLLM's RMSNorm contract (norm(x) or norm(x, residual) -> (norm(x + residual), x + residual)) over the
    HF model's own RMSNorm module (the GPU kernel is what is faked)."""

    def __init__(self, hf_norm):
        super().__init__()
        self.hf = hf_norm

    def forward(self, x, residual=None):
        if residual is None:
            return self.hf(x[None])[0]
        s = residual + x
        return self.hf(s[None])[0], s


class _Attention(torch.nn.Module):
    """The HF layer's attention over one sequence of flat tokens (vLLM's [T, H] layout)."""

    def __init__(self, hf_layer, rotary):
        super().__init__()
        self.hf, self.rotary = hf_layer.self_attn, rotary

    def forward(self, positions, hidden_states, llama_4_scaling=None):
        x = hidden_states[None]
        T = x.shape[1]
        pos = positions[None]
        mask = torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        out = self.hf(hidden_states=x, position_embeddings=self.rotary(x, pos), attention_mask=mask)[0]
        return out[0]


class _Mlp(torch.nn.Module):
    def __init__(self, hf_mlp):
        super().__init__()
        self.hf = hf_mlp

    def forward(self, x):
        return self.hf(x[None])[0]


def vllm_deepseek(vllm, hf_model, aux_layers):
    """A DeepseekV2Model whose forward and decoder layers' forward are vLLM's; submodules faked over HF's."""
    dv = vllm.deepseek
    inner = target_io.text_model(hf_model)
    layers = []
    for i, hf_layer in enumerate(inner.layers):
        layer = dv.DeepseekV2DecoderLayer.__new__(dv.DeepseekV2DecoderLayer)
        torch.nn.Module.__init__(layer)
        layer.layer_idx, layer.use_mha, layer.use_sequence_parallel_moe = i, False, False
        layer.routed_scaling_factor = float(inner.config.routed_scaling_factor)
        layer.self_attn = _Attention(hf_layer, inner.rotary_emb)
        layer.mlp = _Mlp(hf_layer.mlp)
        layer.input_layernorm = _FusedNorm(hf_layer.input_layernorm)
        layer.post_attention_layernorm = _FusedNorm(hf_layer.post_attention_layernorm)
        layers.append(layer)
    model = dv.DeepseekV2Model.__new__(dv.DeepseekV2Model)
    torch.nn.Module.__init__(model)
    model.config, model.layers, model.start_layer, model.end_layer = inner.config, layers, 0, len(layers)
    model.hidden_size, model.embed_tokens, model.norm = inner.config.hidden_size, inner.embed_tokens, _FusedNorm(inner.norm)
    model.aux_hidden_state_layers = tuple(aux_layers)
    return model, target_io.lm_head(hf_model)


class _CpuTorch(types.ModuleType):
    """`torch` for the connector module on CPU: CUDA streams / events are immediate, no pinned memory."""

    class cuda:  # noqa: N801
        class Event:
            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

            def query(self):
                return True

        class Stream:
            def wait_event(self, event):
                pass

        @staticmethod
        def stream(s):
            return contextlib.nullcontext()

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty_like(t, **kw):
        kw.pop("pin_memory", None)
        return torch.empty_like(t, **kw)


class SourcesEngine:
    """capture_vllm's engine interface (capture(batch) -> [(path, greedy)]) run through vLLM's code."""

    def __init__(self, vllm, monkeypatch, cfg, setup, chunk_tokens=None):
        self.v, self.setup, self.chunk = vllm, setup, chunk_tokens
        self.requests = 0
        text_cfg = target_io.read_text_config(cfg.target.path, cfg.target.layout)
        hf_model, _ = target_io.load_target(cfg.target.path, cfg.target.layout, cfg.target.dtype)
        self.dtype = getattr(torch, cfg.target.dtype)
        H, n = int(text_cfg["hidden_size"]), len(setup.ids)

        # the speculative config as vLLM configures it, and the aux layers the model runner sets from it
        hf_config = __import__("transformers").AutoConfig.for_model(**text_cfg)
        spec = types.SimpleNamespace(draft_model_config=vllm_protocol.speculative_config(setup.ids)["draft_model_config"],
                                     target_model_config=types.SimpleNamespace(hf_config=hf_config),
                                     target_parallel_config=None, update_arch_=lambda: None)
        vllm.spec_cfg.ExtractHiddenStatesSpeculatorConfig.configure(spec)
        self.spec = spec
        aux = vllm.eagle3_utils.get_eagle3_aux_layers_from_config(spec)
        self.model, self.lm_head = vllm_deepseek(vllm, hf_model, aux)
        monkeypatch.setattr(vllm.deepseek, "get_pp_group", lambda: types.SimpleNamespace(is_first_rank=True,
                                                                                          is_last_rank=True))

        # the hidden-state cache: one CacheOnlyAttentionLayer, [blocks, num_ids, block, H] in the model dtype
        cm = vllm.cache_model
        self.layer_name = f"cache_only_layers.{text_cfg['num_hidden_layers']}"
        layer = cm.CacheOnlyAttentionLayer.__new__(cm.CacheOnlyAttentionLayer)
        torch.nn.Module.__init__(layer)
        layer.layer_name, layer.num_heads, layer.head_size = self.layer_name, n, H
        layer.impl = cm.CacheOnlyAttentionImpl(n, H, "auto", self.dtype)
        layer.kv_cache = torch.zeros(NUM_BLOCKS, n, BLOCK, H, dtype=self.dtype)
        self.cache_layer = layer
        draft = cm.ExtractHiddenStatesModel.__new__(cm.ExtractHiddenStatesModel)
        torch.nn.Module.__init__(draft)
        draft.target_num_hidden_layers = text_cfg["num_hidden_layers"]
        draft.cache_only_layers = torch.nn.ModuleDict({str(draft.target_num_hidden_layers): layer})

        sp = vllm.speculator.ExtractHiddenStatesSpeculator
        self.spec_runner = sp.__new__(sp)
        self.spec_runner.num_hidden_states, self.spec_runner.model = n, draft
        self.spec_runner.hidden_states = torch.zeros(512, n, H, dtype=self.dtype)
        self.spec_runner.draft_attn_layer_names = {self.layer_name}
        self.spec_runner.vllm_config, self.spec_runner.can_reuse_target_attn_metadata = None, True

        @contextlib.contextmanager
        def forward_context(attn_metadata, vllm_config, num_tokens=None, slot_mapping=None, **kw):
            ctx = types.SimpleNamespace(no_compile_layers={self.layer_name: layer}, slot_mapping=slot_mapping,
                                        attn_metadata=attn_metadata)
            with vllm.forward_context.override_forward_context(ctx):
                yield
        monkeypatch.setattr(vllm.speculator, "set_forward_context", forward_context)

        # the connector, in both roles, with an MLA group beside the hidden-state group
        kvi = vllm.kv_iface
        groups = [types.SimpleNamespace(kv_cache_spec=kvi.MLAAttentionSpec(block_size=64, num_kv_heads=1,
                                                                           head_size=8, dtype=self.dtype)),
                  types.SimpleNamespace(kv_cache_spec=kvi.HiddenStateCacheSpec(block_size=BLOCK, num_kv_heads=n,
                                                                               head_size=H, dtype=self.dtype))]
        kv_cache_config = types.SimpleNamespace(kv_cache_groups=groups)
        kt = vllm.kv_transfer.KVTransferConfig(**vllm_protocol.kv_transfer_config(setup.storage_dir))
        vcfg = types.SimpleNamespace(kv_transfer_config=kt, speculative_config=spec,
                                     cache_config=types.SimpleNamespace(block_size=16))
        con = vllm.connector
        monkeypatch.setattr(con, "torch", _CpuTorch())
        monkeypatch.setattr(con, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(con, "get_layers_from_vllm_config", lambda cfg_, cls, names: {n_: layer for n_ in names})
        role = vllm.base.KVConnectorRole
        self.scheduler = con.ExampleHiddenStatesConnector(vcfg, role.SCHEDULER, kv_cache_config)
        self.worker = con.ExampleHiddenStatesConnector(vcfg, role.WORKER, kv_cache_config)
        self.worker.register_kv_caches({self.layer_name: layer.kv_cache})
        assert self.worker._cache_kv_group_id == 1 and self.worker.num_hidden_states == n
        self.free = list(range(NUM_BLOCKS - 1, 0, -1))  # block 0 is vLLM's null block

    def _step(self, scheduled_new_reqs=(), finished=()):
        """One engine step's connector traffic: scheduler metadata -> worker (locks, then saves)."""
        meta = self.scheduler.build_connector_meta(types.SimpleNamespace(scheduled_new_reqs=list(scheduled_new_reqs)))
        self.worker.bind_connector_metadata(meta)
        self.worker.wait_for_save()
        done, _ = self.worker.get_finished(set(finished))
        self.worker.clear_connector_metadata()
        return done

    @torch.no_grad()
    def run(self, token_ids: list[int]) -> dict:
        """One /v1/completions request through vLLM's pieces; the reply as vLLM's server would send it."""
        v = self.v
        body = vllm_protocol.completion_body(self.setup.model, token_ids)
        request = v.protocol.CompletionRequest.model_validate(body)
        assert request.prompt == token_ids and request.return_token_ids and request.max_tokens == 1
        req_id = f"cmpl-{self.requests}-0"
        self.requests += 1
        self._step([types.SimpleNamespace(req_id=req_id, sampling_params=None)])  # the lock exists from here
        T = len(token_ids)
        nblocks = -(-T // BLOCK)
        blocks = [self.free.pop(k * 7 % len(self.free)) for k in range(nblocks)]  # scattered
        slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(T)])
        x = torch.tensor(token_ids)
        normed, aux = self.model.forward(x, torch.arange(T), None)
        greedy = int(self.lm_head(normed[-1:]).argmax(-1))
        step = self.chunk or T
        for a in range(0, T, step):  # each scheduler step's tokens, as the model runner hands them over
            b = min(a + step, T)
            batch = types.SimpleNamespace(idx_mapping=torch.tensor([0]), is_padding=torch.zeros(b - a, dtype=torch.bool))
            meta = {self.layer_name: v.cache_model.CacheOnlyAttentionMetadata(slots[a:b])}
            self.spec_runner.propose(batch, meta, {self.layer_name: slots[a:b]}, None, [h[a:b] for h in aux],
                                     None, None, torch.tensor([[greedy]]), None, None, None)
        req = types.SimpleNamespace(request_id=req_id, kv_transfer_params=None, prompt_token_ids=token_ids)
        delay, params = self.scheduler.request_finished(req, blocks)
        assert delay and params == {vllm_protocol.PATH_PARAM: params[vllm_protocol.PATH_PARAM]}
        assert self._step(finished=[req_id]) == {req_id}  # the copy is done; the file may still be in writing
        self.free.extend(blocks)
        choice = v.protocol.CompletionResponseChoice(index=0, text="", token_ids=[greedy], prompt_token_ids=token_ids,
                                                     finish_reason="length")
        reply = v.protocol.CompletionResponse(model=self.setup.model, choices=[choice], kv_transfer_params=params,
                                              usage={"prompt_tokens": T, "completion_tokens": 1, "total_tokens": T + 1})
        return json.loads(reply.model_dump_json())

    def capture(self, batch):  # the backend's Reply: (file, greedy token, engine prompt ids: None for completions)
        return [(*vllm_protocol.parse_completion(self.run(ids), ids), None) for ids in batch]

    def close(self):
        self.worker._executor.shutdown(wait=True)


def test_configure_and_the_aux_layer_lookup_read_the_projects_config(vllm, tmp_path, targets, prepared,  # noqa: F811
                                                                     monkeypatch):
    cfg = vllm_cfg(tmp_path, targets, prepared)
    setup, text = printed_setup(cfg)
    engine = SourcesEngine(vllm, monkeypatch, cfg, setup)
    hf_config = engine.spec.draft_model_config.hf_config
    assert type(hf_config).__name__ == "ExtractHiddenStatesConfig"
    assert list(hf_config.eagle_aux_hidden_state_layer_ids) == setup.ids == [2, 4, 5, 8]
    assert engine.model.aux_hidden_state_layers == tuple(setup.ids)
    engine.close()


def test_a_prefill_in_chunks_writes_the_same_file_as_one_step(vllm, tmp_path, targets, prepared, monkeypatch):  # noqa: F811
    cfg = vllm_cfg(tmp_path, targets, prepared)
    setup, text = printed_setup(cfg)
    ids = list(range(5, 5 + 37))
    files = []
    for chunk in (None, 16, 5):
        engine = SourcesEngine(vllm, monkeypatch, cfg, setup, chunk_tokens=chunk)
        path, _, _ = engine.capture([ids])[0]
        files.append(vllm_protocol.read_states_file(path, torch.tensor(ids), len(setup.ids), text["hidden_size"]))
        assert vllm_protocol.remove_states_file(path)
        engine.close()
    assert files[0].shape == (37, 4, text["hidden_size"]) and files[0].abs().sum() > 0
    assert torch.equal(files[0], files[1]) and torch.equal(files[0], files[2])


def test_capture_through_vllms_code_equals_the_hf_store(vllm, tmp_path, targets, prepared, hf_store,  # noqa: F811
                                                       monkeypatch):
    cfg = vllm_cfg(tmp_path, targets, prepared)
    setup, _ = printed_setup(cfg)
    engines = []

    def open_engine(cfg_, setup_, max_len):
        engines.append(SourcesEngine(vllm, monkeypatch, cfg_, setup_, chunk_tokens=16))
        return engines[-1]
    monkeypatch.setattr(capture_vllm, "check_engine", lambda *a: None)
    monkeypatch.setattr(capture_vllm, "open_engine", open_engine)
    out = run_capture(cfg, Dist())
    engines[0].close()
    assert_same_store(hf_store, out)
    m = json.loads((out / "manifest.json").read_text())["splits"]["train"]["this_run"]
    assert m["engine_token_checked"] == m["engine_token_agrees"] > 0  # vLLM's greedy token = our argmax
    assert_no_connector_files(cfg)


# ---- image prompts through the chat endpoint (eagle3/engines/vllm_images.py) ------------------------------------
# What runs: Kimi-K2.5's placeholder string, the content-format detection on the verbatim template, the
# multimodal text prompt assembly, ChatCompletionRequest on the backend's body (and the chat params it builds),
# ChatCompletionResponse read back by parse_chat, the serve CLI with the flag; read, not run: the online
# renderer's request-template guard and DeepseekV2Model.forward's residual (h = 0 unavailable). Not here: the
# checkpoint's own image processor (the expansion) and the engine; the stand-in covers those
# (tests/test_capture_vllm_images.py).

def _method_source(relpath: str, cls: str, method: str) -> str:
    """A method's source, read with ast (vLLM's model modules are not imported for one method's text)."""
    import ast

    text = (Path(SOURCES) / relpath).read_text()
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return ast.get_source_segment(text, fn)


def test_the_placeholder_is_kimi_k25s(vllm):
    assert vllm.version.__version__ == vllm_protocol.VLLM_VERSION
    src = _method_source("vllm/model_executor/models/kimi_k25.py", "KimiK25ForConditionalGeneration",
                         "get_placeholder_str")
    namespace: dict = {}
    exec(compile("def f(modality, i):\n" + src.split(":\n", 1)[1], "kimi_k25", "exec"), namespace)  # the body
    assert namespace["f"]("image", 0) == vllm_images.PLACEHOLDER


def test_the_verbatim_template_reads_content_as_a_string(vllm):
    detect = vllm.hf._detect_content_format
    assert detect(vllm_images.PASSTHROUGH_TEMPLATE, default="openai") == "string"
    looping = "{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"
    assert detect(looping, default="string") == "openai"  # the detection does tell them apart


def test_placeholders_already_in_the_text_stay_where_they_are(vllm):
    key = vllm.content_parser.MODALITY_PLACEHOLDERS_MAP["image"]
    P = vllm_images.PLACEHOLDER
    text = f"<|im_user|>user<|im_middle|>{P}\nfirst{P}\nsecond<|im_end|>"
    full = vllm.chat_message.get_full_multimodal_text_prompt
    assert full({key: [P, P]}, [text], interleave_strings=False) == text
    # without them in the text, vLLM puts them in front: another prompt than prepare's (the backend refuses that)
    assert full({key: [P]}, ["plain"], interleave_strings=False) == f"{P}\nplain"


def test_a_request_template_needs_the_serve_flag(vllm):
    # read, not run: importing the online renderer pulls openai_harmony's real enums, which the sources' stubs lack
    src = (Path(SOURCES) / "vllm" / "renderers" / "online_renderer.py").read_text()
    guard = src[src.index("    def validate_chat_template("):]
    guard = guard[: guard.index("        return None")]  # the method's body up to its "allowed" exit
    assert "if not trust_request_chat_template and (" in guard and "request_chat_template is not None" in guard
    assert f"{vllm_images.SERVE_FLAG} is not set" in guard


def test_the_chat_body_validates_and_builds_the_verbatim_rendering(vllm):
    body = vllm_images.chat_body("/m/k25", f"x{vllm_images.PLACEHOLDER}y", ["data:image/png;base64,iVBORw0KGgo="])
    req = vllm.chat.ChatCompletionRequest.model_validate(body)
    assert req.return_token_ids is True and req.add_generation_prompt is False and req.max_completion_tokens == 1
    assert req.temperature == 0.0
    params = req.build_chat_params(None, "auto")
    assert params.chat_template == vllm_images.PASSTHROUGH_TEMPLATE
    assert params.chat_template_kwargs["add_generation_prompt"] is False


def test_a_chat_response_is_read_back_by_parse_chat(vllm):
    c = vllm.chat
    choice = c.ChatCompletionResponseChoice(index=0, message=c.ChatMessage(role="assistant", content=""),
                                            token_ids=[42], finish_reason="length")
    usage = vllm.engine_protocol.UsageInfo(prompt_tokens=5, completion_tokens=1, total_tokens=6)
    reply = c.ChatCompletionResponse(model="/m/k25", choices=[choice], usage=usage, prompt_token_ids=[1, 7, 7, 7, 2],
                                     kv_transfer_params={vllm_protocol.PATH_PARAM: "/hs/req-1.safetensors"})
    assert vllm_images.parse_chat(json.loads(reply.model_dump_json())) == ("/hs/req-1.safetensors", 42,
                                                                          [1, 7, 7, 7, 2])


def test_the_serve_line_with_the_flag_parses(vllm):
    line = vllm_protocol.serve_command("/m/k25", [2, 4, 8], "/hs", tensor_parallel_size=8, max_model_len=97,
                                       trust_remote_code=True, dtype="bfloat16", host="127.0.0.1", port=8000,
                                       extra_flags=(vllm_images.SERVE_FLAG,))
    parser = vllm.serve_args.make_arg_parser(vllm.argparse.FlexibleArgumentParser(prog="vllm serve"))
    assert parser.parse_args(shlex.split(line)[2:]).trust_request_chat_template is True
    plain = line.replace(" " + vllm_images.SERVE_FLAG, "")
    assert parser.parse_args(shlex.split(plain)[2:]).trust_request_chat_template is False


def test_h0_is_not_a_state_the_connector_can_give(vllm):
    src = _method_source("vllm/model_executor/models/deepseek_v2.py", "DeepseekV2Model", "forward")
    first_rank = src.index("residual = None")  # the first rank starts with no residual ...
    loop = src.index("for idx, layer in enumerate(")
    append = src.index("aux_hidden_state = hidden_states + residual")  # ... and an aux state adds it (id 0: None)
    assert first_rank < loop < append
