"""Entry point of the vocab stage: `python data/run_vocab.py [overrides]` (`make vocab`).

Top-N draft vocab from the loss-masked token frequencies of the prepared train split; with
`+init=aqmedai_k2` the report compares it with that drafter's mapping.
Kimi-K2.5: `python data/run_vocab.py target=kimi_k25 draft_vocab_size=32000 +init=aqmedai_k2`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402

from data.vocab import run_vocab  # noqa: E402
from eagle3.conf import to_schema  # noqa: E402
from eagle3.errors import run_main, stage_errors  # noqa: E402
from eagle3.schema.vocab import VocabConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="vocab", version_base=None)
def main(cfg) -> None:
    with stage_errors("vocab"):
        run_vocab(to_schema(cfg, VocabConfig))


if __name__ == "__main__":
    run_main("vocab", main)
