from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from eagle3.schema.common import InitConf, PathsConf, TargetConf


@dataclass
class ExportConfig:
    paths: PathsConf
    target: TargetConf
    seed: int = 0
    init: Optional[InitConf] = None
    in_dir: str = ""
    out_dir: str = ""
