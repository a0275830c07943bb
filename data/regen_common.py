"""What the regeneration modules share: their errors and the finish reasons they add to the
server's own (`stop`, `length`). Imports only the standard library and eagle3.errors."""
from __future__ import annotations

from eagle3.errors import StageError


class RegenerateError(StageError, RuntimeError):
    """Regeneration cannot run (bad store, unreachable model); the message says what to do."""


class GenerationFailed(Exception):
    """One conversation could not be regenerated (after retries); counted as `regen_failed`."""


PAST_MAX_LENGTH = "past_max_length"  # finish reason of a turn kept as written (see regenerate_batch)
ROUND_TRIP = "round_trip"  # finish reason of an answer cut where its text stops re-tokenizing to its tokens
