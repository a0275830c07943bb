"""`make study`: learning curves over seeds for both inits, what fine-tuning forgets, knobs (pipeline/study.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.cpu_threads import prefer_passive_wait  # noqa: E402

prefer_passive_wait()  # before torch loads OpenMP (eagle3/cpu_threads.py says why)

import hydra  # noqa: E402

from eagle3.conf import to_schema  # noqa: E402
from eagle3.errors import run_main, stage_errors  # noqa: E402
from eagle3.schema.study import StudyConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="study", version_base=None)
def main(cfg) -> None:
    with stage_errors("study"):
        from pipeline.study import run_study

        run_study(to_schema(cfg, StudyConfig))


if __name__ == "__main__":
    run_main("study", main)
