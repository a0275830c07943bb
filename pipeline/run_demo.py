"""`make demo`: every stage on the mini world, and the K2-vs-K2.5 drafter comparison table."""

from eagle3.cpu_threads import prefer_passive_wait

prefer_passive_wait()  # before torch loads OpenMP (eagle3/cpu_threads.py says why)

import hydra

from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.demo import DemoConfig


@hydra.main(config_path="../conf", config_name="demo", version_base=None)
def main(cfg) -> None:
    with stage_errors("demo"):
        from pipeline.demo import run_demo

        run_demo(to_schema(cfg, DemoConfig))


if __name__ == "__main__":
    run_main("demo", main)
