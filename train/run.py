"""Entry point of the train stage: `python train/run.py +init=aqmedai_k2` (or `+init=scratch`).

Under several processes: `accelerate launch train/run.py +init=...` (DDP; add fsdp=true for FSDP).
Rerunning the same command resumes from the newest checkpoint, or reuses a finished run.
"""

import hydra

from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.train import TrainConfig


@hydra.main(config_path="../conf", config_name="train", version_base=None)
def main(cfg) -> None:
    with stage_errors("train"):
        from train.stage import run_train

        run_train(to_schema(cfg, TrainConfig))


if __name__ == "__main__":
    run_main("train", main)
