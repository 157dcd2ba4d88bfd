"""The codes' arithmetic (``lit_slowcal.compression``): symmetric quantisation, codes packed several to a byte,
indices in the fewest whole bytes.

- ``quantise(x, levels)``: per row of the last dimension a float32 scale ``max |v| / levels`` and the codes
  ``round(v / scale)`` (half to even) clamped to ``[-levels, levels]``, as int8 (a row whose max is 0: zeros,
  scale 0);
- ``saturate(x, dtype)``: a float64 ``x`` clamped to ``dtype``'s finite range (a scale or value that would
  overflow float32 or bfloat16 travels as their largest, error feedback keeping the rest);
- ``pack(codes, bits)``: codes of ``bits`` bits (``code + 2^(bits-1)``, never negative) packed ``8 // bits`` to a
  byte along the last dimension, the first in the lowest bits; a last byte short of codes is filled with zeros;
  ``unpack(packed, bits, count)`` gives the first ``count`` codes back;
- ``index_width(numel)``: the bytes an index below ``numel`` takes (1, 2, 3, ...); ``pack_indices`` writes
  indices little-endian in that many bytes each, ``unpack_indices`` reads them back as int64.

Torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["index_width", "pack", "pack_indices", "quantise", "saturate", "unpack", "unpack_indices"]


def quantise(x: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """``x``'s rows (its last dimension) as int8 codes in ``[-levels, levels]`` and one float32 scale each."""
    # max |v| as the larger of |max| and |min|: the same value, without a pass writing |v|.
    largest = torch.maximum(x.amax(dim=-1).abs_(), x.amin(dim=-1).abs_())
    scale = saturate(largest / levels, torch.float32).to(torch.float32)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).to(x.dtype).unsqueeze(-1)
    return torch.div(x, divisor).round_().clamp_(-levels, levels).to(torch.int8), scale


def saturate(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` with what lies beyond ``dtype``'s finite range clamped to it (a float64 change too large for float32
    or bfloat16 travels as their largest value; error feedback keeps the rest); ``x`` itself where nothing can."""
    if x.dtype != torch.float64:  # float32 is within bfloat16's range but for its last 0.4 %: left as it is
        return x
    top = torch.finfo(dtype).max
    return x.clamp(-top, top)


def pack(codes: Tensor, bits: int) -> Tensor:
    """int8 ``codes`` in ``[-2^(bits-1), 2^(bits-1))``, ``8 // bits`` to a byte (uint8) along the last dimension."""
    per = 8 // bits
    u = (codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    if u.shape[-1] % per:
        u = F.pad(u, (0, per - u.shape[-1] % per))
    u = u.view(*u.shape[:-1], -1, per)
    out = u[..., 0].clone()
    for j in range(1, per):
        out |= u[..., j] << (bits * j)
    return out


def unpack(packed: Tensor, bits: int, count: int) -> Tensor:
    """The first ``count`` int8 codes that ``pack(codes, bits)`` packed into ``packed``."""
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    u = torch.stack(parts, dim=-1).view(*packed.shape[:-1], -1)[..., :count]
    return (u.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def index_width(numel: int) -> int:
    """The whole bytes an index in ``[0, numel)`` takes: 1 up to 256 values, 2 up to 65,536, ..."""
    return max(1, -(-(numel - 1).bit_length() // 8))


def pack_indices(index: Tensor, width: int) -> Tensor:
    """int64 ``index`` as ``width`` little-endian bytes each (uint8, ``index.numel() * width`` of them)."""
    return torch.stack([(index >> (8 * j)) & 0xFF for j in range(width)], dim=-1).to(torch.uint8).reshape(-1)


def unpack_indices(packed: Tensor, width: int) -> Tensor:
    """The int64 indices ``pack_indices(index, width)`` wrote."""
    b = packed.view(-1, width).to(torch.int64)
    index = b[:, 0].clone()
    for j in range(1, width):
        index |= b[:, j] << (8 * j)
    return index
