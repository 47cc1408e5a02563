"""A launch's layout (``numba_engine/layout.py``): each thread's share of the step's elements,
and fewer threads for small steps."""

import numba

import roundpipe.optim
from roundpipe.optim.backends import numba_engine

from ._helpers import engine


def test_work_is_split_evenly_and_small_steps_run_serially(monkeypatch):
    """Every element is in exactly one thread's share, shares differ by at most ALIGN elements
    (plus the last's remainder), and a step with under PARALLEL_MIN_NUMEL elements per thread
    runs fewer threads (the serial loop when that is one)."""
    sizes = [0, 1, 5, 1000, 70000, 33, 100000, 17]
    for nthreads in (1, 2, 3, 8):
        bounds, items = numba_engine.partition(sizes, nthreads)
        assert len(bounds) == nthreads + 1 and bounds[0] == 0 and bounds[-1] == len(items)
        covered = {}
        for j, lo, hi in items.tolist():
            assert 0 <= lo < hi <= sizes[j]
            covered.setdefault(j, []).append((lo, hi))
        for j, n in enumerate(sizes):
            spans = sorted(covered.get(j, []))
            assert sum(hi - lo for lo, hi in spans) == n and all(
                a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)
            )
        shares = [
            sum(items[it, 2] - items[it, 1] for it in range(bounds[w], bounds[w + 1]))
            for w in range(nthreads)
        ]
        assert max(shares[:-1] or [0]) - min(shares[:-1] or [0]) <= numba_engine.ALIGN, shares
    be = engine()
    monkeypatch.setattr(roundpipe.optim.threads, "_num_threads", 2)
    assert be._threads(2 * numba_engine.PARALLEL_MIN_NUMEL - 1) == 1
    if numba.config.NUMBA_NUM_THREADS >= 2:
        assert be._threads(2 * numba_engine.PARALLEL_MIN_NUMEL) == 2
