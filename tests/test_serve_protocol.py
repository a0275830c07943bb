"""The accept-length fields and counters of each engine and version (eagle3/engines/serve_protocol.py, read from
the SGLang 0.5.2-0.5.23 and vLLM 0.34.0 wheels), the cost split fit (eagle3/replay/cost_fit.py) and the measured
cost preset (eagle3/engines/serve_costs.py) on hand-checked cases."""
import json
import os

import pytest

from eagle3.engines import serve_protocol as sp
from eagle3.engines import vllm_protocol
from eagle3.replay.cost_fit import CostFitError, CyclePoint, fit_cycle_costs
from eagle3.engines.serve_costs import Latencies, PresetError, preset_file_body, resolve_preset

COUNTS = dict(verify_ct=10, completion_tokens=25, correct_drafts=14, num_steps=3, num_draft_tokens=4,
              histogram=[2, 3, 4, 1])

# version -> (accepted/proposed pair it names first, histogram name or None, has spec_accept_length)
SGLANG = {
    "0.5.2": (None, None, False), "0.5.3": (None, None, False),
    "0.5.4": (None, None, True), "0.5.5": (None, None, True),
    "0.5.6": (("spec_accept_token_num", "spec_draft_token_num"), None, True),
    "0.5.8": (("spec_accept_token_num", "spec_draft_token_num"), None, True),
    "0.5.9": (("spec_accept_token_num", "spec_draft_token_num"), "spec_accept_histogram", True),
    "0.5.10": (("spec_accept_token_num", "spec_draft_token_num"), "spec_accept_histogram", True),
    "0.5.11": (("spec_accepted_drafts", "spec_proposed_drafts"), "spec_accept_histogram", True),
    "0.5.12": (("spec_num_correct_drafts", "spec_num_proposed_drafts"), "spec_correct_drafts_histogram", True),
    "0.5.20": (("spec_num_correct_drafts", "spec_num_proposed_drafts"), "spec_correct_drafts_histogram", True),
    "0.5.21": (("spec_num_correct_drafts", "spec_num_proposed_drafts"), "spec_correct_drafts_histogram", True),
    "0.5.23": (("spec_num_correct_drafts", "spec_num_proposed_drafts"), "spec_correct_drafts_histogram", True),
}


@pytest.mark.parametrize("version", sorted(SGLANG, key=sp.version_tuple))
def test_sglang_meta_info_names_per_version(version):
    pair, hist, has_length = SGLANG[version]
    meta = {"completion_tokens": 25, **sp.sglang_spec_meta(version, **COUNTS)}
    assert meta["spec_verify_ct"] == 10
    assert ("spec_accept_length" in meta) == has_length
    if has_length:
        assert meta["spec_accept_length"] == 2.5  # completion / verify: the prefill's token counted
    aliases = {"0.5.12", "0.5.20"}
    assert ("spec_accepted_drafts" in meta) == (version in aliases | {"0.5.11"})
    assert ("spec_accept_histogram" in meta) == (hist is not None and version not in {"0.5.21", "0.5.23"})
    c = sp.read_sglang_meta(meta)
    assert c.verify_steps == 10 and c.decode_tokens_per_verify == 2.4
    if pair is None:
        assert c.accepted is None and c.drafts_accept_length != c.drafts_accept_length  # NaN: not reported
    else:
        assert c.naming.split(", ")[1] == "/".join(pair) and c.accepted == 14 and c.proposed == 30
        assert c.drafts_accept_length == pytest.approx(2.4)
    if hist is None:
        assert c.per_position is None
    else:
        assert hist in c.naming and c.per_position == [8, 5, 1]  # steps accepting > j drafts


def test_sglang_old_accept_rate_divides_by_num_steps():
    assert sp.sglang_spec_meta("0.5.4", **COUNTS)["spec_accept_rate"] == pytest.approx(14 / 30)   # 10 * 3 steps
    assert sp.sglang_spec_meta("0.5.6", **{**COUNTS, "num_steps": 5})["spec_accept_rate"] == pytest.approx(14 / 30)
    with pytest.raises(ValueError, match="older than any version read"):
        sp.sglang_meta_fields("0.4.9")


def test_sglang_server_info_and_aux_rule():
    info = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 2, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 3, "speculative_draft_model_path": "/d", "version": "0.5.23",
            "internal_states": [{"memory_usage": {}}, {"avg_spec_accept_length": 2.1}]}
    s = sp.server_info_speculation(info)
    assert s["algorithm"] == "EAGLE3" and s["knobs"] == [2, 1, 3] and s["avg_spec_accept_length"] == 2.1
    assert sp.server_info_speculation({"speculative_algorithm": None})["algorithm"] is None
    assert sp.sglang_aux_rule("0.5.12") == "sglang_legacy" and sp.sglang_aux_rule("0.5.13.post1") == "sglang"
    assert sp.sglang_aux_rule(None) is None


def test_vllm_counters_read_and_differenced():
    before = sp.read_vllm_counters(sp.vllm_metrics_text("m", 4, 12, 5, [3, 2, 0]))
    text = sp.vllm_metrics_text("m", 14, 42, 20, [9, 7, 4])
    assert "vllm:spec_decode_num_drafts_total{engine=\"0\",model_name=\"m\"} 14.0" in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 4.0' in text
    after = sp.read_vllm_counters(text)
    c = after.minus(before).counts(completion_tokens=26)
    assert (c.verify_steps, c.proposed, c.accepted, c.per_position) == (10, 30, 15, [6, 5, 4])
    assert c.drafts_accept_length == 2.5  # 1 + accepted / drafts, vLLM's mean acceptance length
    assert not sp.read_vllm_counters("vllm:num_requests_running{engine=\"0\"} 0.0\n").present


def test_pooled_vs_per_request_mean_differ_and_are_labelled():
    a = sp.SpecCounts(verify_steps=10, completion_tokens=31)  # 3.0 decode tokens per verify
    b = sp.SpecCounts(verify_steps=40, completion_tokens=41)  # 1.0
    p = sp.pooled([a, b])
    assert p.decode_tokens_per_verify == pytest.approx(70 / 50) and p.requests == 2
    assert sp.mean_finite([a.decode_tokens_per_verify, b.decode_tokens_per_verify]) == 2.0


def test_cost_fit_recovers_a_split_and_names_what_it_cannot_separate():
    true = lambda n, s: 25.0 + 1.5 * n + 3.0 * s  # noqa: E731
    pts = [CyclePoint(1, 0, true(1, 0) + e, "base") for e in (0.2, -0.2)] + \
          [CyclePoint(3, 2, true(3, 2) + e, "2/1/3") for e in (0.1, -0.1)] + [CyclePoint(3, 3, true(3, 3), "3/1/3")]
    fit = fit_cycle_costs(pts)
    assert (fit.verify_ms, fit.verify_ms_per_token, fit.draft_step_ms) == pytest.approx((25.0, 1.5, 3.0), abs=1e-6)
    assert fit.rms_ms > 0 and fit.by_label["base"]["residual_ms"] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(CostFitError, match="one line.*num_draft_tokens != num_steps \\+ 1"):
        fit_cycle_costs([CyclePoint(1, 0, 26.5), CyclePoint(3, 2, 35.5), CyclePoint(4, 3, 40.0)])
    with pytest.raises(CostFitError, match="three are needed"):
        fit_cycle_costs([CyclePoint(1, 0, 26.5), CyclePoint(3, 2, 35.5)])
    # a split whose free fit wants a negative per-token cost holds it at 0
    fit = fit_cycle_costs([CyclePoint(1, 0, 30.0), CyclePoint(3, 2, 31.0), CyclePoint(3, 3, 33.0)])
    assert fit.clamped == ["verify_ms_per_token"] and fit.verify_ms_per_token == 0.0 and fit.draft_step_ms > 0


def test_measured_preset_file(tmp_path):
    lat = Latencies(baseline_token_ms=12.0, verify_ms=20.0, verify_ms_per_token=1.0, draft_step_ms=2.0, source="x")
    path = tmp_path / "cost_preset.json"
    path.write_text(json.dumps(preset_file_body(lat, fit={})))
    assert resolve_preset(f"measured:{path}") == lat
    assert resolve_preset("account_8gpu_pcie").verify_ms == 30.0 and resolve_preset(None) is None
    with pytest.raises(PresetError, match="does not exist .*make bench-serve"):
        resolve_preset(f"measured:{tmp_path}/none.json")
    (tmp_path / "bad.json").write_text(json.dumps({"latencies": {}}))
    with pytest.raises(PresetError, match="not a eagle3-cost-preset/1 file"):
        resolve_preset(f"measured:{tmp_path}/bad.json")
    with pytest.raises(PresetError, match="expected one of"):
        resolve_preset("fast_server")


@pytest.mark.parametrize("version,expected", [
    ("0.5.23", {}), ("0.5.12", {}), ("0.5.6", {}),      # every spec key inside `if spec_verify_ct > 0`
    ("0.5.4", {"spec_verify_ct": 0, "spec_accept_rate": 0.0, "spec_accept_length": 0}),
    ("0.5.2", {"spec_verify_ct": 0}),
])
def test_standin_meta_before_any_verify_step_is_what_that_sglang_writes(version, expected):
    # a one-token reply (EOS at prefill): no cycle was verified
    from eagle3.engines.serve_launch import SpecKnobs
    from tests.standins.serve_standin import Decoded, ModelSide, StandinServer
    server = StandinServer("sglang", ModelSide(None, drafter=object(), knobs=SpecKnobs(2, 1, 3)), version=version)
    try:
        meta = server.record(Decoded(tokens=[7], cycles=[], accepted=[], real_ms=[]))
    finally:
        server.httpd.server_close()
    assert meta == expected
    assert sp.read_sglang_meta({"completion_tokens": 1, **meta}) is None or meta[sp.VERIFY_CT] == 0


def test_lock_timeout_message_keeps_fractional_seconds(tmp_path):
    path = tmp_path / "f.safetensors"
    path.write_bytes(b"")
    fd = vllm_protocol.lock_for_write(path)
    try:
        with pytest.raises(vllm_protocol.ConnectorFileError, match=r"after 0\.2s"):
            vllm_protocol.read_states_file(path, [1, 2], 4, 8, lock_timeout_s=0.2)
    finally:
        os.close(fd)
