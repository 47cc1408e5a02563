"""Helpers shared by the tests that compare a roundpipe optimizer with ``torch.optim``: the
optimizers with ``RICH_KWARGS``, outcomes (a result or an exception) to compare, checkpoints
through ``torch.load(weights_only=True)``, and a two-group Adam whose every parameter and state
entry is compared with torch's position by position."""

from __future__ import annotations

import io

import torch

import roundpipe.optim
from roundpipe.optim import backends
from roundpipe.optim.backends import CompileCache, fast, numba_engine
from roundpipe.optim.backends.numba_engine import kernels
from tests._util import BACKENDS, RICH_KWARGS, TOL, assert_bits_equal, rp_class, torch_class

# the exceptions a refused step (or torch's) raises
ERRORS = (TypeError, ValueError, RuntimeError, KeyError)


def torch_opt(name, params, **extra):
    # on CPU tensors torch.optim defaults to its for-loop (foreach=False) implementation
    return torch_class(name)(params, **{**RICH_KWARGS[name], **extra})


def rp_opt(name, params, backend, **extra):
    return rp_class(name)(params, backend=backend, **{**RICH_KWARGS[name], **extra})


def outcome(fn):
    """``("ok", result)`` or ``("error", exception)``."""
    try:
        return "ok", fn()
    except Exception as e:  # every exception is an outcome to compare
        return "error", e


def save_load(obj):
    """``obj`` through torch.save and ``torch.load(weights_only=True)`` (a safe checkpoint load)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _real(t):
    t = t.detach()
    return torch.view_as_real(t) if t.is_complex() else t


def nonfinite_mismatch(a, b, **tol):
    """None if ``a`` and ``b`` have NaN, +Inf and -Inf at the same positions and close finite
    values elsewhere (complex tensors compared as their real views), else a description."""
    a, b = _real(a), _real(b)
    for what, f in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        ma, mb = f(a), f(b)
        if not torch.equal(ma, mb):
            where = torch.nonzero(ma != mb).tolist()[:4]
            return f"{what} positions differ at {where}: roundpipe {a[ma].numel()}, torch {b[mb].numel()}"
    finite = torch.isfinite(a)
    tol = tol or TOL
    if not torch.allclose(a[finite], b[finite], **tol):
        return f"finite values differ: max abs diff {(a[finite] - b[finite]).abs().max().item()}"
    return None


# every engine: the backend fixture's, and the numba engine pinned (no fallback)
ALL_BACKENDS = [*BACKENDS, "fast:numba"]
LARGE = fast.SMALL_NUMEL + 5  # stepped where it lives (not batched) by the torch/numexpr engines


def seeded_randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def claims_exact(backend: str) -> bool:
    """Whether ``backend`` claims torch's for-loop bit for bit (fast: as its probes find)."""
    be = backends.get(backend)
    return getattr(be, "exact", True)


def fresh_compile_caches(monkeypatch):
    """Empty process-wide compile caches, so that a compilation really happens in this test
    (numba's probes run first: they compile a kernel of their own, which a fault must not hit)."""
    numba_engine.torch_fusion()
    numba_engine.torch_sqrt()
    numba_engine.sqrt_kind()
    monkeypatch.setattr(kernels, "_kernels", CompileCache())
    monkeypatch.setattr(fast, "_torch_programs", CompileCache())
    monkeypatch.setattr(fast, "_numexpr_programs", CompileCache())


def all_params(opt):
    return [p for group in opt.param_groups for p in group["params"]]


def set_position_grads(opt, step):
    """A deterministic gradient for every parameter of ``opt``, by position (group, index)."""
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            p.grad = seeded_randn(p.shape, 10_000 * step + 100 * gi + pi, p.dtype)


def assert_same_as_torch(ours, theirs, exact: bool):
    """Every parameter and state entry of ``ours`` equals torch's, position by position (bit for
    bit where ``exact``, else within TOL)."""
    pa, pb = all_params(ours), all_params(theirs)
    assert len(pa) == len(pb)

    def same(a, b, what):
        if exact:
            assert_bits_equal(a, b, what)
        else:
            torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}", **TOL)

    for i, (p, q) in enumerate(zip(pa, pb, strict=True)):
        same(p.detach(), q.detach(), f"param {i}")
        sa, sb = ours.state.get(p, {}), theirs.state.get(q, {})
        assert sorted(sa) == sorted(sb), (i, sorted(sa), sorted(sb))
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                same(v, sb[k], f"param {i}: state[{k!r}]")
            else:
                assert v == sb[k], (i, k, v, sb[k])


# two groups with different programs (weight decay; amsgrad): a step has two launches
ADAM_SHAPES = [(3, 4), (5,), (LARGE,), (2, 3), (7,)]
ADAM_SPLIT = 3  # params[:ADAM_SPLIT] in group 0


def two_group_adam(backend, seed=0):
    params = [torch.nn.Parameter(seeded_randn(s, 100 * seed + i)) for i, s in enumerate(ADAM_SHAPES)]
    groups = [
        {"params": params[:ADAM_SPLIT], "weight_decay": 0.1},
        {"params": params[ADAM_SPLIT:], "amsgrad": True, "lr": 0.003},
    ]
    if backend is None:
        return torch.optim.Adam(groups, lr=0.01, foreach=False)
    return roundpipe.optim.Adam(groups, lr=0.01, backend=backend)
