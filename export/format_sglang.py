"""The SGLang export format (`LlamaForCausalLMEagle3`; also the SpecForge / AQ-MedAI layout): the export
directory itself, read back with the project's own loader. One `ExportFormat` (export/formats.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from export import spec
from export.directory import FormatDirectory
from eagle3.engines.serve_launch import sglang_command


class SGLang(FormatDirectory):
    name = "sglang"
    subdir = ""
    ships_embed = False  # SGLang calls set_embed with the target's

    def build_config(self, served, source: Mapping[str, Any], **_: Any) -> dict:
        return spec.served_sglang_config(served, source)

    def config_problems(self, cfg: Mapping[str, Any], **expected: Any) -> list[str]:
        return spec.sglang_config_problems(cfg, **expected)

    def shape_config(self, cfg: Mapping[str, Any]) -> Mapping[str, Any]:
        return cfg

    def load(self, path: Path, embed_tokens: Optional[Any] = None):
        import torch

        from eagle3.drafter.drafter_io import load_drafter_dir

        return load_drafter_dir(path, embed_tokens=embed_tokens, dtype=torch.float32)

    def serve_command(self, config, fmt_dir: Path, choice, tp: Optional[int]) -> list[str]:
        return sglang_command(config.target, fmt_dir, choice, tp, config.serve.extra_args)


__all__: Sequence[str] = ["SGLang"]
