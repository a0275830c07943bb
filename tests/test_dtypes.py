"""eagle3.dtypes: the one table of float dtype names, read by the store, the drafter loader and export."""
import pytest
import torch

from eagle3 import drafter_io, export_spec, store_format
from eagle3.choices import FLOAT_DTYPES
from eagle3.dtypes import TORCH_FLOAT_DTYPES, torch_dtype


def test_one_table_for_every_reader():
    assert set(TORCH_FLOAT_DTYPES) == set(FLOAT_DTYPES)
    assert store_format.DTYPES is TORCH_FLOAT_DTYPES and export_spec.WEIGHT_DTYPES is TORCH_FLOAT_DTYPES
    assert drafter_io.torch_dtype is torch_dtype
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype(torch.float16) is torch.float16
    assert torch_dtype(None) is None
    with pytest.raises(ValueError, match=r"dtype 'bf16': expected one of \['bfloat16', 'float16', 'float32'\]"):
        torch_dtype("bf16")
