"""Entry point of the export stage: `python export/run.py [overrides]` (`make export`).

The trained drafter (train-<name>/final) -> an SGLang directory (and a vLLM speculators one), validated
from disk and checked logit for logit against the checkpoint; prints the serve commands (SERVE.md).
`+init=scratch` exports the scratch run; `format=sglang|speculators|both`; `dtype=float32` for an
exact copy."""

import hydra

from eagle3.config.conf import to_schema
from eagle3.errors import run_main, stage_errors
from eagle3.config.schema.export import ExportConfig
from export.stage import run_export


@hydra.main(config_path="../conf", config_name="export", version_base=None)
def main(cfg) -> None:
    with stage_errors("export"):
        run_export(to_schema(cfg, ExportConfig))


if __name__ == "__main__":
    run_main("export", main)
