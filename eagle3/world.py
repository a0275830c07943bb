"""The world a result comes from, and building it deterministically: the one home of both.

A *world* is what every later number depends on besides training seeds: the target's weights and
the prepared token ids (tokenizer, regenerated corpus, chat template and masks included). Its
*fingerprint* is {"target": <weights hash>, "data": <token-id hash>} (the target part's rule:
eagle3/fingerprints.py target_part); prepare writes it, every later stage copies it from its inputs' manifests (`world_of_inputs`, called by `write_manifest`), and the
study refuses to pool records whose worlds differ (pipeline/study_report.py).

Deterministic builds: `deterministic_algorithms()` turns on torch's deterministic algorithms for a
block (warn-only: an op with no deterministic kernel still runs) and records every op that warned,
so a manifest says which ops could make two builds on one machine differ. On the CPU every op the
builds use is deterministic for a fixed thread count; on CUDA cuBLAS needs CUBLAS_WORKSPACE_CONFIG
set before its first use (set here when unset; a process that already used cuBLAS gets torch's
warning, recorded like any other). Scaled-dot-product attention is pinned to its math kernel inside
the block when CUDA is present: in warn-only mode the fused (flash / memory-efficient) backward kernels
keep a non-deterministic split-key reduction, which made two GPU-size mini-world builds differ.

Pure standard library (+ torch only inside `deterministic_algorithms`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import warnings
from typing import Iterable, Iterator, Optional

from eagle3.errors import StageError

WORLD_KEY = "world"                      # the manifest field
CUBLAS_WORKSPACE = ":4096:8"             # torch's documented setting for deterministic cuBLAS
_NONDETERMINISTIC = re.compile(r"^(.*?) does not have a deterministic implementation")
# warn-only mode lets SDPA's fused backward kernels keep their split-key (atomic) reduction and says so
# in this wording (torch's attention_backward.cu); seen on an H200 building the GPU-size mini world
_DEFAULTS_NONDETERMINISTIC = re.compile(r"^(.*?) defaults to a non-deterministic algorithm")


class WorldMismatch(StageError, ValueError):
    """Inputs, or study records, that come from different worlds."""


class TokenHash:
    """sha256 over rows of token ids in order (id, input_ids, loss_mask, image bytes): prepare feeds every row it
    writes, per split, so two prepared sets share a hash exactly when their rows are identical."""

    def __init__(self):
        self._h = hashlib.sha256()
        self.rows = 0

    def add(self, row_id: str, input_ids, loss_mask, images: tuple = ()) -> None:
        """`images`: the row's image bytes, in order (a text row has none; its hash is as before)."""
        import numpy as np

        self._h.update(row_id.encode() + b"\0")
        self._h.update(np.asarray(input_ids, dtype=np.int64).tobytes())
        self._h.update(np.asarray(loss_mask, dtype=np.uint8).tobytes())
        for data in images:  # two image rows differ when their pictures do, even with equal ids
            self._h.update(b"img" + hashlib.sha256(bytes(data)).digest())
        self.rows += 1

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:16]


def combine(parts: dict[str, str]) -> str:
    """One 16-hex digest of named parts (order-independent)."""
    return hashlib.sha256("|".join(f"{k}={parts[k]}" for k in sorted(parts)).encode()).hexdigest()[:16]


def world_fingerprint(target_weights: str, data: str) -> dict:
    """The manifest record of a world: its two parts and their combined `id`."""
    return {"target": target_weights, "data": data, "id": combine({"target": target_weights, "data": data})}


def world_of_inputs(manifests: Iterable[dict], where: str) -> Optional[dict]:
    """The world shared by a stage's input manifests (None if none records one). Inputs from two
    different worlds are refused: a stage must never join data of one world with another's."""
    seen: dict[str, dict] = {}
    for m in manifests:
        w = m.get(WORLD_KEY)
        if w:
            seen.setdefault(w["id"], {**w, "stage": m.get("stage")})
    if len(seen) > 1:
        desc = "; ".join(f"{w['stage']}: world {i} (target {w['target']}, data {w['data']})" for i, w in seen.items())
        raise WorldMismatch(f"{where}: the inputs come from different worlds ({desc}); rerun the stages "
                            "after the one that changed so every input is built from the same target and data")
    if not seen:
        return None
    w = next(iter(seen.values()))
    return {k: w[k] for k in ("target", "data", "id")}


def deterministic_ops_note(ops: list[str]) -> str:
    return ("deterministic (every op had a deterministic implementation)" if not ops else
            "ops without a deterministic implementation ran: " + ", ".join(ops))


def deterministic_attention() -> contextlib.AbstractContextManager:
    """SDPA restricted to its math kernel where CUDA is present (a deterministic matmul + softmax
    under deterministic cuBLAS); on a CPU-only machine nothing changes, so CPU worlds keep their bits."""
    import torch

    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


@contextlib.contextmanager
def deterministic_algorithms(record: list[str]) -> Iterator[None]:
    """Deterministic torch algorithms inside the block, warn-only; the name of every op that has no
    deterministic implementation on this device is appended (once) to `record`. Restores torch's
    previous settings on exit."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    # torch's NaN fill of new uninitialized tensors stays on (deterministic mode's default): it costs one kernel per
    # allocation (~10% of a joint vision step's ops, benchmarks/vision_step.py) but turns a read of memory nobody
    # wrote into a NaN that fails the build, where without it the same bug would change bits from run to run
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught, deterministic_attention():
            warnings.simplefilter("always")
            yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev[2], prev[3]
        for w in caught:
            msg = str(w.message)
            m = _NONDETERMINISTIC.match(msg) or _DEFAULTS_NONDETERMINISTIC.match(msg)
            name = m.group(1) if m else ("cuBLAS without CUBLAS_WORKSPACE_CONFIG" if "CUBLAS_WORKSPACE_CONFIG"
                                         in msg else None)
            if name is not None:
                if name not in record:
                    record.append(name)
            else:  # not ours: hand it back to the caller's filters
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
