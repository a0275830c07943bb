"""Schema of `make check` (train/run_check.py): a drafter directory against a target."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from eagle3.schema.common import InitConf, PathsConf, TargetConf


@dataclass
class CheckConfig:
    paths: PathsConf
    target: TargetConf
    drafter_dir: str                    # the drafter directory to check (default: the target's K2 drafter)
    capture_dir: Optional[str] = None   # when it holds a finished capture: aux ids must equal the captured ones
    fail_on_warnings: bool = False      # exit non-zero on warnings too (e.g. before shipping)
    seed: int = 0
    init: Optional[InitConf] = None
