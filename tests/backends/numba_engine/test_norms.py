"""The gradients' norm sums (``numba_engine/norms.py``): float64 sums of each stored dtype, the
same bits on any thread count, and infs and NaNs where a norm has them."""

import math

import numpy as np
import pytest
import torch

from roundpipe.optim import threads
from roundpipe.optim.backends.numba_engine import gradient_sums, norms_supported

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grads(dtype, sizes=(0, 1, 17, 2**15, 2**15 + 1, 3 * 2**15 + 5, 200_001)):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, generator=g) * 7).to(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", [1.0, 2.0, math.inf])
def test_sums_are_the_float64_sums(dtype, order):
    grads = _grads(dtype, (1, 17, 2**15, 2**15 + 1, 200_001))
    sums = gradient_sums(grads, order)
    for g, s in zip(grads, sums, strict=True):
        x = g.double().abs()
        expected = (x * x).sum() if order == 2.0 else x.sum() if order == 1.0 else x.max()
        assert s == pytest.approx(expected.item(), rel=1e-13)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_bits_on_any_thread_count(dtype):
    grads = _grads(dtype)
    before = threads.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            threads.set_num_threads(n)
            results.append(gradient_sums(grads, 2.0))
    finally:
        threads.set_num_threads(before)
    assert np.array_equal(results[0].view(np.int64), results[1].view(np.int64))
    assert results[0][0] == 0.0  # the empty tensor


@pytest.mark.parametrize("dtype", DTYPES)
def test_infs_and_nans(dtype):
    g = torch.ones(100, dtype=dtype)
    g[50] = float("inf")
    assert gradient_sums([g], 2.0)[0] == math.inf
    assert gradient_sums([g], 1.0)[0] == math.inf
    assert gradient_sums([g], math.inf)[0] == math.inf
    g[7] = float("nan")
    for order in (1.0, 2.0, math.inf):
        assert math.isnan(gradient_sums([g], order)[0])


def test_the_largest_finite_values_give_a_finite_sum():
    """A finite gradient never reads as an overflow (loss scaling would skip its step)."""
    for dtype in DTYPES:
        big = torch.full((2**16,), torch.finfo(dtype).max, dtype=dtype)
        assert math.isfinite(gradient_sums([big], 2.0)[0])


def test_what_the_pass_reads():
    assert norms_supported([torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)])
    assert not norms_supported([torch.zeros(4)[::2]])  # not contiguous
    assert not norms_supported([torch.zeros(3, dtype=torch.float64)])
    assert not norms_supported([torch.zeros(3, device="meta")])
