from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from eagle3.schema.common import InitConf, PathsConf, TargetConf


@dataclass
class EvalConfig:
    paths: PathsConf
    target: TargetConf
    capture_dir: str
    seed: int = 0
    init: Optional[InitConf] = None
