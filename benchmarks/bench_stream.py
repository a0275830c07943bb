"""Online training's disk and waits: the same prepared data captured offline (the store's bytes) and
streamed through a capped spool while the drafter trains (data/stream_capture.py + data.source=stream),
in one command on one machine. Three runs: the producer alone (an offline capture, its own process), the
trainer alone (fed by that store, in the stream's windows) and the two together (the streamed run). Reports
the offline store's bytes, the spool's cap and measured high-water mark (ratios to the store), the
producer's and the trainer's waits, the three wall times, the end-to-end throughput as a ratio to the slower
side alone (1.0 = the two sides overlap perfectly), the same ratio without the producer's one-time start-up
(`steady_throughput_over_slower_side`: what an hours-long run sees; the start-up is measured on the producer's
offline run as its wall less its capture loops), and whether the streamed drafter is bit-identical to the
offline one trained in the same windows. `--warm-trainer` trains the store once before the timed trainer-alone
run, so that one-time costs (CUDA context, torch.compile) are paid by neither timed trainer.
`bit_identical` compares two captures: the stream's chunks batch differently from the whole split's, so the
target's float sums (and then the drafters) differ in the last bits unless both capture one sequence per batch
(`--capture ... max_tokens_per_batch=1`; BENCHMARKS.md, "Online training on the CPU world").

  python benchmarks/bench_stream.py --capture conf-overrides... --train conf-overrides... --cap-fraction 0.25
  e.g. on the mini world (after `make mini-world prepare vocab`):
  python benchmarks/bench_stream.py --cap-fraction 0.25 --capture target=k25_mini --train +init=scratch max_steps=200

The producer runs as its own process (`data/run_capture.py stream.enabled=true ...`, as a user runs it); the
trainer in this one. Both read their stage configs with the overrides given (paths.root, target, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from eagle3 import REPO_ROOT


def run(capture_over: list[str], train_over: list[str], cap_fraction: float, window: int, reuse: int,
        chunk: int, work: Path, warm_trainer: bool = False) -> dict:
    from safetensors.torch import load_file

    from eagle3.config.conf import compose, to_schema
    from eagle3.config.schema.train import TrainConfig
    from eagle3.formats.spool import Spool, dir_bytes
    from train.stage import run_train

    offline_dir, stream_dir = work / "capture-offline", work / "capture-stream"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    capture = [sys.executable, str(REPO_ROOT / "data" / "run_capture.py"), *capture_over, "progress=false"]
    t0 = time.time()  # the producer alone: the same process a user starts, writing the offline store
    with open(work / "capture-offline.log", "w") as log:
        if subprocess.run([*capture, f"out_dir={offline_dir}"], cwd=REPO_ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"offline capture failed; see {work / 'capture-offline.log'}")
    offline_capture_s = time.time() - t0
    store_bytes = dir_bytes(offline_dir / "train")
    cap_gb = store_bytes * cap_fraction / 1e9
    common = [*train_over, f"data.window_sequences={window}", "progress=false"]

    def train_offline(name: str, passes: int) -> Path:
        return run_train(to_schema(compose("train", [*common, f"data.reuse={passes}", f"capture_dir={offline_dir}",
                                                     f"out_dir={work / name}", "data.order=windows"]), TrainConfig))
    if warm_trainer:  # one pass pays the one-time costs (every batch shape is met in it)
        train_offline("train-warmup", 1)
    t0 = time.time()
    ref = train_offline("train-offline", reuse)
    offline_train_s = time.time() - t0

    producer = [*capture, f"out_dir={stream_dir}", "stream.enabled=true", f"stream.max_gb={cap_gb}",
                f"stream.chunk_sequences={chunk}"]
    t0 = time.time()
    with open(work / "producer.log", "w") as log:
        proc = subprocess.Popen(producer, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            got = run_train(to_schema(compose("train", [*common, f"data.reuse={reuse}", f"capture_dir={stream_dir}",
                                                        f"out_dir={work / 'train-stream'}", "data.source=stream"]),
                                      TrainConfig))
            rc = proc.wait(timeout=600)
        finally:
            proc.kill()
    stream_s = time.time() - t0
    if rc != 0:
        raise SystemExit(f"producer failed (rc {rc}); see {work / 'producer.log'}")
    end = Spool(stream_dir / "spool").end()
    a, b = load_file(str(ref / "final" / "model.safetensors")), load_file(str(got / "final" / "model.safetensors"))
    manifest = json.loads((got / "manifest.json").read_text())
    slower_alone_s = max(offline_capture_s, offline_train_s)
    # the producer's one-time start-up (imports, target load, CUDA context), measured on its own offline run as its
    # wall less its capture loops; paid once per run, so an hours-long run's ratio is the one without it
    offline = json.loads((offline_dir / "manifest.json").read_text())
    startup_s = max(0.0, offline_capture_s - sum(s["this_run"]["seconds"] for s in offline["splits"].values()))
    steady_slower_s = max(offline_capture_s - startup_s, offline_train_s)
    return {"offline_store_bytes": store_bytes, "cap_bytes": end["cap_bytes"], "peak_bytes": end["peak_bytes"],
            "peak_over_store": round(end["peak_bytes"] / store_bytes, 4),
            "peak_over_cap": round(end["peak_bytes"] / end["cap_bytes"], 4),
            "producer_pauses": end["pauses"], "producer_wait_s": end["producer_wait_s"],
            "trainer_wait_s": manifest["stream"]["trainer_wait_s"], "offline_capture_s": round(offline_capture_s, 2),
            "offline_train_s": round(offline_train_s, 2), "stream_wall_s": round(stream_s, 2),
            "stream_over_offline_wall": round(stream_s / (offline_capture_s + offline_train_s), 3),
            "slower_side": "producer" if offline_capture_s >= offline_train_s else "trainer",
            # end-to-end tokens/s over the slower side's tokens/s alone (the same tokens: the ratio of wall times)
            "throughput_over_slower_side": round(slower_alone_s / stream_s, 3),
            "producer_startup_s": round(startup_s, 2),
            "steady_throughput_over_slower_side": round(steady_slower_s / max(1e-9, stream_s - startup_s), 3),
            "end_to_end_tokens_trained_per_s": round(manifest["stream"]["tokens_trained"] / stream_s, 1),
            "bit_identical": a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a),
            "steps": manifest["steps"], "tokens_captured": end["tokens_captured"],
            "tokens_trained": manifest["stream"]["tokens_trained"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capture", nargs="*", default=[], help="overrides of conf/capture.yaml")
    p.add_argument("--train", nargs="*", default=[], help="overrides of conf/train.yaml (+init=... among them)")
    p.add_argument("--cap-fraction", type=float, default=0.25, help="spool cap as a fraction of the offline store")
    p.add_argument("--window", type=int, default=64, help="data.window_sequences")
    p.add_argument("--reuse", type=int, default=1, help="data.reuse")
    p.add_argument("--chunk", type=int, default=8, help="stream.chunk_sequences")
    p.add_argument("--work", type=Path, required=True, help="a scratch directory")
    p.add_argument("--warm-trainer", action="store_true", help="train once untimed first (CUDA init, compile)")
    p.add_argument("--json", type=Path, help="also write the result here")
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    out = run(a.capture, a.train, a.cap_fraction, a.window, a.reuse, a.chunk, a.work, a.warm_trainer)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
