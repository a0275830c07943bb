"""`make bench-serve`: measure running servers (a baseline and speculative ones), compare the served
accept length with the replay of their own generations, fit the cost split and write a cost preset.
See conf/bench_serve.yaml for the choices; the work is eval/bench_serve.py:run_bench_serve."""

import hydra
from omegaconf import DictConfig

from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.bench_serve import BenchServeConfig


@hydra.main(config_path="../conf", config_name="bench_serve", version_base=None)
def main(cfg: DictConfig) -> None:
    with stage_errors("bench-serve"):
        from eval.bench_serve import run_bench_serve

        run_bench_serve(to_schema(cfg, BenchServeConfig))


if __name__ == "__main__":
    run_main("bench-serve", main)
