"""Float dtype names (the choices configs accept, eagle3/config/choices.py FLOAT_DTYPES) and their torch dtypes:
the one table the store, the drafter loader and the export read. Imports torch (choices.py stays stdlib)."""
from __future__ import annotations

import torch

from eagle3.config.choices import FLOAT_DTYPES

TORCH_FLOAT_DTYPES = {name: getattr(torch, name) for name in FLOAT_DTYPES}  # "bfloat16" -> torch.bfloat16, ...


def torch_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype name (or a torch dtype, or None) -> the torch dtype; a clear error for any other name."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in TORCH_FLOAT_DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(TORCH_FLOAT_DTYPES)}")
    return TORCH_FLOAT_DTYPES[name]
