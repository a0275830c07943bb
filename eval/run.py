"""`make eval`: evaluate a drafter on the validation store (accuracy per TTT step, simulated accept
length with SGLang's knobs next to n-gram lookup, a real speculative-decoding check, the cost
model's verdict). See conf/eval.yaml for the choices; the work is eval/stage.py:run_eval."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from eagle3.conf import to_schema  # noqa: E402
from eagle3.errors import run_main, stage_errors  # noqa: E402
from eagle3.schema.eval import EvalConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="eval", version_base=None)
def main(cfg: DictConfig) -> None:
    with stage_errors("eval"):
        from eval.stage import run_eval

        run_eval(to_schema(cfg, EvalConfig))


if __name__ == "__main__":
    run_main("eval", main)
