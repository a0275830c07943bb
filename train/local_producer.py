"""`data.producer=local` (`make train-online`): the train stage starts the streaming producer itself, as its
own process (data/run_capture.py stream.enabled=true), writing the spool this run reads. The producer gets
this config's paths, target and init (so it captures the layers the drafter reads) and `data.producer_args`;
its output goes to <out_dir>/producer.log. A producer that exits with an error marks the spool's status
failed, so the trainer stops at once naming it; when training stops early the producer is stopped too (its
published chunks stay: a rerun resumes both sides)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from eagle3 import REPO_ROOT
from eagle3.formats.spool import Spool

LOG_NAME = "producer.log"
STOP_WAIT_S = 10.0


def producer_overrides(config, spool: Path) -> list[str]:
    """The capture overrides that make a producer write exactly the spool (`spool`) this train config reads."""
    t, i = config.target, config.init
    over = [f"paths.root={config.paths.root}", f"target={t.name}"]
    over += [f"target.{k}={_value(getattr(t, k))}" for k in ("path", "tokenizer", "layout", "dtype", "device_map",
                                                              "trust_remote_code")]
    if i.name != "scratch":  # the layer ids come from the init drafter, as a capture for it reads them
        over += [f"+init={i.name}", f"init.drafter_path={i.drafter_path}", f"init.aux_id_rule={i.aux_id_rule}"]
    return over + list(config.data.producer_args) + [f"out_dir={config.capture_dir}", "stream.enabled=true",
                                                     f"stream.dir={spool}"]


def _value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def producer_command(config, spool: Path) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "data" / "run_capture.py"), *producer_overrides(config, spool)]


@contextmanager
def local_producer(config, stream, main: bool):
    """Start the producer for the span of the run (main process only), unless one is running or done.
    `stream`: the run's StreamConf (train/setup.py: the spool, the timeout)."""
    if not (main and stream.source == "stream" and config.data.producer == "local"):
        yield None
        return
    cmd = producer_command(config, stream.spool)
    spool = Spool(stream.spool)
    if spool.end() is not None or spool.live_status(stream.timeout_s):
        print(f"[train] {spool.root}: a producer is running or the stream is complete; not starting another")
        yield None
        return
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / LOG_NAME, "a")
    print(f"[train] starting the producer (log {out / LOG_NAME}): {' '.join(cmd[1:])}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    watch = threading.Thread(target=_mark_failure, args=(proc, spool, out / LOG_NAME), daemon=True)
    watch.start()
    try:
        yield proc
    finally:
        try:
            proc.wait(timeout=STOP_WAIT_S)  # after a finished run the producer is done, or about to be
        except subprocess.TimeoutExpired:
            proc.terminate()  # training stopped early: published chunks stay, a rerun resumes
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _mark_failure(proc: subprocess.Popen, spool: Spool, log_path: Path) -> None:
    """A producer that exits with an error before (or without) saying so: its status says failed, with the
    last line of its log, so the waiting trainer stops at once instead of after data.stream_timeout_s."""
    rc = proc.wait()
    s = spool.status() or {}
    if rc == 0 or s.get("state") == "failed" or rc < 0:  # < 0: stopped by this run (terminate/kill)
        return
    tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["(empty log)"]
    spool.root.mkdir(parents=True, exist_ok=True)
    spool.write_status(state="failed", error=f"the producer (pid {proc.pid}) exited with code {rc}: {tail[0]} "
                                             f"(log {log_path})")
