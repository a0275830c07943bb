"""Entry point of the mini world: `python data/run_mini_world.py [overrides]` (`make mini-world`).

Builds `${paths.mini_world}`: tokenizer/, k2-mini/ (DeepSeek-V3 causal LM), k25-mini/ (Kimi-K2.5
layout), corpus/<target>.jsonl (held-out ShareGPT conversations, prepare's default input),
report.json, manifest.json. Deterministic from `seed`; a rerun with a matching manifest does nothing
(`force=true` rebuilds)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402

from data.mini_world.build import run_mini_world  # noqa: E402
from eagle3.conf import to_schema  # noqa: E402
from eagle3.errors import run_main, stage_errors  # noqa: E402
from eagle3.schema.mini_world import MiniWorldConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="mini_world", version_base=None)
def main(cfg) -> None:
    with stage_errors("mini world"):
        run_mini_world(to_schema(cfg, MiniWorldConfig))


if __name__ == "__main__":
    run_main("mini world", main)
