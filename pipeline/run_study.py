"""`make study`: learning curves over seeds for both inits, what fine-tuning forgets, knobs (pipeline/study.py)."""

from eagle3.cpu_threads import prefer_passive_wait

prefer_passive_wait()  # before torch loads OpenMP (eagle3/cpu_threads.py says why)

import hydra

from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.study import StudyConfig


@hydra.main(config_path="../conf", config_name="study", version_base=None)
def main(cfg) -> None:
    with stage_errors("study"):
        from pipeline.study import run_study

        run_study(to_schema(cfg, StudyConfig))


if __name__ == "__main__":
    run_main("study", main)
