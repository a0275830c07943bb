"""The bench-serve stage (eval/bench_serve.py) against stand-in servers (tests/standins/serve_standin.py)
on the tiny Kimi-K2.5-layout target: a baseline and two speculative SGLang servers whose replies come from
the real draft/verify loop with a drafter fitted to the target, and an injected cost split. The stage
recovers the split, its served accept length equals the replay's on the same generations, the preset it
writes is taken by eval and study, a rerun resumes; bad input is refused with the line that fixes it."""
import json

import pytest
import torch

from data.openai_server import FaultPlan
from eagle3.engines.serve_launch import SpecKnobs
from eagle3.config.conf import compose, to_schema
from eagle3.drafter.drafter_io import save_drafter_dir
from eagle3.real_loop.chain import greedy_decode
from eagle3.real_loop.check import capture_sequence
from eagle3.config.schema.bench_serve import BenchServeConfig, ServerConf
from eagle3.formats.store import HiddenStateWriter
from eagle3.target_model.target_io import load_target
from eval.bench_serve import run_bench_serve
from eval.serve_measure import BenchServeError
from tests.fixtures.real_loop import AUX_H, fitted_drafter, prompts
from tests.fixtures.tiny import TINY_TARGET_HIDDEN
from tests.standins.serve_standin import InjectedCosts, ModelSide, StandinServer

COSTS = InjectedCosts(verify_ms=30.0, per_token_ms=10.0, draft_step_ms=20.0, prefill_ms=5.0)
MAX_NEW = 20


@pytest.fixture(scope="module")
def world(tiny_k25_target, tmp_path_factory):
    """A validation store of prompt + greedy continuation, and a drafter fitted to those continuations."""
    root = tmp_path_factory.mktemp("bench_serve")
    target, _ = load_target(tiny_k25_target, "kimi_k25", dtype="float32")
    ps = prompts(3, L=6, seed=3)
    seqs = [(torch.cat([p, torch.tensor(greedy_decode(target, p, MAX_NEW).tokens)]), p.numel()) for p in ps]
    drafter = fitted_drafter(tiny_k25_target, target, seqs, steps=40)
    w = HiddenStateWriter(root / "capture" / "validation", hidden_size=TINY_TARGET_HIDDEN,
                          target_hidden_size=TINY_TARGET_HIDDEN, hf_indices=AUX_H, dtype="float32", shard_tokens=64)
    for n, (ids, plen) in enumerate(seqs):
        aux, argmax = capture_sequence(target, ids, AUX_H)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[plen:] = True
        w.add(f"v{n}", ids, mask, aux, torch.zeros(ids.numel(), TINY_TARGET_HIDDEN), argmax)
    w.finish()
    drafter_dir = save_drafter_dir(drafter, root / "drafter", dtype="float32")
    return {"root": root, "target": target, "drafter": drafter, "drafter_dir": drafter_dir,
            "target_path": tiny_k25_target}


def config(world, baseline: ServerConf, servers: list, *extra, only=()) -> BenchServeConfig:
    cfg = compose("bench_serve", [f"paths.root={world['root']}", f"target.path={world['target_path']}",
                                  f"drafter_dir={world['drafter_dir']}", f"capture_dir={world['root']}/capture",
                                  "name=tiny", "wandb.mode=disabled", "progress=false", "request.num_prompts=3",
                                  f"request.max_new_tokens={MAX_NEW}", "knob_grid.num_steps=[1,2,3]",
                                  "knob_grid.topk=[1]", "request.backoff_s=0", *extra])
    typed = to_schema(cfg, BenchServeConfig)
    typed.baseline, typed.servers, typed.only = baseline, servers, list(only)
    typed.validate()
    return typed


def spec(world, steps, topk, tokens, version, engine="sglang", costs=COSTS):
    side = ModelSide(world["target"], world["drafter"], SpecKnobs(steps, topk, tokens), costs=costs)
    return StandinServer(engine, side, version=version, drafter_path=str(world["drafter_dir"]))


def server_conf(name, srv, speculative=False, knobs=(2, 1, 3), engine="sglang"):
    s, k, n = knobs
    return ServerConf(name=name, url=srv.url, engine=engine, speculative=speculative, num_steps=s, topk=k,
                      num_draft_tokens=n)


def assert_served_equals_replay(c: dict) -> None:
    """The server's generations are the target's greedy tokens, so the replay sees every cycle the server ran.
    On a CPU where a float tie between the cached decode and the full forward goes the other way at one
    position (as tests/test_eval_stage.py allows), the replay stops there: then close, not equal."""
    if c["replay_mismatches"] == 0:
        assert c["served_verify_steps"] == c["replay_cycles"]
        assert c["served_pooled"] == pytest.approx(c["replay_pooled"], abs=1e-9) and not c["finding"]
        if c["served_by_position"] is not None:  # one rule (accepted / drafts) on both sides, last cycles too
            assert c["served_by_position"] == pytest.approx(c["replay_by_position"], abs=1e-9)
    else:
        assert c["replay_mismatches"] <= 1 and abs(c["gap"]) < 0.2


def test_bench_serve_recovers_the_cost_split_and_matches_the_replay(world, capsys):
    base = StandinServer("sglang", ModelSide(world["target"], costs=COSTS), version="0.5.23")
    s213, s313 = spec(world, 2, 1, 3, "0.5.8"), spec(world, 3, 1, 3, "0.5.12")
    with base, s213, s313:
        cfg = config(world, server_conf("baseline", base),
                     [server_conf("s213", s213, True, (2, 1, 3)), server_conf("s313", s313, True, (3, 1, 3))])
        out = run_bench_serve(cfg)
        printed = capsys.readouterr().out
        report = json.loads((out / "report.json").read_text())
        assert report["status"] == "complete"
        # the injected split, recovered within 10%
        fit, lat = report["cost_fit"], report["latencies"]
        assert fit["verify_ms"] == pytest.approx(COSTS.verify_ms, rel=0.10)
        assert fit["verify_ms_per_token"] == pytest.approx(COSTS.per_token_ms, rel=0.10)
        assert fit["draft_step_ms"] == pytest.approx(COSTS.draft_step_ms, rel=0.10)
        assert lat["baseline_token_ms"] == pytest.approx(COSTS.cycle_ms(1, 0), rel=0.10)
        # served accept length = the replay's on the same generations, with real speculation behind it
        for name in ("s213", "s313"):
            c = report["compare"][name]
            assert_served_equals_replay(c)
            assert c["served_pooled"] > 1.3
            acc = report["servers"][name]["accept_length"]
            assert acc["engine_pooled"] > acc["decode_pooled"]  # SGLang's own figure counts the prefill token
            assert acc["server_avg_cumulative"] == pytest.approx(acc["engine_pooled"])  # /get_server_info
        assert "spec_accept_token_num" in report["servers"]["s213"]["accept_length"]["naming"]
        assert "spec_num_correct_drafts" in report["servers"]["s313"]["accept_length"]["naming"]
        assert report["compare"]["s313"]["served_by_position"] is not None  # 0.5.12 has the histogram
        verdicts = {c["cause"]: c["verdict"] for c in report["causes"]}
        assert verdicts["aux_layers (s213)"] == "ok" and verdicts["temperature"] == "ok"
        assert report["knob_search"]["best"]["label"] in report["knob_search"]["table"]
        assert ("Serve with" in printed or "serve WITHOUT speculation" in printed) and "Cost split (fitted" in printed and "tau pooled" in printed
        for name in report["plots"].values():
            assert (out / name).read_bytes()[:4] == b"\x89PNG"
        # the preset is what eval and study take
        preset = report["cost_preset"]
        from eval.report import latencies_from_config
        from eagle3.config.schema.eval import EvalConfig
        from eagle3.config.schema.study import StudyConfig

        ev = to_schema(compose("eval", [f"paths.root={world['root']}", f"cost.preset={preset}"]), EvalConfig)
        assert latencies_from_config(ev.cost).draft_step_ms == pytest.approx(fit["draft_step_ms"])
        st = to_schema(compose("study", [f"paths.root={world['root']}", f"cost.preset={preset}"]), StudyConfig)
        lat = latencies_from_config(st.cost)  # the measured preset replaces the study's assumed split whole
        assert lat.verify_ms == pytest.approx(fit["verify_ms"]) and lat.draft_step_ms == pytest.approx(fit["draft_step_ms"])
        assert lat.verify_ms_per_token == pytest.approx(fit["verify_ms_per_token"])
        # a rerun keeps the finished requests: nothing is sent again
        sent = (base.requests, s213.requests, s313.requests)
        run_bench_serve(cfg)
        assert (base.requests, s213.requests, s313.requests) == sent


def test_unreachable_server_gets_its_launch_line(world, capsys):
    base = StandinServer("sglang", ModelSide(world["target"], costs=COSTS))
    dead = ServerConf(name="s213", url="http://127.0.0.1:9", speculative=True, num_steps=2, topk=1, num_draft_tokens=3)
    with base:
        with pytest.raises(BenchServeError, match="1 of 2 servers to measure unreachable"):
            run_bench_serve(config(world, server_conf("baseline", base), [dead]))
    lines = [line for line in capsys.readouterr().out.splitlines() if "unreachable" in line]
    assert len(lines) == 1 and "sglang.launch_server" in lines[0] and "--speculative-num-steps 2" in lines[0] \
        and "--port 9" in lines[0] and str(world["drafter_dir"]) in lines[0]


def test_speculation_not_as_configured_is_refused(world):
    plain = StandinServer("sglang", ModelSide(world["target"], costs=COSTS))
    other = spec(world, 3, 1, 4, "0.5.23")
    with plain, other:
        with pytest.raises(BenchServeError, match="expected EAGLE3 2/1/3.*speculative_algorithm=None"):
            run_bench_serve(config(world, server_conf("baseline", plain), [server_conf("s", plain, True)]))
        with pytest.raises(BenchServeError, match="expected no speculation.*'EAGLE3'"):
            run_bench_serve(config(world, server_conf("baseline", other), [server_conf("s", other, True, (3, 1, 4))]))
        with pytest.raises(BenchServeError, match="configured as 2/1/3 but it serves 3/1/4"):
            run_bench_serve(config(world, server_conf("baseline", plain), [server_conf("s", other, True)]))


def test_vllm_counters_failures_and_partial_runs(world, tmp_path):
    """vLLM: per-request counts from /metrics before/after; a request failing past its retries leaves the
    run partial with the timeouts and retries counted; a vLLM baseline with spec counters is refused."""
    quick = InjectedCosts(1.0, 0.5, 0.5, 0.5)
    base = StandinServer("vllm", ModelSide(world["target"], costs=quick), faults=FaultPlan(script=["500", "500", "hang"], hang_s=5.0))
    v2 = spec(world, 2, 1, 3, None, engine="vllm", costs=quick)
    with base, v2:
        cfg = config(world, server_conf("baseline", base, engine="vllm"),
                     [server_conf("v2", v2, True, (2, 1, 3), engine="vllm")], "request.retries=1", "request.timeout_s=1",
                     f"out_dir={tmp_path}/out", "compare.enabled=false")
        report = json.loads((run_bench_serve(cfg) / "report.json").read_text())
        b, v = report["servers"]["baseline"], report["servers"]["v2"]
        assert report["status"].startswith("PARTIAL") and b["partial"] and b["requests_ok"] == 2
        # prompt 0: two 500s (failed); prompt 1: a timeout, then answered; prompt 2: answered
        assert b["failed_requests"] == 1 and b["retries"] == 2 and b["attempts"] == 5 and b["timeouts"] == 1
        acc = v["accept_length"]
        assert acc["drafts_pooled"] >= 1.0 and "vllm:spec_decode_num_drafts_total" in acc["naming"]
        assert len(v["acceptance_by_position"]) == 2
        # the rerun measures only the missing request and the run is complete
        report = json.loads((run_bench_serve(cfg) / "report.json").read_text())
        assert report["status"] == "complete" and report["servers"]["baseline"]["requests_ok"] == 3
        with pytest.raises(BenchServeError, match="expected no speculation, but /metrics has spec-decode counters"):
            run_bench_serve(config(world, server_conf("baseline", v2, engine="vllm"),
                                   [server_conf("v2", v2, True, (2, 1, 3), engine="vllm")]))


def test_one_server_at_a_time(world, tmp_path):
    """One GPU machine serves one setting at a time: measure with only=[...], then the other; a server whose
    requests are all done need not be up."""
    quick = InjectedCosts(1.0, 0.5, 0.5, 0.5)
    base = StandinServer("sglang", ModelSide(world["target"], costs=quick)).start()
    v = spec(world, 2, 1, 3, "0.5.23", costs=quick)
    servers = [server_conf("baseline", base), server_conf("s213", v, True)]
    cfg = config(world, servers[0], servers[1:], f"out_dir={tmp_path}/out", only=["baseline"])
    report = json.loads((run_bench_serve(cfg) / "report.json").read_text())
    base.stop()
    assert report["status"].startswith("PARTIAL (s213") and any("not measured in this run" in w
                                                                  for w in report["warnings"])
    with v:
        cfg = config(world, servers[0], servers[1:], f"out_dir={tmp_path}/out", only=["s213"])
        report = json.loads((run_bench_serve(cfg) / "report.json").read_text())
    assert report["status"] == "complete" and report["servers"]["baseline"]["requests_ok"] == 3
    assert_served_equals_replay(report["compare"]["s213"])
