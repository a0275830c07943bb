from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from eagle3.schema.common import InitConf, PathsConf, TargetConf


@dataclass
class CaptureConfig:
    paths: PathsConf
    target: TargetConf
    in_dir: str
    out_dir: str
    seed: int = 0
    init: Optional[InitConf] = None
