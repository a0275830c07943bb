from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from eagle3.schema.common import InitConf, PathsConf


@dataclass
class MiniWorldConfig:
    paths: PathsConf
    out_dir: str
    seed: int = 0
    init: Optional[InitConf] = None  # unused; accepted so every config composes with +init
