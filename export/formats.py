"""The export's variation point: an `ExportFormat` is one serving layout of the exported drafter, and
`FORMATS` is the lookup table the export stage reads (export.format names a key, or "both").

Adding a format is one new module (a class with the members below) and one line in FORMATS; the stage
(export/stage.py) and the directory checks (export/directory.py) only call these members. A format class
extends `export.directory.FormatDirectory`, which gives it the shared ones:
  - `dir_in(out_dir)`: where its directory goes (its `subdir` under out_dir; "" = out_dir itself);
  - `problems(out_dir, expected, embed_tokens)`: everything wrong with its written directory, read from disk;
  - `write_checked(out_dir, config, roundtrip, embed, ship_embed, expected)`: write, validate, round trip;
and adds its own:
  - `ships_embed`: whether it may hold the target's embedding (export.speculators_embed);
  - `build_config(served, source, ...)`: its config.json from the served DrafterConfig;
  - `config_problems(cfg, ...)`, `shape_config(cfg)`: the checks of a written config, and the SGLang-layout
    dict that fixes its tensor shapes;
  - `load(path, embed_tokens)`: the written directory back into an Eagle3Drafter (the round trip);
  - `serve_command(config, fmt_dir, choice, tp)`: the launch line SERVE.md prints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence

from export.format_sglang import SGLang
from export.format_speculators import Speculators


class ExportFormat(Protocol):
    name: str
    subdir: str
    ships_embed: bool

    def dir_in(self, out_dir: Path) -> Path: ...

    def problems(self, out_dir: Path, expected: Mapping[str, Any], embed_tokens: Any = False) -> list[str]: ...

    def write_checked(self, out_dir: Path, config: Mapping[str, Any], roundtrip: Any, embed: Any, ship_embed: bool,
                      expected: Mapping[str, Any]) -> dict: ...

    def build_config(self, served: Any, source: Mapping[str, Any], *, hf_indices: Sequence[int], verifier_path: str,
                     verifier_architectures: Sequence[str], speculative_tokens: int) -> dict: ...

    def config_problems(self, cfg: Mapping[str, Any], **expected: Any) -> list[str]: ...

    def shape_config(self, cfg: Mapping[str, Any]) -> Mapping[str, Any]: ...

    def load(self, path: Path, embed_tokens: Optional[Any] = None) -> Any: ...

    def serve_command(self, config: Any, fmt_dir: Path, choice: Any, tp: Optional[int]) -> list[str]: ...


FORMATS: dict[str, ExportFormat] = {
    "sglang": SGLang(),
    "speculators": Speculators(),
}


def get_format(name: str) -> ExportFormat:
    if name not in FORMATS:
        raise ValueError(f"export format {name!r}: expected one of {sorted(FORMATS)}")
    return FORMATS[name]


def formats_of(choice: str) -> list[ExportFormat]:
    """export.format's value -> the formats it writes ("both": every one, in table order)."""
    return list(FORMATS.values()) if choice == "both" else [get_format(choice)]

