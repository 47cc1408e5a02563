"""How a staged pass's launch lays out its parameters (``staged``): each parameter as a batch of
matrices (``matrix_dims``), the kernel's items (an elementwise kernel's pieces of about
``ITEM_NUMEL`` elements, a reducing kernel's parameters spread over the threads) and its rows of
scalars.
"""

from __future__ import annotations

import numpy as np

# an elementwise kernel's items: at least this many elements each, where a parameter has them
ITEM_NUMEL = 1 << 16


def matrix_dims(t) -> tuple:
    """``(matrices, rows, columns)`` of a parameter as a pass sees it: a tensor of two or more
    dimensions is a batch of matrices over its last two; anything else one row."""
    if t.dim() < 2:
        return 1, 1, t.numel()
    m, n = t.shape[-2], t.shape[-1]
    nb = 1
    for s in t.shape[:-2]:
        nb *= s
    return nb, m, n


def column_norms_reproduced(dims) -> bool:
    """Whether the column loop reproduces torch's column norm (``dim=-2``) of a parameter of
    ``dims``: a column vector's (``n == 1``, more than one row) is torch's lane-wise norm of a
    contiguous run, which it does not follow (such a parameter's pass runs torch's ops)."""
    nb, m, n = dims
    return n != 1 or m == 1


def work_items(dims) -> np.ndarray:
    """An elementwise kernel's items: ``(p, r0, r1, j0, j1)``, about ``ITEM_NUMEL`` elements."""
    items = []
    for p, (nb, m, n) in enumerate(dims):
        rows = nb * m
        if rows == 0 or n == 0:
            continue
        if rows == 1:
            step = max(ITEM_NUMEL, 16)
            items += [(p, 0, 1, j, min(n, j + step)) for j in range(0, n, step)]
        else:
            per = max(1, ITEM_NUMEL // n)
            items += [(p, r, min(rows, r + per), 0, n) for r in range(0, rows, per)]
    return np.asarray(items, dtype=np.int64).reshape(-1, 5)


def thread_schedule(dims, nthreads) -> np.ndarray:
    """A reducing kernel's items: the parameters spread over the threads by size (the largest
    first to the least loaded: each runs on one thread, its reductions being sequential), as
    ``nthreads`` equal runs of rows, padded with -1, since numba's parallel loop gives each
    thread an equal run of iterations."""
    sizes = [int(nb * m * n) for nb, m, n in dims]
    loads, shares = [0] * nthreads, [[] for _ in range(nthreads)]
    for p in sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True):
        th = loads.index(min(loads))
        loads[th] += sizes[p] + 1
        shares[th].append(p)
    width = max(len(share) for share in shares) if sizes else 0
    items = np.full((nthreads * width, 5), -1, dtype=np.int64)
    for th, share in enumerate(shares):
        items[th * width : th * width + len(share), 0] = share
    return items


_row_plans: dict = {}  # a kernel's scalar names -> (the scalars they read, the complements' columns)


def pack_scalar_rows(names, consts, scalars) -> np.ndarray:
    """The kernel's float32 rows of scalars (``names``: its ``s_*`` variables, a lerp weight's
    complement ``s_<w>__m1`` as ``float32(w) - 1``), then its constants, for each parameter."""
    plan = _row_plans.get((names, consts))
    if plan is None:
        columns = tuple((n[2:-4], True) if n.endswith("__m1") else (n[2:], False) for n in names)
        plan = _row_plans[(names, consts)] = (columns, [float(c) for c in consts])
    columns, tail = plan
    complements: dict = {}  # weight -> float32(weight) - 1, taken once per distinct weight

    def complement(w):
        c = complements.get(w)
        if c is None:
            c = complements[w] = float(np.float32(w) - np.float32(1.0))
        return c

    # (numpy rounds each Python float to the nearest float32, as torch casts a scalar)
    flat = [v for s in scalars for v in (*[complement(s[b]) if m1 else s[b] for b, m1 in columns], *tail)]
    return np.array(flat, dtype=np.float32).reshape(len(scalars), len(names) + len(consts))
