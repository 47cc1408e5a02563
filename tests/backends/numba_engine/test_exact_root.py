"""torch's ``rsqrt`` from the CPU's estimates (``numba_engine/exact_root.py``): the probe's
coverage, each exact kind this CPU runs bit for bit on it, the fallback where the probe fails,
and Adafactor's staged kernels with each kind, bit for bit torch's for-loop.
"""

import numpy as np
import pytest
import torch

import roundpipe.optim as ro
from roundpipe.optim.backends.numba_engine import config, probes
from roundpipe.optim.backends.numba_engine import staged as numba_staged
from tests._util import assert_bits_equal

EXACT = [
    k for k in config.ROOT_KINDS[1:] if all(f in probes.target_features() for f in config.ROOT_FEATURES[k])
]


def _bits(x):
    return set(x.view(torch.int32).tolist())


def test_the_probe_covers_two_binades_and_every_class():
    x = probes.root_probe_values()
    bits = _bits(x)
    assert set(range(0x3F800000, 0x40800000)) <= bits  # every float in [1, 4)
    assert {0, -(2**31), 0x7F800000, -0x800000, 0x7F7FFFFF, 0x0D800000} <= bits  # +-0, +-inf, max, 2**-100
    assert torch.isnan(x).any() and (x < 0).any()
    assert (x > 0).logical_and(x < 2.0**-126).sum() > 1000  # subnormals
    assert (x > 0).logical_and(x < 2.0**-100).logical_and(x >= 2.0**-126).sum() > 100  # below the fast path
    assert (x >= 2.0**127).logical_and(x < float("inf")).sum() > 100_000  # the top binade


@pytest.mark.parametrize("kind", EXACT)
def test_each_exact_kind_is_torchs_rsqrt(kind):
    """On the probe's values, and on a count that leaves a remainder of each block."""
    x = probes.root_probe_values()
    x = x[: x.numel() - x.numel() % 512 - 13]
    out = torch.empty_like(x)
    numba_staged._run_root(kind, x, out)
    assert np.array_equal(probes.float_bits(out.numpy()), probes.float_bits(torch.rsqrt(x).numpy()))


def test_a_failed_probe_takes_the_divider(monkeypatch):
    """A kind whose results differ from torch's by one bit, or that cannot compile, is not taken."""

    def off_by_one(kind, x, out):
        out.copy_(torch.rsqrt(x))
        out.view(torch.int32)[12345] += 1

    def unavailable(kind, x, out):
        raise RuntimeError("no such intrinsic")

    assert probes.find_root_kind(lambda kind, x, out: out.copy_(torch.rsqrt(x))) == (
        EXACT[0] if EXACT else "divider"
    )
    assert probes.find_root_kind(off_by_one) == "divider"
    assert probes.find_root_kind(unavailable) == "divider"


def _adafactor_against_torch(shapes, steps=3, scale=1e-3, **kwargs):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    refs = [p.detach().clone().requires_grad_() for p in params]
    opt = ro.Adafactor(params, backend="fast:numba", **kwargs)
    ref = torch.optim.Adafactor(refs, foreach=False, **kwargs)
    for _ in range(steps):
        for p, q in zip(params, refs, strict=True):
            p.grad = torch.randn(p.shape, generator=gen) * torch.rand((), generator=gen) * scale
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, q in zip(params, refs, strict=True):
            assert_bits_equal(p, q)


# rows a whole number of lanes long, rows that are not (each element in turn), a row longer than a
# block, vectors (whole and with a block remainder), a batch of matrices, one element
SHAPES = [(64, 1040), (33, 17), (3, 2053), (4096,), (1031,), (2, 5, 24), (1,)]


@pytest.mark.parametrize("kind", EXACT)
def test_adafactor_with_each_exact_kind_is_torchs(kind, monkeypatch):
    monkeypatch.setattr(numba_staged, "_root", kind)
    _adafactor_against_torch(SHAPES, lr=0.05, weight_decay=0.1, maximize=True)
    # gradients of 1e-20 and no floor: squares below 2**-100 and subnormal, on the divider's side
    # of the fast path's check
    _adafactor_against_torch(SHAPES, scale=1e-20, lr=0.05, eps=(1e-35, 1e-3))


def test_a_failed_probe_still_gives_torchs_bits(monkeypatch):
    """With the exact root asked for and its probe failing, the kernels divide, bit for bit."""
    monkeypatch.setattr(config, "EXACT_ROOT", True)
    monkeypatch.setattr(numba_staged, "_root", None)

    def wrong(kind, x, out):
        out.copy_(torch.rsqrt(x) * 1.0000001)

    monkeypatch.setattr(numba_staged, "_run_root", wrong)
    assert numba_staged.root_kind() == "divider"
    _adafactor_against_torch(SHAPES, lr=0.05, weight_decay=0.1)
