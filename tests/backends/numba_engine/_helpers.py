"""What the numba engine's tests share: the engine, a bit-for-bit comparison that knows whether
the engine models this torch exactly, and one program that uses every IR function."""

import torch

from roundpipe.optim import backends
from roundpipe.optim.backends import fast
from roundpipe.optim.spec.ir import add, addcmul

from .._common import INPUTS, every_function_builder

# a parameter stepped where it lives (not batched into flat buffers)
LARGE = fast.SMALL_NUMEL + 5


def engine():
    """The numba engine of backend="fast:numba"."""
    return backends.get("fast:numba").numba_engine()


def exact():
    """Whether the engine models this torch's rounding exactly (it measures it: torch_fusion,
    torch_sqrt)."""
    return engine().exact


def assert_bits(a, b, msg=""):
    """Equal bit for bit (a NaN equals any NaN: payloads are not specified)."""
    a, b = a.detach(), b.detach()
    if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b):
        return  # the common case, quickly (torch.equal is False where there are NaNs)
    if exact():
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{msg}: {m}")
    else:  # a torch that rounds in a way the engine does not model: only close
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True, msg=lambda m: f"{msg}: {m}")


def every_function_program():
    """``_common.every_function_program`` and a snapshot: a ``let`` of ``param`` that later
    writes to ``param`` must not change (the kernels keep it in a local of its own)."""
    b, (param, grad, buf, acc) = every_function_builder()
    old = b.let("old", param)  # a snapshot: later writes to param do not change it
    b.assign(
        param, addcmul(param, grad, grad, value=1.0) + add(old, buf, alpha=-1.0) + add(old, buf, alpha=1.0)
    )
    b.assign(buf, old * 2.0)
    return b.build()


SCALARS = dict(
    wd=0.1, beta=0.9, one_minus_beta=0.1, eps=1e-8, one=1.0, lo=-0.3, hi=0.3, neg_lr=-0.01, lr=0.01
)


def inputs(n=1000, seed=0):
    """``n`` elements of each input, with NaN, infinities, signed zeros and extremes."""
    g = torch.Generator().manual_seed(seed)
    t = {k: torch.randn(n, generator=g) for k in INPUTS}
    t["acc"] = t["acc"].abs()
    special = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-45, -3e38, 0.5, -2.0]
    for j, k in enumerate(INPUTS):
        for i, v in enumerate(special):
            t[k][10 * j + i] = v
    return t


def opt_program(opt):
    """The program an optimizer's (only) group steps with."""
    group = opt.param_groups[0]
    return opt.spec.program(opt.spec.options(group))
