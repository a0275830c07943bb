from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from eagle3.conf import ConfigError
from eagle3.schema.common import InitConf, PathsConf, TargetConf


@dataclass
class TrainConfig:
    paths: PathsConf
    target: TargetConf
    capture_dir: str
    vocab_dir: str
    out_dir: str
    init: Optional[InitConf] = None
    seed: int = 0

    def validate(self) -> None:
        if self.init is None:
            raise ConfigError("training needs an init choice: add +init=aqmedai_k2 or +init=scratch")
