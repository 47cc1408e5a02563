"""What a launch reads besides the scalars: the table of addresses (``AddressTable``: a row of
``data_ptr()`` per program tensor, a column per parameter) and the ``layout`` (``pack_layout``:
each thread's share of the step's elements, as items ``(parameter, start, stop)``, and which
row of ``scalar_rows`` each parameter reads).
"""

from __future__ import annotations

import numpy as np
import torch

from ...tensors import Checked
from ..low_precision import tail_spans
from .config import ALIGN


def partition(sizes, nthreads: int, tails=None):
    """Split the elements of tensors of ``sizes`` into ``nthreads`` equal contiguous shares.

    Returns ``(bounds, items)``: thread ``w`` runs ``items[bounds[w]:bounds[w + 1]]``, each item
    ``(tensor index, start, stop)``; shares are cut at multiples of ALIGN elements. ``tails``:
    ``(torch's thread count, the vector loop's step)`` of a low-precision kernel whose formulas
    take torch's scalar tail apart: items are cut at the tails (``low_precision.tail_spans``)
    and carry a fourth entry, 1 in a tail, else 0.
    """
    if tails is not None:
        return _with_tails(sizes, *partition(sizes, nthreads), *tails)
    total = int(sum(sizes))
    share = -(-total // nthreads)
    share = -(-share // ALIGN) * ALIGN
    items, bounds = [], [0]
    cut = share  # end of the current thread's share, in the concatenation of the tensors
    offset = 0
    for j, n in enumerate(sizes):
        lo = 0
        while lo < n:
            while offset + lo >= cut and len(bounds) < nthreads:
                bounds.append(len(items))
                cut += share
            hi = n if len(bounds) == nthreads else min(n, cut - offset)
            items.append((j, lo, hi))
            lo = hi
        offset += n
    bounds += [len(items)] * (nthreads + 1 - len(bounds))
    return np.asarray(bounds, dtype=np.int64), np.asarray(items, dtype=np.int64).reshape(-1, 3)


def _with_tails(sizes, bounds, items, torch_threads, step):
    """``partition``'s shares with each item cut where torch's tails start and end."""
    spans = {}
    out, new_bounds = [], [0]
    for w in range(len(bounds) - 1):
        for j, lo, hi in items[bounds[w] : bounds[w + 1]].tolist():
            if j not in spans:
                spans[j] = tail_spans(int(sizes[j]), torch_threads, step)
            for a, b in spans[j]:
                if b <= lo or a >= hi:
                    continue
                if lo < a:
                    out.append((j, lo, a, 0))
                out.append((j, max(lo, a), min(hi, b), 1))
                lo = min(hi, b)
            if lo < hi:
                out.append((j, lo, hi, 0))
        new_bounds.append(len(out))
    return np.asarray(new_bounds, dtype=np.int64), np.asarray(out, dtype=np.int64).reshape(-1, 4)


def pack_layout(bounds, items, rows) -> np.ndarray:
    """A launch's ``layout``: ``[items offset, rows offset, *bounds, *items (3 or 4 per item),
    *rows]`` in one int64 array (one argument: each array argument costs its own unboxing).
    ``bounds`` and ``items`` as ``partition`` returns them; ``rows[j]``: parameter ``j``'s row of
    ``scalar_rows``."""
    head = 2 + len(bounds)
    return np.concatenate(
        [np.asarray([head, head + items.size], dtype=np.int64), bounds, items.reshape(-1), rows]
    ).astype(np.int64, copy=False)


# a layout with no item: a call that compiles a kernel and runs nothing
EMPTY_LAYOUT = pack_layout(
    np.zeros(2, dtype=np.int64), np.zeros((0, 3), dtype=np.int64), np.zeros(1, np.int64)
)


class AddressTable:
    """The addresses a launch reads: a row of ``data_ptr()`` per program tensor, refreshed for a
    column only when its list of tensors is a new one (the gradients, every step)."""

    def __init__(self, names, params, dtypes=None):
        self.names = names
        self.params = params
        # each row's dtype (float32 but for a pairing's gradients and partners)
        self.dtypes = [(dtypes or {}).get(n) or torch.float32 for n in names]
        self.sizes = [p.numel() for p in params]
        self.total = sum(self.sizes)
        self.addresses = np.zeros((len(names), len(params)), dtype=np.int64)
        self.grad_row = names.index("grad") if "grad" in names else None
        self.columns = [None] * len(names)
        self.volatile = [False] * len(names)  # a new list of tensors every step (the grads)
        self._layouts: dict = {}

    def update(self, row: int, column):
        if column is self.columns[row]:
            return
        if self.names[row] == "sr_ids":  # each parameter's id (ints), not an address
            self.addresses[row] = column
            self.columns[row] = column
            return
        if type(column) is not Checked and (
            [t.numel() for t in column] != self.sizes
            or not all([t.dtype is self.dtypes[row] and t.is_contiguous() for t in column])
        ):
            raise ValueError(
                f"numba engine: {self.names[row]!r} tensors must be contiguous {self.dtypes[row]} of "
                "the parameters' sizes"
            )
        self.addresses[row] = [t.data_ptr() for t in column]
        self.volatile[row] = self.volatile[row] or self.columns[row] is not None
        self.columns[row] = column

    def release_volatile(self):
        """Drop the references to columns that change every step (so a step's gradients are
        freed when the caller drops them); the next step refreshes their row."""
        for row, volatile in enumerate(self.volatile):
            if volatile:
                self.columns[row] = None

    def layout(self, nthreads, rows, tails=None):
        """The launch's ``layout`` (``pack_layout``) for ``nthreads`` and the rows ``rows``;
        ``tails`` as ``partition``'s."""
        key = (nthreads, rows.tobytes(), tails)
        hit = self._layouts.get(key)
        if hit is None:
            # parameters outside every segment (row -1) are not run
            skipped = rows.min() < 0 if len(rows) else False
            sizes = np.where(rows >= 0, self.sizes, 0) if skipped else self.sizes
            hit = self._layouts[key] = pack_layout(*partition(list(sizes), nthreads, tails), rows)
        return hit
