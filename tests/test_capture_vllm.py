"""capture.backend=vllm against the vLLM stand-in (tests/standins/vllm_standin.py; vLLM itself cannot run
here): the store it writes equals the HF backend's bit for bit in fp32 (aux, post-norm last, argmax), through
a server started from the exact `vllm serve` line the backend prints and through the in-process engine; the
faults (package missing, engine unreachable, engine dead mid-run, a connector file missing or truncated) each
fail clearly or recover, and leave a store that a rerun completes to the same result, with no files left."""
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from data import capture_vllm
from data.capture import run_capture
from data.capture_plan import CaptureError
from data.capture_setup import Dist
from eagle3.engines import aux_layers
from eagle3.engines import vllm_protocol
from eagle3.formats.store import HiddenStateStore
from tests.fixtures.capture import LAYOUT, capture_config, prepared, targets  # noqa: F401 (fixtures)
from tests.fixtures.vllm_capture import LIMIT, assert_no_connector_files, assert_same_store, hf_store  # noqa: F401
from tests.standins.vllm_standin import Faults, StandinError, StandinServer, fake_vllm_module, parse_serve_command
from tests.fixtures.ports import free_port  # noqa: F401 (also used by other tests)




def vllm_config(tmp_path, targets, prepared, which="k25", out="vllm", port=None, overrides=()):
    return capture_config(tmp_path, targets, prepared, which, out=out, overrides=[
        "backend=vllm", f"vllm.url=http://127.0.0.1:{port or free_port()}", "vllm.tensor_parallel_size=2",
        "vllm.timeout_s=30", "vllm.lock_timeout_s=10", f"limit={LIMIT}", *overrides])


def serve_command_of(cfg) -> str:
    """The `vllm serve` line the backend prints when nothing answers (and the proof nothing was written)."""
    with pytest.raises(CaptureError, match="no vLLM server answers") as e:
        run_capture(cfg, Dist())
    assert not any((Path(cfg.out_dir) / s).exists() for s in cfg.splits)
    return re.search(r"(vllm serve .*)$", str(e.value)).group(1)


def test_protocol_facts_follow_the_vllm_rule_of_aux_layers():
    # Kimi's 61 layers, h = [2, 30, 58]: vLLM reads ids as h; the last layer's output is id L, appended last
    assert vllm_protocol.request_ids([2, 30, 58], 61) == [2, 30, 58, 61]
    assert aux_layers.hf_indices_from_ids([2, 30, 58], "vllm") == [2, 30, 58]
    assert vllm_protocol.layer_positions([2, 30, 58], 61) == ([0, 1, 2], 3)  # the file's layer axis: h, then L
    with pytest.raises(aux_layers.AuxLayerError, match="not ascending"):  # engines capture in layer order
        vllm_protocol.layer_positions([30, 2, 58], 61)
    cmd = vllm_protocol.serve_command("/m/Kimi K2.5", [2, 30, 58, 61], "/data/hs", tensor_parallel_size=8,
                                      max_model_len=8193, trust_remote_code=True, dtype="bfloat16", host="0.0.0.0",
                                      port=8000)
    args = parse_serve_command(cmd)
    assert args.model == "/m/Kimi K2.5" and args.tensor_parallel_size == 8 and args.trust_remote_code
    assert args.speculative_config == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                       "draft_model_config": {"hf_config": {
                                           "eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]}}}
    assert args.kv_transfer_config == {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                       "kv_connector_extra_config": {"shared_storage_path": "/data/hs"}}
    # chunked prefill stays on (vLLM's default; the reasons in eagle3/engines/vllm_protocol.py's docstring; its
    # bookkeeping run through vLLM's own code in tests/test_vllm_sources.py)
    assert "chunked" not in cmd and not any("chunked" in k for k in vllm_protocol.llm_kwargs(
        "/m", [2, 61], "/hs", tensor_parallel_size=1, max_model_len=None, trust_remote_code=False, dtype="bfloat16"))
    with pytest.raises(StandinError, match="--no-enable-chunked-prefill"):  # the stand-in refuses unknown flags
        parse_serve_command(cmd + " --no-enable-chunked-prefill")


def test_fp16_is_refused_for_deepseek_targets_whose_residual_vllm_rescales(tmp_path, targets, prepared):  # noqa: F811
    mla = {"model_type": "deepseek_v3", "routed_scaling_factor": 2.827, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64}
    assert "routed_scaling_factor=2.827" in vllm_protocol.fp16_rescale_problem(mla, "float16")
    for cfg_, dtype in ((mla, "bfloat16"), (mla, "float32"), ({**mla, "model_type": "kimi_k2"}, "bfloat16"),
                        ({**mla, "routed_scaling_factor": 1.0}, "float16"),  # a factor of 1 changes nothing
                        ({**mla, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0}, "float16"),  # plain MHA: no rescale
                        ({**mla, "model_type": "deepseek"}, "float16"), ({"model_type": "llama"}, "float16")):
        assert vllm_protocol.fp16_rescale_problem(cfg_, dtype) is None, (cfg_, dtype)
    assert vllm_protocol.fp16_rescale_problem({**mla, "model_type": "kimi_k2"}, "float16")
    cfg = vllm_config(tmp_path, targets, prepared, overrides=["target.dtype=float16"])  # the tiny DeepSeek-V3
    with pytest.raises(CaptureError, match=r"float16.*routed_scaling_factor=2\.5.*bfloat16"):
        run_capture(cfg, Dist())
    assert not (tmp_path / "vllm").exists()  # refused before any work
    serve_command_of(vllm_config(tmp_path, targets, prepared, overrides=["target.dtype=bfloat16"]))  # accepted


def test_a_writer_holding_the_lock_past_the_timeout_is_never_deleted_under(tmp_path, targets, prepared,  # noqa: F811
                                                                          hf_store):
    cfg = vllm_config(tmp_path, targets, prepared, overrides=["vllm.lock_timeout_s=0.3"])
    cmd = serve_command_of(cfg)
    with StandinServer.from_command(cmd, "kimi_k25", Faults(hold={3})) as server:
        out = run_capture(cfg, Dist())
        held = server.engine.storage / f"standin-3{vllm_protocol.FILE_SUFFIX}"
        # the capture is complete from the re-request, and the held file was never deleted under its writer
        run = json.loads((out / "manifest.json").read_text())["splits"]["train"]["this_run"]
        assert (run["re_requested"], run["left_for_sweep"]) == (1, 1)
        assert vllm_protocol.writer_holds_lock(held) and Path(str(held) + vllm_protocol.LOCK_SUFFIX).exists()
        assert not vllm_protocol.remove_states_file(held)  # the writer is live: nothing is deleted
        server.engine.faults.release.set()
        for w in server.engine.writers:
            w.join()
    assert_same_store(hf_store, out)
    assert held.is_file() and not vllm_protocol.writer_holds_lock(held)  # the writer finished its file
    assert capture_vllm.clean_storage(held.parent) == (1, 0)  # the next run's sweep deletes it
    assert_no_connector_files(cfg)


def test_connector_file_reader_waits_for_the_lock_and_names_each_fault(tmp_path):
    path, toks = tmp_path / "req-1.safetensors", torch.tensor([5, 6, 7])
    states = torch.randn(3, 4, 8)
    fd = vllm_protocol.lock_for_write(path)  # the engine holds the lock until the file is complete
    with pytest.raises(vllm_protocol.ConnectorFileError, match="still holds the write lock") as e:
        vllm_protocol.read_states_file(path, toks, 4, 8, lock_timeout_s=0.2)
    assert e.value.retryable
    vllm_protocol.write_states_file(path, states, toks, lock_fd=fd)  # releases it
    assert torch.equal(vllm_protocol.read_states_file(path, toks, 4, 8), states)
    for toks_, n, H, message, retryable in ((torch.tensor([5, 6, 8]), 4, 8, "not this sequence's", True),
                                            (toks, 3, 8, "started with other layer ids", False)):
        with pytest.raises(vllm_protocol.ConnectorFileError, match=message) as e:
            vllm_protocol.read_states_file(path, toks_, n, H)
        assert e.value.retryable == retryable
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(vllm_protocol.ConnectorFileError, match="unreadable"):
        vllm_protocol.read_states_file(path, toks, 4, 8)
    vllm_protocol.remove_states_file(path)
    assert vllm_protocol.leftover_files(tmp_path) == []
    with pytest.raises(vllm_protocol.ConnectorFileError, match="missing"):
        vllm_protocol.read_states_file(path, toks, 4, 8)


def test_server_from_the_printed_command_writes_the_hf_store(tmp_path, targets, prepared, hf_store):  # noqa: F811
    cfg = vllm_config(tmp_path, targets, prepared)
    cmd = serve_command_of(cfg)
    assert "--tensor-parallel-size 2" in cmd and "[2,4,5,8]" in cmd and "--max-model-len " in cmd
    with StandinServer.from_command(cmd, "kimi_k25", Faults(write_delay_s=0.02)) as server:
        out = run_capture(cfg, Dist())
    assert_same_store(hf_store, out)
    assert_no_connector_files(cfg)
    # disk stays bounded: never more files than one batch of requests (96 tokens, shortest sequence >= 12)
    assert 0 < server.engine.max_files_seen <= 8 and server.engine.requests == sum(
        len(HiddenStateStore(out / s)) for s in ("train", "validation"))
    m = json.loads((out / "manifest.json").read_text())
    run = m["splits"]["train"]["this_run"]
    assert run["engine_token_checked"] == len(HiddenStateStore(out / "train")) == run["engine_token_agrees"]
    assert HiddenStateStore(out / "train").manifest["meta"]["backend"] == "vllm"


def test_inprocess_engine_needs_the_package_then_matches_hf_with_fp8_aux(tmp_path, targets, prepared, monkeypatch):  # noqa: F811
    over = ["vllm.engine=inprocess", "aux_hf_indices=[2,4,7]", "aux_dtype=float8_e4m3fn"]
    cfg = vllm_config(tmp_path, targets, prepared, "k2", overrides=over)
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(CaptureError, match=r"needs the `vllm` package.*pip install vllm==0\.34\.0"):
        run_capture(cfg, Dist())
    assert not (tmp_path / "vllm").exists()
    fake = fake_vllm_module(layout="causal_lm")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    out = run_capture(cfg, Dist())
    ref = run_capture(capture_config(tmp_path, targets, prepared, "k2", out="hf",
                                     overrides=["max_tokens_per_batch=1", "aux_hf_indices=[2,4,7]",
                                                "aux_dtype=float8_e4m3fn", f"limit={LIMIT}"]), Dist())
    assert_same_store(ref, out)
    assert fake.engines[0].ids == [2, 4, 7, 8]  # the aux h, then id L = the last layer's raw output
    assert HiddenStateStore(out / "train").hf_indices == [2, 4, 7]
    assert HiddenStateStore(out / "train").manifest["aux_dtype"] == "float8_e4m3fn"  # the fp8 store option
    assert_no_connector_files(cfg)


def test_engine_dying_mid_run_leaves_a_store_the_rerun_completes(tmp_path, targets, prepared, hf_store):  # noqa: F811
    port = free_port()
    cfg = vllm_config(tmp_path, targets, prepared, port=port, overrides=["vllm.concurrency=2", "shard_tokens=100"])
    cmd = serve_command_of(cfg)
    with StandinServer.from_command(cmd, "kimi_k25", Faults(die_after=4)):
        with pytest.raises(CaptureError, match=r"stopped answering.*rerun to resume"):
            run_capture(cfg, Dist())
    partial = json.loads((tmp_path / "vllm" / "train" / "manifest.json").read_text())
    assert not partial["complete"] and 0 < partial["num_sequences"] < 4  # committed shards kept, not all
    with StandinServer.from_command(cmd, "kimi_k25") as server:
        out = run_capture(cfg, Dist())
    assert server.engine.requests < len(HiddenStateStore(out / "train")) + len(HiddenStateStore(out / "validation"))
    assert_same_store(hf_store, out)
    assert_no_connector_files(cfg)


@pytest.mark.parametrize("fault", ["drop", "truncate"])
def test_a_missing_or_truncated_file_is_asked_for_again_or_stops_resumably(tmp_path, targets, prepared,  # noqa: F811
                                                                            hf_store, fault):
    cfg = vllm_config(tmp_path, targets, prepared)
    cmd = serve_command_of(cfg)
    with StandinServer.from_command(cmd, "kimi_k25", Faults(**{fault: {3}})):
        out = run_capture(cfg, Dist())
    run = json.loads((out / "manifest.json").read_text())["splits"]["train"]["this_run"]
    assert run["re_requested"] == 1
    # the re-requested file is the one read, so it is the one deleted: one file deleted per stored sequence
    assert run["files_deleted"] == len(HiddenStateStore(out / "train"))
    assert_no_connector_files(cfg)
    assert_same_store(hf_store, out)
    strict = vllm_config(tmp_path, targets, prepared, out="strict", port=cfg.vllm.url.rsplit(":", 1)[1],
                         overrides=["vllm.retries=0"])
    strict_cmd = serve_command_of(strict)
    with StandinServer.from_command(strict_cmd, "kimi_k25", Faults(**{fault: {3}})):
        with pytest.raises(CaptureError, match=r"(missing|unreadable).*asked 1 times.*rerun to resume"):
            run_capture(strict, Dist())
    with StandinServer.from_command(strict_cmd, "kimi_k25"):
        assert_same_store(hf_store, run_capture(strict, Dist()))
    assert_no_connector_files(strict)


def test_an_engine_started_for_other_layers_is_refused(tmp_path, targets, prepared):  # noqa: F811
    cfg = vllm_config(tmp_path, targets, prepared, overrides=["splits=[validation]"])
    cmd = serve_command_of(cfg)
    other = cmd.replace("[2,4,5,8]", "[1,3,5,8]").replace("ids-2-4-5-8", "ids-1-3-5-8")
    with StandinServer.from_command(other, "kimi_k25"):
        with pytest.raises(CaptureError, match=r"outside .*ids-2-4-5-8.*restart it with: vllm serve"):
            run_capture(cfg, Dist())


def test_prefix_caching_is_off_and_a_short_file_is_a_counted_skip_never_stored(tmp_path, targets, prepared,  # noqa: F811
                                                                               hf_store):
    cfg = vllm_config(tmp_path, targets, prepared)
    cmd = serve_command_of(cfg)
    assert not parse_serve_command(cmd).enable_prefix_caching  # the printed line turns vLLM's default off
    assert vllm_protocol.llm_kwargs("/m", [2, 61], "/hs", tensor_parallel_size=1, max_model_len=None,
                                    trust_remote_code=False, dtype="bfloat16")["enable_prefix_caching"] is False
    # a server someone started without the flag, with small blocks so the mini prompts share whole ones
    cached = cmd.replace(" " + vllm_protocol.NO_PREFIX_CACHING_FLAG, "") + " --block-size 2"
    with StandinServer.from_command(cached, "kimi_k25") as server:
        out = run_capture(cfg, Dist())
    m = json.loads((out / "manifest.json").read_text())
    short = [sid for split in ("train", "validation") for sid in m["splits"][split]["this_run"]["short_files"]]
    assert short, "the prompts share no cached block: the test shows nothing"
    assert server.engine.requests == sum(len(HiddenStateStore(out / s)) for s in ("train", "validation")) + len(short)
    assert sorted(sid for split in ("train", "validation")
                  for sid in m["splits"][split]["skipped_ids"].get("short_states_file", [])) == sorted(short)
    ref = {s: HiddenStateStore(hf_store / s) for s in ("train", "validation")}
    for split in ("train", "validation"):  # what was stored is complete and the HF backend's own
        got = HiddenStateStore(out / split)
        mine = set(m["splits"][split]["this_run"]["short_files"])
        assert not set(got.ids) & mine and set(got.ids) | mine == set(ref[split].ids)  # each stored or skipped
        for i, sid in enumerate(got.ids):
            j = ref[split].ids.index(sid)
            assert got.lengths[i] == ref[split].lengths[j]
            assert torch.equal(got[i]["aux"], ref[split][j]["aux"])
    assert_no_connector_files(cfg)  # the short files were deleted too
