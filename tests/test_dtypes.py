"""eagle3.config.dtypes: the one table of float dtype names, read by the store, the drafter loader and export."""
import pytest
import torch

import re

from eagle3 import REPO_ROOT
from eagle3.drafter import drafter_io
from eagle3.formats import store_format
from eagle3.config.choices import FLOAT_DTYPES
from eagle3.config.dtypes import TORCH_FLOAT_DTYPES, torch_dtype


def test_one_table_for_every_reader():
    assert set(TORCH_FLOAT_DTYPES) == set(FLOAT_DTYPES)
    assert store_format.DTYPES is TORCH_FLOAT_DTYPES
    assert drafter_io.torch_dtype is torch_dtype
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype(torch.float16) is torch.float16
    assert torch_dtype(None) is None
    with pytest.raises(ValueError, match=r"dtype 'bf16': expected one of \['bfloat16', 'float16', 'float32'\]"):
        torch_dtype("bf16")


def test_no_module_spells_its_own_dtype_table():
    """A dtype name becomes a torch dtype only through eagle3/config/dtypes.py (getattr(torch, name) or a
    literal name -> dtype dict elsewhere would accept other names, or miss one)."""
    bypass = re.compile(r"getattr\(torch,|[\"']b?float(16|32)[\"']\s*:\s*torch\.")
    bad = [f"{p.relative_to(REPO_ROOT)}:{i}" for folder in ("eagle3", "data", "train", "eval", "benchmarks")
           for p in sorted((REPO_ROOT / folder).rglob("*.py")) if p.name != "dtypes.py"
           for i, line in enumerate(p.read_text().splitlines(), 1) if bypass.search(line)]
    assert not bad, "use eagle3.config.dtypes.torch_dtype:\n" + "\n".join(bad)
