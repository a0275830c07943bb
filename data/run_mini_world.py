"""Entry point of the mini world: `python data/run_mini_world.py [overrides]` (`make mini-world`).

Builds `${paths.mini_world}`: tokenizer/, k2-mini/ (DeepSeek-V3 causal LM), k25-mini/ (Kimi-K2.5
layout), corpus/<target>.jsonl (held-out ShareGPT conversations, prepare's default input),
report.json, manifest.json. Deterministic from `seed`; a rerun with a matching manifest does nothing
(`force=true` rebuilds)."""

import hydra

from data.mini_world.build import run_mini_world
from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.mini_world import MiniWorldConfig


@hydra.main(config_path="../conf", config_name="mini_world", version_base=None)
def main(cfg) -> None:
    with stage_errors("mini world"):
        run_mini_world(to_schema(cfg, MiniWorldConfig))


if __name__ == "__main__":
    run_main("mini world", main)
