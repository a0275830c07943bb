"""Online training (issue 43): the producer (data/stream_capture.py, the real hf capture backend) fills a
capped spool (eagle3/formats/spool.py) while the train stage reads it (data.source=stream,
train/spool_source.py). The stream trains bit-identically to the offline store of the same sequences read in
the same windows; the disk stays under its cap plus one chunk; chunks go only after every rank's checkpointed
ack; restarts of either side and a silent producer behave as documented."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from data.capture import run_capture
from data.capture_setup import Dist
from data.stream_capture import run_stream_capture
from eagle3 import REPO_ROOT
from eagle3.config.watermarks import Watermarks
from eagle3.formats.spool import Spool, must_pause
from eagle3.formats.store import HiddenStateStore
from tests.fixtures.capture import capture_config, prepared, targets  # noqa: F401 (fixtures)
from tests.fixtures.train_world import config_for, world  # noqa: F401 (fixture)
from train.inputs import TrainInputError
from train.stage import run_train

WINDOW, REUSE, CHUNK = 6, 2, 3  # a window is two whole chunks


def stream_capture_config(tmp_path, targets, prepared, **stream):  # noqa: F811
    over = [f"stream.{k}={v}" for k, v in {"enabled": "true", "chunk_sequences": CHUNK, "poll_s": 0.05,
                                             **stream}.items()]
    return capture_config(tmp_path, targets, prepared, out="stream", overrides=["max_tokens_per_batch=1", *over])


def train_config(world, tmp_path, capture_dir, name, **extra):  # noqa: F811
    return config_for(world, tmp_path / name, "scratch", capture_dir=str(capture_dir), max_steps=1000, epochs="null",
                      **{"data.window_sequences": WINDOW, "data.reuse": REUSE, "data.stream_timeout_s": 60,
                         "checkpoint_every": 1000, **extra})


def final_weights(out):
    from safetensors.torch import load_file
    return load_file(str(Path(out) / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def offline(tmp_path_factory, targets, prepared):  # noqa: F811
    tmp = tmp_path_factory.mktemp("offline")
    return run_capture(capture_config(tmp, targets, prepared, out="offline", overrides=["max_tokens_per_batch=1"]),
                       Dist())


@pytest.fixture(scope="module")
def reference(tmp_path_factory, world, offline):  # noqa: F811
    """The offline store trained in the stream's windows: what every streamed run must reproduce bit for bit."""
    tmp = tmp_path_factory.mktemp("ref")
    return run_train(train_config(world, tmp, offline, "ref", **{"data.order": "windows"}))


def producer_argv(tmp_path, targets, prepared, **stream):  # noqa: F811
    """The real entry point (`make capture-hidden ARGS=...`) with the fixture's capture settings."""
    cfg = stream_capture_config(tmp_path, targets, prepared, **stream)
    over = [f"paths.root={tmp_path}", f"target.path={cfg.target.path}", f"target.tokenizer={cfg.target.tokenizer}",
            f"target.layout={cfg.target.layout}", f"in_dir={cfg.in_dir}", f"out_dir={cfg.out_dir}", "dtype=float32",
            "progress=false", "max_tokens_per_batch=1", "shard_tokens=200",
            *[f"stream.{k}={v}" for k, v in {"enabled": "true", "chunk_sequences": CHUNK, "poll_s": 0.05,
                                              **stream}.items()]]
    return [sys.executable, str(REPO_ROOT / "data" / "run_capture.py"), *over], Path(cfg.out_dir)


def start_producer(argv, log: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)


def wait_until(cond, timeout=120, what=""):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_watermarks_pause_above_high_and_resume_only_below_low():
    m = Watermarks.from_gb(1e-6, 0.9, 0.5)  # 1000 bytes
    assert (m.cap, m.high, m.low) == (1000, 900, 500)
    assert not must_pause(900, m, paused=False) and must_pause(901, m, paused=False)
    assert must_pause(600, m, paused=True) and not must_pause(500, m, paused=True)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory, targets, prepared):  # noqa: F811
    """A complete stream (a cap it never reaches): the producer run alone, before any consumer."""
    return run_stream_capture(stream_capture_config(tmp_path_factory.mktemp("streamed"), targets, prepared,
                                                    max_gb=1.0), Dist())


def test_stream_trains_bit_identically_to_the_offline_store_in_the_same_windows(tmp_path, world, streamed,  # noqa: F811
                                                                                 offline, reference, monkeypatch):
    """...and opens each chunk's store once (a window shuffles across two chunks; a reopened store would hash its
    shard again: on the GPU world that made the streamed trainer 4x slower than the store-fed one)."""
    import train.spool_source as spool_source
    spool = Spool(streamed)
    chunks = len(spool.chunks())
    assert chunks > 2 and spool.end()["tokens_captured"] == HiddenStateStore(offline / "train").num_tokens
    assert spool.end()["pauses"] == 0
    opened = []
    monkeypatch.setattr(spool_source, "HiddenStateStore", lambda d, **kw: opened.append(d) or HiddenStateStore(d, **kw))
    got = run_train(train_config(world, tmp_path, streamed.parent, "got", **{"data.source": "stream"}))
    assert len(opened) == len(set(opened)) == chunks
    a, b = final_weights(reference), final_weights(got)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    m = json.loads((got / "manifest.json").read_text())
    assert m["steps"] == json.loads((reference / "manifest.json").read_text())["steps"] > 0
    assert m["stream"]["stream_complete"] and m["stream"]["reuse_per_sequence"] == REUSE
    assert not list(streamed.glob("chunk-*"))  # every chunk freed once the run finished


def chunk_bytes(streamed) -> int:
    """The largest chunk of this world's stream (the log of the complete stream records each one)."""
    return max(e["bytes"] for e in Spool(streamed).chunks())


def test_a_capped_spool_pauses_the_producer_survives_its_kill_9_and_trains_the_same_bits(tmp_path, world, targets,  # noqa: F811
                                                                                       prepared, offline, reference,
                                                                                       streamed):
    store = HiddenStateStore(offline / "train")
    longest_chunk = chunk_bytes(streamed)
    # 5 of the largest chunk: the producer pauses after ~6 of 9; it resumes below 0.7 x 5 = 3.5 chunks, which
    # always holds what docs/online_training.md asks of the low watermark: the window being finished (two
    # chunks) and the first chunk of the next one, which the loader reads ahead before the window's checkpoint
    cap = 5 * longest_chunk
    argv, out = producer_argv(tmp_path, targets, prepared, max_gb=cap / 1e9, high=0.9, low=0.7)
    spool = Spool(out / "spool")
    first = start_producer(argv, tmp_path / "producer.log")
    try:
        wait_until(lambda: len(spool.chunks()) >= 2 and (spool.status() or {}).get("state") == "paused",
                   what="the producer to fill the spool and pause")  # backpressure: nobody is consuming yet
        assert spool.used_bytes() <= cap + longest_chunk
        first.send_signal(signal.SIGKILL)  # kill -9 at any moment: here, paused
        first.wait()
    finally:
        first.kill()
    published = len(spool.chunks())
    second = start_producer(argv, tmp_path / "producer.log")
    try:
        got = run_train(train_config(world, tmp_path, out, "got", **{"data.source": "stream"}))
        assert second.wait(timeout=300) == 0, (tmp_path / "producer.log").read_text()[-3000:]
    finally:
        second.kill()
    a, b = final_weights(reference), final_weights(got)
    assert all(torch.equal(a[k], b[k]) for k in a)  # killed, paused and resumed: the same bits
    log = (tmp_path / "producer.log").read_text()
    assert f"resuming after chunk {published - 1}" in log
    chunks = spool.chunks()
    assert [e["chunk"] for e in chunks] == list(range(len(chunks)))  # nothing captured twice, nothing lost
    assert sum(len(e["ids"]) for e in chunks) == len(store)
    end = spool.end()
    assert end["pauses"] > 0 and end["peak_bytes"] <= cap + longest_chunk, (end, cap)  # the cap, plus one in flight
    assert not list(spool.root.glob("chunk-*")) and not list(spool.root.glob(".tmp-*"))
    m = json.loads((got / "manifest.json").read_text())["stream"]
    assert m["peak_bytes"] == end["peak_bytes"] and m["tokens_captured"] == store.num_tokens


def test_a_trainer_killed_mid_stream_resumes_from_its_checkpoint_to_the_same_bits(tmp_path, world, targets,  # noqa: F811
                                                                                  prepared, reference):
    # (its own stream: the module's `streamed` one is consumed by the first test)
    from eagle3 import hooks

    spool = run_stream_capture(stream_capture_config(tmp_path, targets, prepared, max_gb=1.0), Dist())
    cfg = train_config(world, tmp_path, spool.parent, "got", **{"data.source": "stream"})

    def die(step):
        if step == 5:
            raise KeyboardInterrupt("killed")
    with hooks.installed(hooks.TRAIN_AFTER_STEP, die), pytest.raises(KeyboardInterrupt):
        run_train(cfg)
    # the windows finished before the kill were checkpointed and freed; the rest is still there
    acked = Spool(spool).acked(0)
    assert 0 < acked < len(Spool(spool).chunks())
    assert not any(Spool(spool).chunk_dir(i).exists() for i in range(acked))
    got = run_train(cfg)
    a, b = final_weights(reference), final_weights(got)
    assert all(torch.equal(a[k], b[k]) for k in a)


def spool_with_an_empty_plan(root: Path) -> Spool:
    """A spool whose producer has written its plan and nothing else (a trainer then waits on its status)."""
    spool = Spool(root)
    spool.root.mkdir(parents=True)
    (spool.root / "plan.json").write_text(json.dumps({"header": {"hidden_size": 1}, "dtype": "float32",
                                                      "aux_dtype": None, "sequences": [], "recapture": 1}))
    return spool


def test_a_silent_producer_is_named_after_the_timeout(tmp_path, world, targets, prepared):  # noqa: F811
    cfg = stream_capture_config(tmp_path, targets, prepared, max_gb=1.0)
    run_capture(__import__("dataclasses").replace(cfg, splits=["validation"]), Dist())  # the held-out split
    spool = spool_with_an_empty_plan(Path(cfg.out_dir) / "spool")
    spool.write_status(state="capturing", chunk=0)
    with pytest.raises(TrainInputError, match=rf"producer pid {os.getpid()} \(capturing.*died or hangs.*Restart it"):
        from train.spool_source import SpoolStore
        SpoolStore(spool.root, "size", timeout_s=0.5, status_s=0.1).window_lengths(0, 4)


def test_a_killed_producers_paused_status_is_not_taken_for_a_full_spool(tmp_path, monkeypatch):
    # kill -9 while paused leaves "paused" on disk; until the restart writes its own status, that is a silent
    # producer (named after the timeout), not a live pause the trainer can never outwait
    import train.spool_source as spool_source
    monkeypatch.setattr(spool_source, "PAUSED_DEADLOCK_S", 0.1)
    spool = spool_with_an_empty_plan(tmp_path / "spool")
    spool.write_status(state="paused", chunk=0, used_bytes=10, cap_bytes=10)
    with pytest.raises(TrainInputError, match=r"\(paused.*died or hangs.*Restart it"):
        spool_source.SpoolStore(spool.root, "size", timeout_s=1.0, status_s=0.1).window_lengths(0, 4)


def test_a_spool_too_small_for_one_window_is_an_error_not_a_hang(tmp_path, world, targets, prepared, streamed):  # noqa: F811
    # 3 of the largest chunk: the producer pauses after ~3 chunks, but a window of 12 sequences needs 4
    argv, out = producer_argv(tmp_path, targets, prepared, max_gb=3 * chunk_bytes(streamed) / 1e9, high=0.9, low=0.5)
    producer = start_producer(argv, tmp_path / "producer.log")
    try:
        with pytest.raises(TrainInputError, match=r"spool is full.*Raise the producer's stream.max_gb"):
            run_train(train_config(world, tmp_path, out, "got", **{"data.source": "stream",
                                                                   "data.window_sequences": 12}))
    finally:
        producer.kill()


def test_spool_log_is_the_done_marker_and_chunks_go_only_after_every_rank(tmp_path):
    spool = Spool(tmp_path / "s")
    spool.root.mkdir()
    for i in range(3):
        tmp = spool.new_tmp(i)
        tmp.mkdir()
        (tmp / "x").write_bytes(b"0" * 100)
        spool.publish(tmp, i, {"ids": [f"s{i}"], "bytes": 100})
    (spool.root / "log.jsonl").open("a").write('{"chunk": 3, "ids"')  # the producer died mid-append
    spool.new_tmp(4).mkdir()                                        # ... and mid-chunk
    assert [e["chunk"] for e in spool.chunks()] == [0, 1, 2]           # a torn line is not published
    (spool.root / "chunk-000003").mkdir()                              # renamed, never logged
    spool.recover()
    assert sorted(p.name for p in spool.root.iterdir() if p.is_dir()) == ["chunk-000000", "chunk-000001",
                                                                          "chunk-000002"]
    assert spool.used_bytes() == 300
    spool.ack(0, 2)
    assert spool.reclaim(world_size=2) == 0 and spool.chunk_dir(0).exists()  # rank 1 still needs them
    spool.ack(1, 1)
    spool.ack(1, 0)  # an ack never moves back
    assert spool.reclaim(world_size=2) == 1 and not spool.chunk_dir(0).exists() and spool.chunk_dir(1).exists()
    assert spool.acked(1) == 1 and spool.used_bytes() == 200


def test_a_full_disk_drops_the_unfinished_chunk_and_captures_it_again(tmp_path, targets, prepared, monkeypatch,  # noqa: F811
                                                                       streamed):
    import errno

    import data.stream_capture as sc

    real, calls = sc.open_writer, []

    def open_writer(store_dir, cfg, header, meta):
        w = real(store_dir, cfg, header, meta)
        calls.append(meta["chunk"])
        if calls.count(2) == 1 and meta["chunk"] == 2:  # the first try of chunk 2 meets a full disk
            finish = w.finish

            def full(**kw):
                finish(**kw)
                raise OSError(errno.ENOSPC, "No space left on device")
            w.finish = full
        return w
    monkeypatch.setattr(sc, "open_writer", open_writer)
    spool = Spool(run_stream_capture(stream_capture_config(tmp_path, targets, prepared, max_gb=1.0), Dist()))
    assert calls.count(2) == 2 and spool.end()["disk_full"] == 1
    assert [e["ids"] for e in spool.chunks()] == [e["ids"] for e in Spool(streamed).chunks()]  # nothing lost or twice
    assert not list(spool.root.glob(".tmp-*"))


def test_a_corrupt_chunk_is_refused_by_name(tmp_path, world, targets, prepared):  # noqa: F811
    spool = run_stream_capture(stream_capture_config(tmp_path, targets, prepared, max_gb=1.0), Dist())
    shard = sorted((spool / "chunk-000001").glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # same size, one bit pattern changed: only the sha256 sees it
    shard.write_bytes(bytes(data))
    with pytest.raises(TrainInputError, match=r"spool chunk 1: .*sha256 mismatch"):
        run_train(train_config(world, tmp_path, spool.parent, "got", **{"data.source": "stream"}))


def test_nan_samples_are_counted_skips_and_the_stream_batches_the_offline_stores_sequences(tmp_path, world, targets,  # noqa: F811
                                                                                     prepared):
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.fixtures.capture import load_split
    rows = load_split(prepared, "train")["input_ids"]
    counts = torch.bincount(torch.tensor([t for r in rows for t in set(r)]), minlength=512)
    rare = int(torch.nonzero((counts >= 1) & (counts <= 3))[0])
    poisoned = tmp_path / "poisoned"
    shutil.copytree(targets["k25"], poisoned)
    sd = load_file(poisoned / "model.safetensors")
    sd["language_model.model.embed_tokens.weight"][rare] = float("nan")
    save_file(sd, poisoned / "model.safetensors", metadata={"format": "pt"})
    bad = {**targets, "k25": poisoned}
    spool = Spool(run_stream_capture(stream_capture_config(tmp_path, bad, prepared, max_gb=1.0), Dist()))
    skipped = [s["id"] for e in spool.chunks() for s in e["skipped"]]
    assert skipped and all(s["reason"] == "non_finite" for e in spool.chunks() for s in e["skipped"])
    offline = run_capture(capture_config(tmp_path, bad, prepared, out="offline", overrides=["max_tokens_per_batch=1"]),
                          Dist())
    assert not set(skipped) & set(HiddenStateStore(offline / "train").ids)
    # the same windows over the same stored sequences: the stream's batches are the offline store's, id for id
    from train.setup import stream_conf
    from train.spool_source import SpoolStore, StoreWindows, make_stream
    cfg = train_config(world, tmp_path, spool.root.parent, "got", **{"data.source": "stream"})
    items = SpoolStore(spool.root, "sha256", 60, 30)
    view = StoreWindows(HiddenStateStore(offline / "train"), prepared / "train")

    def plan_ids(stream, source):
        return [[source[p]["id"] for p in batch] for _, batch in stream.iterate()]
    conf = stream_conf(cfg)
    assert plan_ids(make_stream(conf, items, 0, 1), items) == plan_ids(make_stream(conf, view, 0, 1), view)
    # and it trains to the end; the schedule was sized on the planned sequences, so it may end a step early
    got = run_train(cfg)
    m = json.loads((got / "manifest.json").read_text())
    planned = m["total_steps"]
    assert m["steps"] <= planned and (m["steps"] == planned) == (m["data_order"]["stream_ended_at_step"] is None)


@pytest.mark.slow
def test_two_ddp_processes_read_their_shares_of_the_stream_and_free_it_together(tmp_path, world, targets,  # noqa: F811
                                                                                prepared, offline):
    """gloo DDP over 2 CPU processes (as `accelerate launch`): each rank takes its share of every window, both
    ranks' acks are needed before a chunk goes, and the result is the offline store's in the same windows."""
    from tests.fixtures.train_world import overrides
    from tests.fixtures.ports import free_port

    spool = run_stream_capture(stream_capture_config(tmp_path, targets, prepared, max_gb=1.0), Dist())
    common = {"capture_dir": None, "max_steps": 1000, "epochs": "null", "data.window_sequences": WINDOW,
              "data.reuse": REUSE, "checkpoint_every": 1000}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = {}
    for name, capture_dir, extra in (("offline", offline, {"data.order": "windows"}),
                                     ("stream", spool.parent, {"data.source": "stream"})):
        outs[name] = tmp_path / f"train-{name}"
        args = overrides(world, outs[name], "scratch", **{**common, "capture_dir": str(capture_dir), **extra})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(REPO_ROOT / "train" / "run.py"), *args]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
        (tmp_path / f"{name}.log").write_text(res.stdout + res.stderr)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        assert "on 2 process(es)" in res.stdout
    s = Spool(spool)
    assert s.acked(0) == s.acked(1) == len(s.chunks()) and not list(spool.glob("chunk-*"))
    a, b = final_weights(outs["offline"]), final_weights(outs["stream"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_vllm_backend_streams_through_its_connector_into_the_same_chunks(tmp_path, targets, prepared,  # noqa: F811
                                                                            streamed, offline):
    """Producer backend=vllm (the stand-in speaking vLLM 0.34.0's protocol): chunks bit-equal to the hf
    backend's, every connector file deleted (a capped spool cannot afford a forgotten one)."""
    import re

    from data.capture_plan import CaptureError
    from tests.fixtures.vllm_capture import assert_no_connector_files
    from tests.standins.vllm_standin import StandinServer
    from tests.fixtures.ports import free_port

    over = ["backend=vllm", f"vllm.url=http://127.0.0.1:{free_port()}", "vllm.timeout_s=30", "vllm.lock_timeout_s=10"]
    cfg = capture_config(tmp_path, targets, prepared, out="stream", overrides=[
        "max_tokens_per_batch=1", *over, "stream.enabled=true", f"stream.chunk_sequences={CHUNK}", "stream.max_gb=1"])
    with pytest.raises(CaptureError, match="no vLLM server answers") as e:
        run_stream_capture(cfg, Dist())
    cmd = re.search(r"(vllm serve .*)$", str(e.value)).group(1)
    with StandinServer.from_command(cmd, "kimi_k25"):
        spool = Spool(run_stream_capture(cfg, Dist()))
    ref = Spool(streamed)
    assert [c["ids"] for c in spool.chunks()] == [c["ids"] for c in ref.chunks()]
    hf = HiddenStateStore(offline / "train")  # the hf backend's states of the same sequences, one forward each
    for c in spool.chunks():
        got = HiddenStateStore(spool.chunk_dir(c["chunk"]))
        assert got.meta["backend"] == "vllm" and got.ids == c["ids"]
        for i, sid in enumerate(got.ids):
            want = hf[hf.ids.index(sid)]
            assert all(torch.equal(got[i][k], want[k]) for k in ("aux", "last", "target_argmax", "input_ids"))
    assert_no_connector_files(cfg)


def test_the_stream_benchmark_measures_disk_and_waits_and_finds_the_same_bits(tmp_path, world, targets,  # noqa: F811
                                                                              prepared):
    from tests.fixtures.benchmarks import load_benchmark
    from tests.fixtures.train_world import overrides

    capture = [f"paths.root={tmp_path}", f"target.path={targets['k25']}", f"target.tokenizer={targets['k25']}",
               "target.layout=kimi_k25", f"in_dir={prepared}", "dtype=float32", "max_tokens_per_batch=1",
               "shard_tokens=200"]
    train = [o for o in overrides(world, tmp_path / "unused", "scratch", max_steps=1000, epochs="null",
                                  checkpoint_every=1000) if not o.startswith(("capture_dir=", "out_dir="))]
    out = load_benchmark("bench_stream").main(["--capture", *capture, "--train", *train, "--cap-fraction", "0.5",
                                               "--window", str(WINDOW), "--reuse", str(REUSE), "--chunk", str(CHUNK),
                                               "--work", str(tmp_path / "work")])
    assert out["bit_identical"] and out["peak_bytes"] < out["offline_store_bytes"]
    assert out["peak_over_cap"] <= 1.0 + 0.5 and out["tokens_captured"] > 0
    assert out["throughput_over_slower_side"] > 0 and out["slower_side"] in ("producer", "trainer")
    assert 0 <= out["producer_startup_s"] < out["offline_capture_s"]
    assert out["steady_throughput_over_slower_side"] > 0


def test_recapture_passes_the_target_over_the_prompts_again_and_reports_it(tmp_path, world, targets, prepared):  # noqa: F811
    spool = Spool(run_stream_capture(stream_capture_config(tmp_path, targets, prepared, max_gb=1.0, recapture=2),
                                     Dist()))
    chunks = spool.chunks()
    half = len(chunks) // 2
    assert [c["pass"] for c in chunks] == [0] * half + [1] * half
    assert [c["ids"] for c in chunks[:half]] == [c["ids"] for c in chunks[half:]]
    got = run_train(train_config(world, tmp_path, spool.root.parent, "got", **{"data.source": "stream",
                                                                                "data.reuse": 1}))
    m = json.loads((got / "manifest.json").read_text())["stream"]
    assert m["target_passes"] == 2 and m["tokens_captured"] == 2 * sum(c["tokens"] for c in chunks[:half])
    assert m["reuse_per_sequence"] == 1 and m["stream_complete"]


def local_producer_args(targets, prepared, **extra):  # noqa: F811
    args = [f"in_dir={prepared}", f"target.tokenizer={targets['k25']}", "dtype=float32", "max_tokens_per_batch=1",
            "shard_tokens=200", "progress=false", f"stream.chunk_sequences={CHUNK}", "stream.poll_s=0.05",
            "stream.max_gb=1.0", *[f"{k}={v}" for k, v in extra.items()]]
    return json.dumps(args)


def test_train_online_starts_its_own_producer_and_trains_the_same_bits(tmp_path, world, targets, prepared,  # noqa: F811
                                                                      reference):
    """data.producer=local (`make train-online`): the train stage starts data/run_capture.py stream.enabled=true
    itself, with its own target / paths and data.producer_args, and reads what it writes."""
    cap = tmp_path / "capture"
    got = run_train(train_config(world, tmp_path, cap, "got", **{
        "data.source": "stream", "data.producer": "local",
        "data.producer_args": local_producer_args(targets, prepared)}))
    a, b = final_weights(reference), final_weights(got)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert Spool(cap / "spool").end() is not None and (cap / "validation").is_dir()
    assert "[stream] done" in (got / "producer.log").read_text()
    # observability: each logged step carries the stream's figures (wandb: stream/*), the manifest the last ones
    logged = [r["stream"] for r in map(json.loads, (got / "metrics.jsonl").read_text().splitlines())
              if r.get("kind") == "train"]
    assert logged and all(0 <= f["trainer_idle"] <= 1 and f["spool_gb"] >= 0 for f in logged)
    assert any(f["capture_tok_s"] for f in logged)
    end = json.loads((got / "manifest.json").read_text())["stream"]
    assert end["train_tok_s"] > 0 and end["live_at_end"]["spool_gb"] == 0  # everything freed at the end


def test_live_figures_are_rates_and_shares_of_what_the_producer_reported():
    from train.spool_source import live_figures, live_postfix

    fig = live_figures({"elapsed_s": 10.0, "tokens_captured": 5000, "wait_s": 2.5, "cap_bytes": 4_000_000_000},
                       used_bytes=1_000_000_000, trainer_wait_s=1.0, trainer_elapsed_s=4.0)
    assert fig == {"capture_tok_s": 500.0, "producer_idle": 0.25, "spool_gb": 1.0, "spool_pct": 25.0,
                   "trainer_idle": 0.25}
    assert live_postfix(fig) == {"cap": "500tok/s", "spool": "1.00GB(25%)", "idle": "25%/25%"}
    empty = live_figures({}, used_bytes=0, trainer_wait_s=0.0, trainer_elapsed_s=0.0)  # before the producer spoke
    assert empty["capture_tok_s"] is None and empty["spool_pct"] is None and live_postfix(empty)["idle"] == "-/-"


def test_a_local_producer_that_fails_stops_the_trainer_naming_it(tmp_path, world, targets, prepared):  # noqa: F811
    with pytest.raises(TrainInputError, match="exited with code"):
        run_train(train_config(world, tmp_path, tmp_path / "capture", "got", **{
            "data.source": "stream", "data.producer": "local",
            "data.producer_args": local_producer_args(targets, prepared, in_dir=tmp_path / "no-such-prepare")}))


def test_a_kept_first_pass_chunk_goes_only_after_its_last_use_is_acknowledged(tmp_path):
    spool = Spool(tmp_path / "s")
    spool.root.mkdir()
    for i, extra in enumerate([{"keep": True, "last_use": 2}, {}]):  # pass 0: chunk 0 kept for position 2
        tmp = spool.new_tmp(i)
        tmp.mkdir()
        (tmp / "x").write_bytes(b"0" * 100)
        spool.publish(tmp, i, {"ids": [f"s{i}"], "bytes": 100, **extra})
    spool.publish_ref(2, {"ref": 0, "ids": ["s0"], "bytes": 0})  # pass 1 of chunk 0: no directory of its own
    assert not spool.chunk_dir(2).exists() and spool.used_bytes() == 200
    spool.ack(0, 2)  # positions 0 and 1 trained: chunk 1 goes, chunk 0 is still to be read at position 2
    assert spool.reclaim(world_size=1) == 1 and spool.chunk_dir(0).is_dir() and not spool.chunk_dir(1).exists()
    spool.ack(0, 3)
    assert spool.reclaim(world_size=1) == 1 and spool.used_bytes() == 0


def test_cache_first_pass_serves_later_passes_from_kept_chunks_with_the_same_bits(tmp_path, world, targets,  # noqa: F811
                                                                                  prepared):
    """stream.cache_first_pass_gb with recapture=2: the first pass's chunks that fit the budget are kept and
    read again for the second pass instead of running the target; the rest is captured again. The drafter
    trains the same bits as on a stream that captured both passes, the target runs on fewer tokens, and every
    chunk (kept ones included) is freed by the end."""
    both = run_stream_capture(stream_capture_config(tmp_path / "both", targets, prepared, max_gb=1.0, recapture=2),
                              Dist())
    sizes = [e["bytes"] for e in Spool(both).chunks() if e["pass"] == 0]  # capture is deterministic: the same
    budget = (sizes[0] + sizes[1] + min(sizes[2:]) - 1) / 1e9  # room for the first two chunks and no other
    cached = run_stream_capture(stream_capture_config(tmp_path / "cached", targets, prepared, max_gb=1.0,
                                                      recapture=2, cache_first_pass_gb=budget), Dist())
    full, log = Spool(both).chunks(), Spool(cached).chunks()
    half = len(log) // 2
    kept = [e["chunk"] for e in log[:half] if e.get("keep")]
    assert kept == [0, 1] and all(log[c]["last_use"] == half + c for c in kept)
    assert [e.get("ref") for e in log[half:]] == [0, 1] + [None] * (half - 2)
    assert not Spool(cached).chunk_dir(half).exists() and Spool(cached).chunk_dir(half + 2).is_dir()
    assert [e["ids"] for e in log] == [e["ids"] for e in full]
    end = Spool(cached).end()
    assert end["tokens_from_cache"] == log[0]["tokens"] + log[1]["tokens"]
    assert end["tokens_captured"] + end["tokens_from_cache"] == Spool(both).end()["tokens_captured"]
    runs = {name: run_train(train_config(world, tmp_path, spool.parent, name, **{"data.source": "stream",
                                                                               "data.reuse": 1}))
            for name, spool in (("both", both), ("cached", cached))}
    a, b = final_weights(runs["both"]), final_weights(runs["cached"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    m = json.loads((runs["cached"] / "manifest.json").read_text())["stream"]
    assert m["chunks_kept"] == 2 and m["tokens_from_cache"] == end["tokens_from_cache"] and m["target_passes"] == 2
    assert not list(cached.glob("chunk-*"))  # the kept chunks too, once their last use was acknowledged


@pytest.mark.parametrize("over, match", [({"recapture": 1, "cache_first_pass_gb": 0.5}, "there is none"),
                                         ({"recapture": 2, "cache_first_pass_gb": 0.8}, "no room below the low")])
def test_cache_first_pass_settings_that_cannot_work_are_refused(over, match):
    from eagle3.config.conf import ConfigError
    from eagle3.config.schema.capture import StreamConf
    with pytest.raises(ConfigError, match=match):
        StreamConf(enabled=True, max_gb=1.0, low=0.7, **over).validate()
