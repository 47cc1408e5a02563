"""Shared helpers for the unit tests: the optimizer list, small deterministic problems, and
comparisons of parameters and optimizer state.

The numerical option grid against torch lives in ``conformance/``; these helpers only build
small problems for API and integration tests.
"""

from __future__ import annotations

import copy
import io
import itertools
import math
import threading

import torch

import roundpipe.optim
from roundpipe.optim.spec import SPECS

# Every optimizer, from the spec registry (the one list of names)
OPTIMIZER_NAMES = list(SPECS)
# every engine: "fast" is its default engine, numba (or the torch engine where numba fails)
BACKENDS = ["fast", "fast:torch", "fast:numexpr", "reference"]
ENV_VAR = "ROUNDPIPE_OPTIM_BACKEND"
ENGINE_ENV_VAR = "ROUNDPIPE_OPTIM_ENGINE"
THREADS_ENV_VAR = "ROUNDPIPE_OPTIM_NUM_THREADS"

# Hyperparameters that switch on the optimizer's state and optional branches (all valid for
# torch), for tests that train a few steps and compare: each spec's ``rich_kwargs``, so that a
# new optimizer brings its own (copies: a test may add to them).
RICH_KWARGS = {name: dict(spec.rich_kwargs) for name, spec in SPECS.items()}

# float32 tolerances for runs that must agree up to rounding
TOL = dict(rtol=2e-5, atol=2e-6)


def rp_class(name: str):
    """The roundpipe.optim class."""
    return getattr(roundpipe.optim, name)


def torch_class(name: str):
    return getattr(torch.optim, name)


def _randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


# (group, shape, dtype) of the parameters of the standard small problem: two groups, the
# second with its own lr, one complex64 parameter.
PARAM_LAYOUT = [
    (0, (3, 4), torch.float32),
    (0, (5,), torch.float32),
    (1, (2, 3), torch.float32),
    (1, (4,), torch.complex64),
]


def make_params(seed: int = 0):
    """Fresh leaf parameters of PARAM_LAYOUT with deterministic values."""
    return [
        torch.nn.Parameter(_randn(shape, dtype, seed * 100 + i))
        for i, (_, shape, dtype) in enumerate(PARAM_LAYOUT)
    ]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def groups(params, second_lr: float = 0.003):
    """Two param groups over make_params()' parameters; the second overrides lr."""
    g0 = [p for p, (g, _, _) in zip(params, PARAM_LAYOUT, strict=True) if g == 0]
    g1 = [p for p, (g, _, _) in zip(params, PARAM_LAYOUT, strict=True) if g == 1]
    return [{"params": g0}, {"params": g1, "lr": second_lr}]


def set_grads(params, step: int, seed: int = 1):
    """Give each parameter a deterministic gradient for step ``step`` (independent of values)."""
    for i, p in enumerate(params):
        p.grad = _randn(p.shape, p.dtype, 10_000 * seed + 100 * step + i)


def run_steps(opt, params, steps, seed: int = 1):
    """``opt.step()`` once for each step index in ``steps``, with set_grads' gradients."""
    for k in steps:
        set_grads(params, k, seed)
        opt.step()


def roundtrip(obj):
    """``obj`` through torch.save / torch.load (what a checkpoint does)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def assert_params_close(a, b, **tol):
    tol = tol or TOL
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        torch.testing.assert_close(x.detach(), y.detach(), msg=lambda m, i=i: f"param {i}: {m}", **tol)


def assert_state_dicts_close(sd_a, sd_b, **tol):
    """Same layout (group keys and values, state keys, types, dtypes, shapes), close values."""
    tol = tol or TOL
    assert set(sd_a) == set(sd_b) == {"state", "param_groups"}
    assert len(sd_a["param_groups"]) == len(sd_b["param_groups"])
    for ga, gb in zip(sd_a["param_groups"], sd_b["param_groups"], strict=True):
        assert set(ga) == set(gb), (sorted(ga), sorted(gb))
        for k in ga:
            assert _plain(ga[k]) == _plain(gb[k]), (k, ga[k], gb[k])
    assert sorted(sd_a["state"]) == sorted(sd_b["state"])
    for pid, sa in sd_a["state"].items():
        sb = sd_b["state"][pid]
        assert sorted(sa) == sorted(sb), (pid, sorted(sa), sorted(sb))
        for k, va in sa.items():
            vb = sb[k]
            assert type(va) is type(vb), (pid, k, type(va), type(vb))
            if isinstance(va, torch.Tensor):
                assert va.dtype == vb.dtype and va.shape == vb.shape, (pid, k, va, vb)
                torch.testing.assert_close(
                    va, vb, msg=lambda m, pid=pid, k=k: f"state[{pid}][{k}]: {m}", **tol
                )
            elif isinstance(va, float):
                assert math.isclose(va, vb, rel_tol=1e-6), (pid, k, va, vb)
            else:
                assert va == vb, (pid, k, va, vb)


def _plain(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", v.tolist())
    if isinstance(v, tuple | list):
        return type(v)(_plain(x) for x in v)
    return v


def snapshot(opt):
    """Everything a failed step must leave alone: params, grads, state (entries and objects)."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            out.append(
                (
                    p,
                    _copy_tensor(p),
                    p.grad,
                    None if p.grad is None else _copy_tensor(p.grad),
                    {
                        k: (v, _copy_tensor(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                        for k, v in state.items()
                    },
                )
            )
    return out


def _copy_tensor(t):
    t = t.detach()
    return t if t.device.type == "meta" else t.clone()


_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_mismatch(a, b, nan_bits: bool = False) -> str | None:
    """None if ``a`` and ``b`` are equal bit for bit, else where they first differ.

    Floating-point values are compared as integers of their width (an int32 view for float32,
    so ``-0.0`` differs from ``0.0``), with NaNs matched by position (a NaN's payload and sign
    are not specified by torch: NaN must meet NaN, any NaN) unless ``nan_bits`` (the 16-bit
    suites: a NaN's bits too); complex values as their real and imaginary parts. Dtype, shape
    and layout must agree; meta tensors compare only those.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.device.type == "meta" or b.device.type == "meta":
        return None if a.device == b.device else f"device {a.device} vs {b.device}"
    if a.layout != torch.strided or b.layout != torch.strided:
        if a.layout != b.layout:
            return f"layout {a.layout} vs {b.layout}"
        a, b = a.to_dense(), b.to_dense()
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.is_complex():
        a, b = torch.view_as_real(a).reshape(-1), torch.view_as_real(b).reshape(-1)
    if a.numel() == 0:
        return None
    if a.is_floating_point():
        bits = _INT_OF[a.element_size()]
        differ = a.view(bits) != b.view(bits)
        if not nan_bits:
            differ &= ~(torch.isnan(a) & torch.isnan(b))
    else:
        differ = a != b
    if not bool(differ.any()):
        return None
    where = torch.nonzero(differ).flatten()
    i = int(where[0])
    hexes = ""
    if a.is_floating_point():
        mask = (1 << (8 * a.element_size())) - 1
        ai, bi = (int(x[i : i + 1].view(bits)) & mask for x in (a, b))
        hexes = f" (bits {ai:#x} vs {bi:#x})"
    return (
        f"{len(where)} of {a.numel()} elements differ in their bits; "
        f"first at flat index {i}: {a[i].item()!r} vs {b[i].item()!r}{hexes}"
    )


def bits_equal(a, b) -> bool:
    """``a`` and ``b`` equal bit for bit (``bits_mismatch``)."""
    return bits_mismatch(a, b) is None


def assert_bits_equal(a, b, msg: str = "") -> None:
    """Raise AssertionError naming ``msg`` unless ``a`` and ``b`` are equal bit for bit."""
    why = bits_mismatch(a, b)
    if why is not None:
        raise AssertionError(f"{msg}: {why}" if msg else why)


def assert_unchanged(opt, snap):
    """Nothing in ``snap`` (from :func:`snapshot`) changed, bit for bit, and no state was added."""
    flat = [p for group in opt.param_groups for p in group["params"]]
    assert len(flat) == len(snap) and all(a is s[0] for a, s in zip(flat, snap, strict=True))
    for i, (p, p_copy, grad, grad_copy, state) in enumerate(snap):
        assert bits_equal(p.detach(), p_copy), f"param {i} was modified"
        assert p.grad is grad, f"param {i}: grad object replaced"
        if grad is not None:
            assert bits_equal(p.grad.detach(), grad_copy), f"param {i}: grad was modified"
        now = opt.state.get(p, {})
        assert sorted(now) == sorted(state), f"param {i}: state keys changed {sorted(state)} -> {sorted(now)}"
        for k, (obj, val) in state.items():
            assert now[k] is obj, f"param {i}: state[{k!r}] replaced"
            if isinstance(val, torch.Tensor):
                assert bits_equal(now[k].detach(), val), f"param {i}: state[{k!r}] was modified"
            else:
                assert now[k] == val, f"param {i}: state[{k!r}] was modified"


# ---------------------------------------------------------------------------------------------
# specs: every program a spec can build


def default_group(spec, **kwargs):
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    opt = spec.torch_class([p], **kwargs)
    return opt.param_groups[0], p


def spec_scalars(spec, group, p, state):
    """spec.scalars for this parameter: it sees only the 0-d state entries."""
    return spec.scalars(group, {k: state[k] for k in spec.scalar_state if k in state})


def discovered_flags(spec, group, p):
    """The per-step flags init_state and scalars return on a first step (bool values)."""
    state = {}
    flags = dict(spec.init_state(group, p, state) or {})
    for k, v in spec_scalars(spec, group, p, state).items():
        if isinstance(v, bool):
            flags[k] = v
    return flags


def all_programs(spec):
    """(options, program) for every combination of the spec's boolean options and flags."""
    group, p = default_group(spec)
    base = dict(spec.options(group))
    base.update(discovered_flags(spec, group, p))
    base.update({f: base.get(f, False) for f in spec.flags})
    toggles = sorted(k for k, v in base.items() if isinstance(v, bool))
    out = []
    for values in itertools.product([False, True], repeat=len(toggles)):
        opts = {**base, **dict(zip(toggles, values, strict=True))}
        out.append((opts, spec.program(opts)))
    return out


def run_threads(timeout: float, targets) -> None:
    """Run each callable in its own thread; fail on a hang (``timeout`` seconds per thread);
    re-raise the first exception in the calling thread."""
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported below, in the calling thread
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), f"a thread did not finish in {timeout} s (hang)"
    if errors:
        raise errors[0]


def count_calls(monkeypatch, obj, *names) -> dict:
    """Wrap the methods ``names`` of ``obj`` (through ``monkeypatch``) to count their calls:
    the returned dict, by name, grows as they are called."""
    calls = dict.fromkeys(names, 0)

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in names:
        monkeypatch.setattr(obj, name, counting(name, getattr(obj, name)))
    return calls
