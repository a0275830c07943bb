"""Entry point of the vocab stage: `python data/run_vocab.py [overrides]` (`make vocab`).

Top-N draft vocab from the loss-masked token frequencies of the prepared train split; with
`+init=aqmedai_k2` the report compares it with that drafter's mapping.
Kimi-K2.5: `python data/run_vocab.py target=kimi_k25 draft_vocab_size=32000 +init=aqmedai_k2`."""

import hydra

from data.vocab import run_vocab
from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.vocab import VocabConfig


@hydra.main(config_path="../conf", config_name="vocab", version_base=None)
def main(cfg) -> None:
    with stage_errors("vocab"):
        run_vocab(to_schema(cfg, VocabConfig))


if __name__ == "__main__":
    run_main("vocab", main)
