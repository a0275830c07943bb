"""Per-row fp8 (e4m3fn) quantisation of hidden states: tensors in, tensors out, no I/O.

A row is the last dimension (one captured layer's hidden state of one token). Each row gets one fp32
scale, amax / 448 (448 = the largest finite e4m3fn value; computed as amax x fl32(1/448)), so the row's largest element maps to
+-448 and every element keeps e4m3's 3 mantissa bits: relative error <= 2^-4 for elements down to
amax / 28672 (= e4m3's smallest normal 2^-6 x scale); smaller ones are e4m3 subnormals, absolute
error <= scale x 2^-10.
An all-zero row gets scale 1 (its codes are all zero; dividing by a zero scale would give NaN).

Inputs must be finite (the store rejects NaN/inf before quantising): an inf amax would make every
code of its row NaN. Imports only torch.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes fp8 e4m3fn [..., D], scale fp32 [...]) with
    x ~= codes.float() * scale[..., None]."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # [...]
    # amax x fl32(1/448), a multiply: CUDA divides by a scalar through its reciprocal, CPU does not, so a
    # division would give the GPU and the CPU different scales (and codes) for the same states
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
    # amax / (amax / 448) can round to just above 448, which the (non-saturating) cast turns into NaN
    codes = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantise_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes fp8 [..., D], scale fp32 [...] -> [..., D] in `dtype` (product in fp32, rounded once)."""
    if codes.shape[:-1] != scale.shape:
        raise ValueError(f"fp8 codes {tuple(codes.shape)} need one scale per row, got scale {tuple(scale.shape)}")
    return (codes.float() * scale.float().unsqueeze(-1)).to(dtype)
