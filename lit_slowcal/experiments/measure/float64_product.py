"""The training inputs arranged for the objective's products: ``X W^T`` in float64 for many points at once.

The training objective f(x) of the linear model needs the logits of every training sample at every
evaluation: a product of the inputs ``X`` ``(n, d)`` (MNIST: 60,000 x 784) with each evaluated point's
weight. ``BlockedInputs`` computes them for P points in one pass over ``X``, in float64, doing less of the
product where the inputs are sparse around a common value:

* ``X = c + D``: ``c`` holds each column's most common value (MNIST: the normalised background), so ``D``
  is zero wherever a pixel is background (81% of MNIST's entries); ``X W^T = D W^T + c W^T``, the second
  term one row for all samples.
* The rows are sorted so that rows differing from ``c`` in alike places are side by side (images, as MNIST's:
  by the bounding box of those pixels; other inputs: by the first and the last such column) and cut into
  blocks of ``rows`` rows (256 on the CPU). Each block keeps only the columns where one of its rows differs
  from ``c``: on MNIST, 45% of the dense product's work (53% without the images' shape). On a GPU one block
  holds every row.
* Every value is float64: ``D`` (``x - c`` of two float32 numbers is a float64 number unless their
  exponents differ by more than 29), the products (a product of two float32 numbers is a float64 number)
  and the sums (rounded to float64). A logit's error is at most ``gamma_(k+1) * (sum_j |d_j w_j| +
  |c . w + b|)``, ``gamma_m = m u / (1 - m u)``, ``u = 2^-53``, ``k`` the block's columns (the standard
  bound of a dot product, e.g. Higham, Accuracy and Stability of Numerical Algorithms, 3.1). So the values
  for one point do not depend on the other points of the pass beyond that bound:
  ``tests/experiments/measure/test_objective.py`` checks it, and checks the logits against correctly rounded
  ones (``math.fsum``).

The arrangement depends on ``X`` only: the objectives of every trial of a process that train on the same
samples share one (``prepared``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import torch
from torch import Tensor

__all__ = ["BlockedInputs", "prepared"]

#: Rows per block on the CPU: small enough that a block keeps few columns, large enough for a fast product.
BLOCK_ROWS = 256
#: Rows read to find each column's most common value (a subsample: c only decides what is sparse).
_MODE_ROWS = 4096


class BlockedInputs:
    """``X`` ``(n, d)`` (any float dtype) arranged for products with many points at once (module docstring).

    Args:
        x: the inputs, on the device where the products run.
        rows: rows per block (default ``BLOCK_ROWS`` on the CPU; all rows in one block on a GPU).
        image: ``(height, width)`` when each row is an image (MNIST: 28 x 28): rows are then sorted by the
            bounding box of their pixels that differ from ``c`` (MNIST: 45% of the dense product, not 53%).
    """

    def __init__(self, x: Tensor, rows: Optional[int] = None, image: Optional[tuple[int, int]] = None) -> None:
        n, d = x.shape
        if rows is None:
            rows = BLOCK_ROWS if x.device.type == "cpu" else max(1, n)
        sample = x[:: max(1, n // _MODE_ROWS)]
        self.center = sample.mode(0).values.to(torch.float64)  # c: each column's most common value
        differs = x != self.center.to(x.dtype)
        self.order = torch.argsort(_pattern_key(differs, image), stable=True)  # rows with alike patterns side by side
        self.n, self.d = n, d
        self.blocks: list[tuple[int, int, Optional[Tensor], Tensor]] = []  # (start, stop, columns or None: all, D)
        for start in range(0, n, rows):
            picked = self.order[start : start + rows]
            used = differs[picked].any(0)
            cols = None if bool(used.all()) else used.nonzero().squeeze(1)
            block = x[picked] if cols is None else x[picked][:, cols]
            center = self.center if cols is None else self.center[cols]
            self.blocks.append((start, start + len(picked), cols, (block.to(torch.float64) - center).contiguous()))

    @property
    def density(self) -> float:
        """The share of the dense product that the blocks compute (MNIST, 256 rows: 0.45 as images, else 0.53)."""
        kept = sum((stop - start) * (self.d if cols is None else len(cols)) for start, stop, cols, _ in self.blocks)
        return kept / max(1, self.n * self.d)

    def sorted(self, values: Tensor) -> Tensor:
        """``values`` (one per row of ``X``, along dim 0) in the blocks' row order."""
        return values.index_select(0, self.order.to(values.device))

    def logits(self, weight: Tensor, bias: Tensor) -> Iterator[tuple[int, int, Tensor]]:
        """The float64 logits of every block for P points at once: ``(start, stop, z)`` with ``z``
        ``(stop - start, P, outputs)`` the rows ``start:stop`` of the sorted order (``sorted``). ``z`` is
        overwritten by the next block's (one buffer for all: allocating them afresh costs more than the product).

        Args:
            weight: ``(P, outputs, d)``, the points' weights (any float dtype).
            bias: ``(P, outputs)``.
        """
        points, outputs, _ = weight.shape
        w = weight.to(torch.float64).permute(2, 0, 1).reshape(self.d, points * outputs)  # (d, P * outputs)
        base = torch.addmv(bias.to(torch.float64).reshape(-1), w.T, self.center)  # c W^T + b, one row for every sample
        rows = max(stop - start for start, stop, _, _ in self.blocks)
        picked = w.new_empty((self.d, points * outputs))
        out = w.new_empty((rows, points * outputs))
        for start, stop, cols, block in self.blocks:
            factor = w if cols is None else torch.index_select(w, 0, cols, out=picked[: len(cols)])
            z = torch.addmm(base, block, factor, out=out[: stop - start])
            yield start, stop, z.view(stop - start, points, outputs)


def _pattern_key(differs: Tensor, image: Optional[tuple[int, int]]) -> Tensor:
    """A sort key per row that puts rows differing from ``c`` in alike places side by side: the first and the last
    such column; for images, the size and the corner of their bounding box."""
    n, d = differs.shape
    if image is None or image[0] * image[1] != d:
        columns = torch.arange(d, device=differs.device)
        first = torch.where(differs, columns, d).amin(1)
        last = torch.where(differs, columns, -1).amax(1)
        return first * (d + 1) + last
    height, width = image
    pixels = differs.view(n, height, width)

    def extent(lines: Tensor) -> tuple[Tensor, Tensor]:  # (n, k) booleans -> first and last true index
        index = torch.arange(lines.shape[1], device=lines.device)
        return torch.where(lines, index, lines.shape[1]).amin(1), torch.where(lines, index, -1).amax(1)

    top, bottom = extent(pixels.any(2))
    left, right = extent(pixels.any(1))
    return ((right - left) * (height + 1) + (bottom - top)) * (d + 1) + top * width + left


_CACHE: list[tuple[Tensor, BlockedInputs]] = []
_CACHE_SIZE = 2


def prepared(x: Tensor, image: Optional[tuple[int, int]] = None) -> BlockedInputs:
    """The ``BlockedInputs`` of ``x`` (``image``: its rows' image shape), made once and shared by every caller in
    this process that passes the same tensor (the last ``_CACHE_SIZE`` kept)."""
    for source, found in _CACHE:
        if source is x:
            return found
    made = BlockedInputs(x, image=image)
    _CACHE.append((x, made))
    del _CACHE[:-_CACHE_SIZE]
    return made
