"""Server faults: regeneration through the prepare stage against an OpenAI-compatible server on
127.0.0.1 (data/openai_server.py serving the tiny K2.5 target) that fails 20% of requests at random
(5xx, 429, connection resets, hangs past the timeout, malformed / truncated JSON) and answers slowly.
Every conversation must come out exactly once, retries must be bounded, and the failures counted."""
import json
from pathlib import Path

import pytest

from data.openai_server import FaultPlan
from tests.fixtures.prepare import conv
from tests.fixtures.regenerate import regen_config, reset_server, served, write_corpus  # noqa: F401 (fixture)

CONVS = [conv(f"c{i:02d}", ("human", f"question number {i}?"), ("gpt", "old answer"),
              *((("human", "and then?"), ("gpt", "old")) if i % 3 == 0 else ())) for i in range(14)]
TURNS = sum(len(c["conversations"]) // 2 for c in CONVS)
FAULTS = {"500": 0.04, "503": 0.02, "429": 0.02, "reset": 0.04, "hang": 0.02, "malformed": 0.03, "truncated": 0.03}


def flaky_config(tmp_path, target, url, *extra):
    corpus = write_corpus(tmp_path / "c.jsonl", CONVS)
    return regen_config(tmp_path, target, corpus, "openai", f"regenerate.openai.base_url={url}",
                        "regenerate.openai.concurrency=2", "regenerate.openai.timeout_s=8.0",
                        "regenerate.openai.max_retries=6", "regenerate.openai.backoff_s=0.01",
                        "regenerate.openai.backoff_max_s=0.05", *extra)


@pytest.mark.parametrize("seed", [0, 1])
def test_twenty_percent_failures_and_slow_replies_lose_and_duplicate_nothing(tmp_path, tiny_k25_target, served, seed):
    from data.prepare import run_prepare
    from eagle3.formats.manifest import read_manifest

    assert abs(sum(FAULTS.values()) - 0.20) < 1e-9
    reset_server(served, FaultPlan(rates={**FAULTS, "slow": 0.10}, slow_s=0.05, hang_s=10.0, seed=seed))
    m = read_manifest(run_prepare(flaky_config(tmp_path, tiny_k25_target, served.url)), "prepare")
    actions = [a for _, a in served.request_log]
    faults = sum(a in FAULTS for a in actions)
    assert faults > 0 and actions.count("ok") + actions.count("slow") == TURNS    # each turn answered once
    regen = m["regenerate"]
    assert regen["generated"] + regen["failed"] == len(CONVS)
    assert m["counts"]["kept"] + m["counts"]["skipped"]["regen_failed"] == len(CONVS)
    assert regen["retries"] == faults                                   # every fault retried, nothing else
    ids = [json.loads(line)["id"] for line in open(regen["store"]) if '"id"' in line]
    assert sorted(ids) == sorted(c["id"] for c in CONVS)                 # none missing, none twice


def test_failures_are_counted_by_kind(tmp_path, tiny_k25_target, served):
    from data.prepare import run_prepare
    from eagle3.formats.manifest import read_manifest

    reset_server(served, FaultPlan(script=["500", "reset", "malformed", "429"]))
    m = read_manifest(run_prepare(flaky_config(tmp_path, tiny_k25_target, served.url)), "prepare")
    by_kind = m["regenerate"]["retries_by_kind"]
    assert sum(by_kind.values()) == m["regenerate"]["retries"] == 4 and len(by_kind) >= 3


KILL_CONVS = CONVS[:8]


@pytest.mark.parametrize("seed,kill_after_lines", [(5, 2)])  # one point: each case costs ~40 s
def test_killed_regeneration_resumes_without_duplicates_or_losses(tmp_path, tiny_k25_target, served, seed,
                                                                  kill_after_lines):
    """SIGKILL a real `data/run_prepare.py` regenerating against the flaky server once `kill_after_lines`
    conversations are stored, rerun the same command: the prepared dataset equals an uninterrupted run's."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import datasets
    from data.prepare import run_prepare
    from data.regenerate import settings_of, store_path
    from eagle3 import REPO_ROOT

    def overrides(root):
        return [f"paths.root={root}", f"target.path={tiny_k25_target}", f"target.tokenizer={tiny_k25_target}",
                f"input={write_corpus(tmp_path / 'c.jsonl', KILL_CONVS)}", "regenerate.backend=openai",
                "regenerate.max_new_tokens=6", "validation_fraction=0.0", f"regenerate.openai.base_url={served.url}",
                "regenerate.openai.concurrency=1", "regenerate.openai.timeout_s=8.0", "regenerate.openai.max_retries=6",
                "regenerate.openai.backoff_s=0.01", "regenerate.openai.backoff_max_s=0.05"]

    from eagle3.config.conf import compose, to_schema
    from eagle3.config.schema.prepare import PrepareConfig

    def config(root):
        return to_schema(compose("prepare", overrides(root)), PrepareConfig)

    def rows(out):
        ds = datasets.load_from_disk(str(out / "train"))
        return sorted(zip(ds["id"], map(list, ds["input_ids"]), map(list, ds["loss_mask"])))

    plan = dict(rates={"500": 0.1, "reset": 0.05, "malformed": 0.05, "slow": 0.3}, slow_s=0.05, seed=seed)
    reset_server(served, FaultPlan(**plan))
    ref = run_prepare(config(tmp_path / "ref"))
    cfg = config(tmp_path / "killed")
    store = store_path(cfg, settings_of(cfg))
    # the same faults, but slow replies stretched so the kill reliably lands mid-run (greedy: same answers)
    reset_server(served, FaultPlan(**{**plan, "rates": {**plan["rates"], "slow": 0.6}, "slow_s": 0.3}))
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "data" / "run_prepare.py"), *overrides(tmp_path / "killed")],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if store.is_file() and sum(1 for line in open(store) if '"id"' in line) >= kill_after_lines:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"prepare ended before the kill: {proc.stderr.read()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    stored = [json.loads(line)["id"] for line in open(store) if '"id"' in line]
    assert 0 < len(stored) < len(KILL_CONVS) and not (Path(cfg.out_dir) / "manifest.json").exists()
    out = run_prepare(cfg)                                        # the same command again
    m = json.loads((out / "manifest.json").read_text())
    assert m["regenerate"]["resumed"] >= len(stored) and m["counts"]["kept"] == len(KILL_CONVS)
    ids = [json.loads(line)["id"] for line in open(store) if '"id"' in line]
    assert sorted(ids) == sorted(c["id"] for c in KILL_CONVS)          # none lost, none twice
    assert rows(out) == rows(ref)                                  # greedy: the same dataset
