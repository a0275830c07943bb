"""`make demo`: every stage on the mini world, and the K2-vs-K2.5 drafter comparison table."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.cpu_threads import prefer_passive_wait  # noqa: E402

prefer_passive_wait()  # before torch loads OpenMP (eagle3/cpu_threads.py says why)

import hydra  # noqa: E402

from eagle3.conf import to_schema  # noqa: E402
from eagle3.errors import run_main, stage_errors  # noqa: E402
from eagle3.schema.demo import DemoConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="demo", version_base=None)
def main(cfg) -> None:
    with stage_errors("demo"):
        from pipeline.demo import run_demo

        run_demo(to_schema(cfg, DemoConfig))


if __name__ == "__main__":
    run_main("demo", main)
