"""`make bench-serve`: measure running servers (a baseline and speculative ones), compare the served
accept length with the replay of their own generations, fit the cost split and write a cost preset.
See conf/bench_serve.yaml for the choices; the work is eval/bench_serve.py:run_bench_serve."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from eagle3.conf import to_schema  # noqa: E402
from eagle3.errors import run_main, stage_errors  # noqa: E402
from eagle3.schema.bench_serve import BenchServeConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="bench_serve", version_base=None)
def main(cfg: DictConfig) -> None:
    with stage_errors("bench-serve"):
        from eval.bench_serve import run_bench_serve

        run_bench_serve(to_schema(cfg, BenchServeConfig))


if __name__ == "__main__":
    run_main("bench-serve", main)
