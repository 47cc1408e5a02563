"""Blockwise 8-bit state: bitsandbytes' codebooks and its CPU quantizer, once.

An 8-bit state tensor holds one byte (a *code*) per element and one float32 ``absmax`` per
block of ``BLOCK`` elements (the last block may be partial). Its value is
``codebook[code] * absmax`` (``dequantize``: one float32 multiply). Quantizing a block takes its
largest magnitude as ``absmax``, normalizes each element by ``x * (1 / absmax)`` and looks the
code up in a 65,536-entry table over ``[-1, 1]`` (``lookup_table``), as bitsandbytes 0.50's CPU
kernel does: a table lookup, not the nearest code (for about a third of normalized values it
picks another). The engines implement ``lut_position`` and ``block_absmax`` as written here;
the conformance suite checks both against the wheel.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = ["BLOCK", "LUT_SIZE", "dynamic_map", "lookup_table", "blocks_of", "lut_position"]

BLOCK = 256  # elements per absmax (bitsandbytes' optimizers use 256 on the CPU)
LUT_SIZE = 1 << 16
_F32 = np.float32


@functools.lru_cache(maxsize=2)
def _dynamic_map(signed: bool) -> tuple:
    # Dettmers' dynamic map (arXiv:1511.04561) with 7 exponent bits over 8 bits, built with the
    # float32 ops bitsandbytes' create_dynamic_map uses, so that every code has its bits
    data: list[float] = []
    max_exponent_bits, non_sign_bits = 7, 7
    for i in range(max_exponent_bits):
        exponent = i + non_sign_bits - max_exponent_bits
        items = 2**exponent + 1 if signed else 2 ** (exponent + 1) + 1
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    data.sort()
    return tuple(data)


def dynamic_map(signed: bool = True) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed)``: the 256 codes of the first (signed) and
    second (unsigned) moment, sorted, float32."""
    return torch.tensor(_dynamic_map(bool(signed)), dtype=torch.float32)


def lookup_table(code: torch.Tensor | np.ndarray) -> np.ndarray:
    """The 65,536 codes of bitsandbytes' CPU quantizer for ``code`` (uint8): bin ``i`` stands for
    ``-1 + 2 i / 65535`` (float32 arithmetic) and holds the first code whose midpoint with the
    next is not below it."""
    c = np.asarray(code.numpy() if isinstance(code, torch.Tensor) else code, dtype=_F32)
    if c.shape != (256,):
        raise ValueError(f"a codebook has 256 entries, got shape {c.shape}")
    midpoints = _F32(0.5) * (c[:-1] + c[1:])
    values = _F32(-1.0) + (_F32(2.0) * np.arange(LUT_SIZE, dtype=_F32)) / _F32(LUT_SIZE - 1)
    # the first k with midpoints[k] >= value (the kernel's forward scan), capped at 255
    return np.searchsorted(midpoints, values, side="left").astype(np.uint8)


def lut_position(normalized: np.ndarray) -> np.ndarray:
    """The table bin of normalized values (float32): ``(clamp(x, -1, 1) + 1) * 0.5`` rounded,
    then ``* 65535 + 0.5`` with one rounding (the kernel's fused multiply-add), truncated. NaN
    goes to bin 0."""
    x = np.clip(np.asarray(normalized, dtype=_F32), _F32(-1.0), _F32(1.0))
    half = (x + _F32(1.0)) * _F32(0.5)
    # t * 65535 is exact in float64 (24 + 16 bits) and so is the sum wherever the bin depends
    # on it; rounding that to float32 is the fused multiply-add's single rounding
    pos = (half.astype(np.float64) * (LUT_SIZE - 1) + 0.5).astype(_F32)
    pos = np.where(np.isnan(pos), _F32(0.0), pos)
    return pos.astype(np.int64)


def blocks_of(numel: int) -> int:
    """The number of absmax blocks of a tensor of ``numel`` elements."""
    return -(-numel // BLOCK)


def block_absmax(flat: np.ndarray) -> np.ndarray:
    """Each block's largest magnitude (float32), as the kernel's ``max`` reduction takes it:
    a NaN is skipped (``max(m, NaN)`` keeps ``m``)."""
    a = np.abs(np.asarray(flat, dtype=_F32).reshape(-1))
    pad = blocks_of(a.size) * BLOCK - a.size
    a = np.concatenate([a, np.zeros(pad, _F32)]) if pad else a
    return (
        np.fmax.reduce(np.nan_to_num(a, nan=0.0, posinf=np.inf).reshape(-1, BLOCK), axis=1) if a.size else a
    )
