"""Entry point of the prepare stage: `python data/run_prepare.py [overrides]` (`make prepare`).

Conversations -> chat template + assistant-only loss mask -> datasets train/ and validation/.
Regenerate the assistant turns with the target first: `regenerate.backend=hf` (local) or
`regenerate.backend=openai regenerate.openai.base_url=http://host:port/v1` (any server)."""

import hydra

from data.prepare import run_prepare
from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.prepare import PrepareConfig


@hydra.main(config_path="../conf", config_name="prepare", version_base=None)
def main(cfg) -> None:
    with stage_errors("prepare"):
        run_prepare(to_schema(cfg, PrepareConfig))


if __name__ == "__main__":
    run_main("prepare", main)
