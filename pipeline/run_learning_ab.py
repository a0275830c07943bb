"""`make learning-ab`: the learning-quality A/B of two training code paths (pipeline/learning_ab.py)."""

from eagle3.cpu_threads import prefer_passive_wait

prefer_passive_wait()  # before torch loads OpenMP (eagle3/cpu_threads.py says why)

import hydra

from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.learning_ab import LearningABConfig


@hydra.main(config_path="../conf", config_name="learning_ab", version_base=None)
def main(cfg) -> None:
    with stage_errors("learning_ab"):
        from pipeline.learning_ab import run_learning_ab

        run_learning_ab(to_schema(cfg, LearningABConfig))


if __name__ == "__main__":
    run_main("learning_ab", main)
