"""The spool's backpressure watermarks, the one rule for `stream.max_gb`, `high` and `low`: the capture schema checks
a config with it (eagle3/config/schema/capture.py StreamConf) and the producer pauses by it (eagle3/formats/spool.py
`must_pause`, data/stream_capture.py). Standard library only, so the spool and the schema share it."""
from __future__ import annotations

from dataclasses import dataclass

from eagle3.errors import StageError


class WatermarkError(StageError, ValueError):
    """stream.max_gb / high / low that give no watermarks."""


@dataclass(frozen=True)
class Watermarks:
    cap: int    # bytes
    high: int
    low: int

    @classmethod
    def from_gb(cls, max_gb: float, high: float, low: float) -> "Watermarks":
        if not (max_gb > 0 and 0 < low < high <= 1):
            raise WatermarkError(f"spool: max_gb={max_gb} must be > 0 and 0 < low={low} < high={high} <= 1")
        cap = int(max_gb * 1e9)
        return cls(cap, int(cap * high), int(cap * low))
