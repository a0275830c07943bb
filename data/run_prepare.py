"""Entry point of the prepare stage: `python data/run_prepare.py [overrides]` (`make prepare`).

Conversations -> chat template + assistant-only loss mask -> datasets train/ and validation/.
Regenerate the assistant turns with the target first: `regenerate.backend=hf` (local) or
`regenerate.backend=openai regenerate.openai.base_url=http://host:port/v1` (any server)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402

from data.prepare import run_prepare  # noqa: E402
from eagle3.conf import to_schema  # noqa: E402
from eagle3.errors import run_main, stage_errors  # noqa: E402
from eagle3.schema.prepare import PrepareConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="prepare", version_base=None)
def main(cfg) -> None:
    with stage_errors("prepare"):
        run_prepare(to_schema(cfg, PrepareConfig))


if __name__ == "__main__":
    run_main("prepare", main)
