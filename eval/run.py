"""`make eval`: evaluate a drafter on the validation store (accuracy per TTT step, simulated accept
length with SGLang's knobs next to n-gram lookup, a real speculative-decoding check, the cost
model's verdict). See conf/eval.yaml for the choices; the work is eval/stage.py:run_eval."""

import hydra
from omegaconf import DictConfig

from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.eval import EvalConfig


@hydra.main(config_path="../conf", config_name="eval", version_base=None)
def main(cfg: DictConfig) -> None:
    with stage_errors("eval"):
        from eval.stage import run_eval

        run_eval(to_schema(cfg, EvalConfig))


if __name__ == "__main__":
    run_main("eval", main)
