"""The train stage's input error (its own module so that train/inputs.py and train/spool_source.py,
which inputs.py opens for data.source=stream, share it without importing each other)."""
from eagle3.errors import StageError


class TrainInputError(StageError, ValueError):
    """Inputs that cannot be trained on together; the message says which and what to do."""
