"""The conformance harness: parameters, gradients, the lockstep run and the error statistics.

One case (``cases.Case``) on one backend (``cases.BACKENDS``) is checked as follows:

* three runs step identical copies of ``PARAMS``: ``torch.optim.<Name>(params, **kwargs)``,
  built as a user builds it (on CPU, torch resolves ``foreach=None`` to its for-loop
  implementation), ``roundpipe.optim.<Name>(params, **kwargs, backend="reference")`` and the
  same with ``backend=<the backend under test>``;
* at every step each run gets the same fresh gradients (``gradients(step)``, seeded, cloned per
  run); on the steps where ``step % CLOSURE_EVERY == CLOSURE_EVERY - 1`` the gradients are set
  inside a closure passed to ``step(closure)``. After each step, a run must have left its
  gradients unmodified;
* after every step, the backend's optimizer is compared with torch's:

  - the loss ``step()`` returned (equal);
  - the structure of ``state_dict()``: the same parameter ids in ``['state']`` (no entry where
    torch has none, even an empty one), the same keys per parameter, and ``['param_groups']``
    equal entry by entry (every key, every value; tensors by value, dtype and shape);
  - every parameter and every state value: on a backend of ``cases.BIT_EXACT`` (see
    ``exact_backend``) tensors bit for bit (``bits_mismatch``: an integer view of the same
    width, so ``-0.0 != 0.0``; NaN must meet NaN at the same position, any NaN; complex as its
    real and imaginary parts; dtype and shape checked); on any other backend with
    ``torch.testing.assert_close`` at its defaults for their dtype (float32: rtol=1.3e-6,
    atol=1e-5; dtype and shape checked); other values equal;

  and, for a backend other than ``reference``, its parameters and state values are compared
  the same way with the reference backend's (recorded as ``<backend>-vs-reference``; bit for
  bit where the backend is, the reference backend being bit for bit torch's). A deviation
  declared in ``deviations.py`` replaces assert_close's tolerances for the cases and
  comparisons it covers (and so the bit-for-bit comparison: a declared deviation is a
  difference);
* a case's ``expect``ed branches must have been reached on torch's trajectory;
* torch (and so roundpipe, which follows torch's thread count) runs on one intra-op thread
  unless ``ROUNDPIPE_CONFORMANCE_THREADS`` says otherwise (see ``conformance_threads``).

The torch and reference runs do not depend on the backend under test: each is stepped once per
case and kept, a snapshot per step (``trajectory``), for the case's tests on every backend. The
backend under test is stepped live and compared step by step, so a failure names its first
failing step.

Comparing fast without comparing less: pairs of tensors that are bitwise equal pass
assert_close by definition and are not examined further; the pairs of one dtype that differ are
checked together, on their concatenation (assert_close's check is elementwise, and dtype, shape,
device and layout are checked per pair first), and only at the elements that differ the errors
below are measured, in double precision. Where those errors are finite and at most half of
assert_close's allowance (``SAFE_RATIO``) the outcome of assert_close is certain (its float32
arithmetic is off by far less than that) and it is not called; otherwise it is, and on a
failure each pair is checked on its own, so the message names the parameter and the state key.

Error statistics (``RECORDER``), per (optimizer, comparison), worst over every element of every
compared tensor (parameters and state) of every step of every case. ``a`` is roundpipe's value
and ``b`` the value it is compared with (torch's, or the reference backend's), both taken in
double precision; complex tensors are measured component by component (as
``torch.view_as_real``, through which torch steps most complex parameters):

* ``max_abs``   = max |a - b|;
* ``max_rel``   = max |a - b| / |b| over the elements with |b| >= float32 tiny
  (1.18e-38, the smallest normal float32); subnormal and zero ``b`` count only in max_abs;
* ``max_ratio`` = max |a - b| / (atol + rtol * |b|) with assert_close's float32 tolerances:
  how much of assert_close's allowance was used (<= 1 passes; for complex tensors assert_close
  measures the modulus of the complex difference, so there the ratio is indicative). Measured
  against the defaults also where a deviation declares a tolerance.

Non-finite values must match exactly (same positions, same values, NaN matching NaN);
otherwise the errors are ``inf``.
"""

from __future__ import annotations

import copy
import math
import os
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

import roundpipe.optim
from roundpipe.optim.backends.low_precision import rounding
from roundpipe.optim.threads import torch_threads

from . import deviations
from .cases import BIT_EXACT, Case

# assert_close's defaults for float32 / complex64 (torch.testing._comparison)
RTOL, ATOL = 1.3e-6, 1e-5
TINY = torch.finfo(torch.float32).tiny
# A difference using at most this share of assert_close's allowance passes it for certain.
SAFE_RATIO = 0.5
# the integer dtype of each floating-point width (bit-for-bit comparisons)
_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}

CLOSURE_EVERY = 4  # steps 3, 7, 11, ... set their gradients in a closure
TORCH = "torch"  # the name of torch's run (the backends' names are cases.BACKENDS)
SHARED_RUNS = (TORCH, "reference")  # stepped once per case, compared with every backend


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the set and how its gradients are made (see ``gradients``)."""

    desc: str
    shape: tuple
    dtype: torch.dtype = torch.float32
    scale: float = 1.0  # gradient scale on every step
    tiny_on_odd_steps: bool = False  # gradient scaled by ``tiny`` on odd steps
    tiny: float = 1e-20
    none_every: int = 0  # grad is None when step % none_every == 0
    zero_every: int = 0  # every zero_every-th gradient element is exactly 0


PARAMS = (
    ParamSpec("3x5", (3, 5)),
    ParamSpec("2x3x4 grad*1e-20", (2, 3, 4), scale=1e-20),
    ParamSpec("1 element", (1,)),
    ParamSpec("0-d", ()),
    ParamSpec("empty (0,)", (0,)),
    ParamSpec("empty (3,0)", (3, 0)),
    ParamSpec("1023 grad*1e-20 on odd steps", (1023,), tiny_on_odd_steps=True),
    ParamSpec("70001 with zero grads", (70001,), zero_every=7),
    ParamSpec("complex 4x7", (4, 7), torch.complex64),
    ParamSpec("complex 5x3 grad*1e-20", (5, 3), torch.complex64, scale=1e-20),
    ParamSpec("complex 33000", (33000,), torch.complex64),
    ParamSpec("7x11 grad None every 3rd step", (7, 11), none_every=3),
)


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _randn(shape, dtype, generator):
    """Normal values of ``dtype``: a bfloat16 or float16 tensor is float32's rounded to it."""
    if dtype in _LOW_PRECISION:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randn(shape, dtype=dtype, generator=generator)


def case_params(case) -> tuple:
    """The parameter set ``case`` steps: its own (``params``, the low-precision cases'), else
    ``PARAMS``."""
    return getattr(case, "params", PARAMS)


def make_params(specs=PARAMS):
    """Fresh leaf tensors with the set's initial values (identical on every call)."""
    g = torch.Generator().manual_seed(1234)
    return [_randn(s.shape, s.dtype, g).requires_grad_() for s in specs]


_grad_cache: dict = {}
_grad_lock = threading.Lock()


def gradients(step: int, specs=PARAMS):
    """The gradients of step ``step``: one tensor (or None) per parameter of ``specs``; cached,
    never mutated."""
    with _grad_lock:
        grads = _grad_cache.get((specs, step))
        if grads is None:
            grads = [step_gradient(i, s, step) for i, s in enumerate(specs)]
            _grad_cache[(specs, step)] = grads
        return grads


def step_gradient(index: int, spec: ParamSpec, step: int):
    if spec.none_every and step % spec.none_every == 0:
        return None
    g = torch.Generator().manual_seed(10_000 * (step + 1) + index)
    low = spec.dtype in _LOW_PRECISION  # made in float32, rounded to it once scaled
    grad = torch.randn(spec.shape, dtype=torch.float32 if low else spec.dtype, generator=g)
    scale = spec.scale * (spec.tiny if spec.tiny_on_odd_steps and step % 2 else 1.0)
    if scale != 1.0:
        grad = grad * scale
    if spec.zero_every:
        grad.view(-1)[:: spec.zero_every] = 0
    return grad.to(spec.dtype) if low else grad


def set_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone()


# ---------------------------------------------------------------------------------------------
# error statistics


@dataclass
class Stats:
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_ratio: float = 0.0
    worst: str = ""  # where max_ratio was reached
    cases: set = field(default_factory=set)
    compared: int = 0  # comparisons recorded (one per step)

    def add(self, case_id, where, errors):
        max_abs, max_rel, max_ratio = errors
        self.compared += 1
        self.cases.add(case_id)
        self.max_abs = max(self.max_abs, max_abs)
        self.max_rel = max(self.max_rel, max_rel)
        if max_ratio > self.max_ratio:
            self.max_ratio = max_ratio
            self.worst = f"{case_id} {where}"

    def as_dict(self):
        return {
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "max_ratio": self.max_ratio,
            "worst": self.worst,
            "cases": len(self.cases),
            "comparisons": self.compared,
        }


class Recorder:
    """Worst errors per (optimizer, comparison), where a comparison is a backend's name (against
    torch) or '<backend>-vs-reference'; and per (declared deviation, comparison) for the cases a
    deviation covers."""

    def __init__(self):
        self.stats: dict[tuple[str, str], Stats] = {}
        self.deviations: dict[tuple[str, str], Stats] = {}
        self.lock = threading.Lock()

    def add(self, optimizer, comparison, case_id, where, errors, deviation=None):
        with self.lock:
            self.stats.setdefault((optimizer, comparison), Stats()).add(case_id, where, errors)
            if deviation is not None:
                st = self.deviations.setdefault((deviation.name, comparison), Stats())
                st.add(case_id, where, errors)


RECORDER = Recorder()


def errors(a: torch.Tensor, b: torch.Tensor):
    """``(max_abs, max_rel, max_ratio, index, finite)`` of ``a`` against ``b`` (same shape and dtype).

    See the module docstring; ``index`` is the flat (element, not component) index where
    max_ratio is reached, or -1; ``finite``: whether every element that differs is finite in
    both. Only the elements that differ are measured (equal ones have no error).
    """
    per_element = 2 if a.is_complex() else 1
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    a, b = a.reshape(-1), b.reshape(-1)
    at = (a != b).nonzero().squeeze(1)  # NaN != NaN: NaNs are among them
    if at.numel() == 0:
        return (0.0, 0.0, 0.0, -1, True)
    a, b = a[at].double(), b[at].double()
    diff = (a - b).abs_()
    max_abs = diff.max().item()
    finite = math.isfinite(max_abs)
    if not finite:
        # Non-finite values must match exactly (same positions, same values, NaN with NaN).
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        same = torch.equal(fa, fb) and bool(((a == b) | (a.isnan() & b.isnan()))[~fa].all())
        if not same:
            bad = (fa != fb) | ((~fa) & ~((a == b) | (a.isnan() & b.isnan())))
            return (math.inf, math.inf, math.inf, int(at[bad.nonzero()[0, 0]]) // per_element, False)
        diff = torch.where(fa, diff, 0.0)
        max_abs = diff.max().item()
        b = torch.where(fb, b, 0.0)
    mag = b.abs()
    ratio = diff / mag.mul(RTOL).add_(ATOL)
    index = int(ratio.argmax())
    max_rel = torch.where(mag >= TINY, diff / mag, 0.0).max().item()
    return (max_abs, max_rel, ratio[index].item(), int(at[index]) // per_element, finite)


# ---------------------------------------------------------------------------------------------
# snapshots and comparisons


class Context:
    """What a failure message says: optimizer, kwargs, run, step."""

    def __init__(self, case: Case, run: str):
        self.case = case
        self.run = run
        self.step = -1

    def __call__(self, what: str) -> str:
        on = "torch.optim" if self.run == TORCH else f"backend={self.run!r}"
        return (
            f"{self.case.optimizer}(kwargs={self.case.kwargs!r}) {on} "
            f"step={self.step} (0-based, of {self.case.steps}): {what}"
        )


def param_label(i: int, specs=PARAMS) -> str:
    s = specs[i]
    return f"param[{i}] ({s.desc}; shape {s.shape}, {str(s.dtype).removeprefix('torch.')})"


@dataclass
class Snapshot:
    """One run after one step: what ``step()`` returned, the parameters and ``state_dict()``'s
    ``state`` (parameter id -> {key: value}) and ``param_groups``. A kept snapshot holds copies;
    any other holds the run's own tensors, valid until its next step."""

    loss: object
    params: list
    state: dict
    param_groups: list


def snapshot(params, opt, loss, keep: bool) -> Snapshot:
    """``opt``'s state now; ``keep``: cloned, so that later steps do not change it."""
    sd = opt.state_dict()
    if not keep:
        return Snapshot(loss, [p.detach() for p in params], sd["state"], sd["param_groups"])
    state = {
        pid: {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in entry.items()
        }
        for pid, entry in sd["state"].items()
    }
    return Snapshot(loss, [p.detach().clone() for p in params], state, copy.deepcopy(sd["param_groups"]))


def same_meta(a, b) -> bool:
    return (a.dtype, a.shape, a.device, a.layout) == (b.dtype, b.shape, b.device, b.layout)


def same_value(a, b) -> bool:
    """Equal as a ``param_groups`` entry: same type, tensors by dtype, shape and value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and same_meta(a, b)
            and torch.equal(a, b)
        )
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_value, a, b))
    return type(a) is type(b) and a == b


def compare_structure(ours: Snapshot, theirs: Snapshot, ctx: Context):
    """``state_dict()``'s structure equals torch's: state entries, their keys, param_groups."""
    if set(ours.state) != set(theirs.state):
        empty = sorted(pid for pid, entry in ours.state.items() if not entry)
        raise AssertionError(
            ctx(
                f"state_dict()['state'] has entries for parameter ids {sorted(ours.state)} "
                f"(empty: {empty}), torch's for {sorted(theirs.state)}"
            )
        )
    for pid, entry in theirs.state.items():
        if set(ours.state[pid]) != set(entry):
            raise AssertionError(
                ctx(
                    f"{param_label(pid, case_params(ctx.case))}: state keys {sorted(ours.state[pid])}, "
                    f"torch's {sorted(entry)}"
                )
            )
    if len(ours.param_groups) != len(theirs.param_groups):
        raise AssertionError(
            ctx(f"{len(ours.param_groups)} param_groups, torch has {len(theirs.param_groups)}")
        )
    for g, (ga, gb) in enumerate(zip(ours.param_groups, theirs.param_groups, strict=True)):
        if list(ga) != list(gb):
            raise AssertionError(
                ctx(f"state_dict()['param_groups'][{g}] has keys {list(ga)}, torch's {list(gb)}")
            )
        for key, vb in gb.items():
            if not same_value(ga[key], vb):
                raise AssertionError(
                    ctx(f"state_dict()['param_groups'][{g}][{key!r}] is {ga[key]!r}, torch's is {vb!r}")
                )


def assert_norm_close(mine: float, torchs: float, exact: float, backend, what="", norm_type=2.0):
    """A clip norm against torch's ``get_total_norm`` (``torchs``) and the float64 norm of the
    same float32 gradients (``exact``): equal to torch's on the composing engines (torch's
    foreach norms); on the numba engine (one pass, float64 sums) within an ulp of ``exact``,
    and within 1e-5 of torch's, whose float32 sums drift from ``exact`` as tensors grow (25
    ulp at 70,001 elements); infs and NaNs where torch has them. Orders other than 1, 2 and
    inf are torch's on every engine."""
    if math.isnan(torchs) or math.isinf(torchs):
        assert repr(mine) == repr(torchs), what
    elif _one_pass(backend) and float(norm_type) in (1.0, 2.0, math.inf):
        assert abs(mine - exact) <= ulp32(exact), f"{what}: {mine!r} vs the float64 norm {exact!r}"
        assert abs(mine - torchs) <= 1e-5 * abs(torchs), f"{what}: {mine!r} vs torch's {torchs!r}"
    else:
        assert mine == torchs, what


def exact_norm(tensors, norm_type=2.0) -> float:
    """The float64 norm of ``tensors`` taken together (0 for none)."""
    flat = [t.detach().double().reshape(-1) for t in tensors]
    return torch.linalg.vector_norm(torch.cat(flat), norm_type).item() if flat else 0.0


def ulp32(x: float) -> float:
    """The spacing of float32 at |x|."""
    return float(np.spacing(np.float32(abs(x))))


def _one_pass(backend) -> bool:
    return getattr(roundpipe.optim.backends.get(backend), "engine", lambda: None)() == "numba"


def exact_backend(backend: str, dtypes=(torch.float32,)) -> tuple[bool, str]:
    """``(exact, why)``: whether ``backend``'s tensors are compared bit for bit with torch's,
    for parameters of ``dtypes`` (bfloat16 and float16: where its probes found torch's
    formulas for them, ``low_precision.rounding``).

    The backends of ``cases.BIT_EXACT`` claim torch.optim's for-loop bit for bit. ``fast:numba``
    models this torch's rounding (which of add-with-alpha, addcmul and lerp it fuses, which sqrt
    routine it runs) by probing it at first use, and claims bit-exactness only where those probes
    found a model that matches (``NumbaEngine.exact``); elsewhere (another CPU architecture or
    torch build) it is compared with assert_close, like ``fast:numexpr``, and ``why`` says so in
    every failure message.
    """
    if backend not in BIT_EXACT:
        return False, ""
    if backend == "fast:numba":
        engine = roundpipe.optim.backends.get(backend).numba_engine()
        if not engine.exact:
            return False, (
                "compared with assert_close, not bit for bit: fast:numba's probes found that it "
                f"does not model this torch's rounding exactly (sqrt: {engine.sqrt_what}; "
                f"fused: {sorted(engine.fused)})"
            )
        for dtype in dtypes:
            if dtype in (torch.bfloat16, torch.float16) and not engine.exact_for(dtype):
                found = rounding(dtype)
                return False, f"compared with assert_close: fast:numba's {found.name} probes: {found.what}"
    return True, ""


def bits_mismatch(a: torch.Tensor, b: torch.Tensor, nan_bits: bool = False) -> str | None:
    """None where ``a`` and ``b`` (same dtype and shape) are equal bit for bit, else how many
    elements differ and the first one.

    Floating-point tensors are compared as an integer view of the same width (so ``-0.0``
    differs from ``0.0``, and every ulp counts), NaNs matched by position (any NaN meets any
    NaN: torch does not specify a NaN's sign or payload, and roundpipe models the bits of the
    NaNs torch's kernels store only on 16-bit tensors stepped directly: docs/low-precision.md)
    unless ``nan_bits`` (those cases: a NaN's bits too); complex tensors as their real and
    imaginary parts (an element differs where either part does); other dtypes by value.
    """
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    per_element = 1
    if a.is_complex():
        a, b = torch.view_as_real(a).reshape(-1), torch.view_as_real(b).reshape(-1)
        per_element = 2
    if a.numel() == 0:
        return None
    if a.is_floating_point():
        bits = _INT_OF[a.element_size()]
        differ = a.view(bits) != b.view(bits)
        if not nan_bits:
            differ &= ~(a.isnan() & b.isnan())
    else:
        differ = a != b
    where = differ.nonzero().squeeze(1)
    if where.numel() == 0:
        return None
    first = int(where[0])
    elements = torch.unique(where // per_element).numel()
    part = ""
    if per_element == 2:
        part = f" ({'real' if first % 2 == 0 else 'imaginary'} part)"
    av, bv = a[first].item(), b[first].item()
    hexes = ""
    if a.is_floating_point():
        width = 2 * a.element_size()
        mask = (1 << (8 * a.element_size())) - 1
        ai, bi = (int(x.view(bits)) & mask for x in (a[first], b[first]))
        hexes = f" (bits 0x{ai:0{width}x} vs 0x{bi:0{width}x})"
    return (
        f"{elements} of {a.numel() // per_element} elements differ in their bits; the first at flat "
        f"index {first // per_element}{part}: {av!r} vs {bv!r}{hexes}"
    )


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width (torch.equal on it tells -0.0 from 0.0)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_INT_OF[t.element_size()]) if t.is_floating_point() else t


def compare_values(
    ours: Snapshot,
    theirs: Snapshot,
    ctx: Context,
    comparison: str,
    deviation=None,
    exact: bool = False,
    note: str = "",
):
    """Every parameter and every state value of ``ours`` (roundpipe) against ``theirs``.

    ``exact`` (and no ``deviation``): tensors must be equal bit for bit (``bits_mismatch``);
    else they must pass ``torch.testing.assert_close`` (at its defaults, or at the tolerance of
    ``deviation``). Other values must be equal. See the module docstring for how it is kept
    fast. ``note`` is added to every failure message (why a claimed bit-for-bit backend is
    compared with assert_close here).
    """
    vs = "the reference backend" if comparison.endswith("-vs-reference") else "torch"
    tolerance = deviation.tolerance if deviation is not None else None
    exact = exact and deviation is None
    suffix = f" [{note}]" if note else ""
    pairs = []  # (what, a, b)
    for i, (pa, pb) in enumerate(zip(ours.params, theirs.params, strict=True)):
        label = param_label(i, case_params(ctx.case))
        pairs.append((f"{label} value vs {vs}{suffix}", pa, pb))
        sa, sb = ours.state.get(i, {}), theirs.state.get(i, {})
        if set(sa) != set(sb):
            raise AssertionError(ctx(f"{label}: state keys {sorted(sa)} differ from {vs}'s {sorted(sb)}"))
        for key, vb in sb.items():
            va = sa[key]
            what = f"{label} state[{key!r}] vs {vs}{suffix}"
            if isinstance(vb, torch.Tensor) or isinstance(va, torch.Tensor):
                if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
                    raise AssertionError(ctx(f"{what}: {type(va).__name__} vs {type(vb).__name__}"))
                pairs.append((what, va.detach(), vb.detach()))
            elif va != vb:
                raise AssertionError(ctx(f"{what}: {va!r} != {vb!r}"))

    worst = [0.0, 0.0, 0.0, ""]
    try:
        if exact:
            _compare_bits(pairs, ctx, worst)
        else:
            _compare_close(pairs, ctx, worst, tolerance, vs)
    finally:
        RECORDER.add(
            ctx.case.optimizer, comparison, ctx.case.id, f"step {ctx.step} {worst[3]}", worst[:3], deviation
        )


def _compare_bits(pairs, ctx, worst):
    """Every pair bit for bit (``bits_mismatch``), dtype, shape and layout first."""
    for what, a, b in pairs:
        if same_meta(a, b) and a.layout == torch.strided and torch.equal(bit_view(a), bit_view(b)):
            continue  # the common case, quickly (NaNs with other bits are examined below)
        if not same_meta(a, b) or a.layout != torch.strided:
            _assert_close(a, b, ctx, what)  # raises on a metadata mismatch
        _worst(worst, errors(a, b), [(what, a, b)])
        why = bits_mismatch(a, b, nan_bits=getattr(ctx.case, "nan_bits", False) and a.dtype in _LOW_PRECISION)
        if why is not None:
            raise AssertionError(ctx(f"{what}: not bit for bit (a bit-exact backend): {why}"))


def _compare_close(pairs, ctx, worst, tolerance, vs):
    """Every pair with assert_close (see the module docstring for the shortcuts)."""
    groups: dict = {}
    for what, a, b in pairs:
        if (
            not same_meta(a, b)
            or a.layout != torch.strided
            or a.dtype not in (torch.float32, torch.complex64)
        ):
            _assert_close(a, b, ctx, what, tolerance)  # raises on a metadata mismatch
            _worst(worst, errors(a, b), [(what, a, b)])
        elif not torch.equal(a, b):
            groups.setdefault(a.dtype, []).append((what, a, b))
    for items in groups.values():
        flat_a = torch.cat([a.reshape(-1) for _, a, _ in items])
        flat_b = torch.cat([b.reshape(-1) for _, _, b in items])
        errs = errors(flat_a, flat_b)
        _worst(worst, errs, items)
        if errs[4] and errs[2] <= SAFE_RATIO:
            continue
        try:
            torch.testing.assert_close(flat_a, flat_b, **(tolerance or {}))
            continue
        except AssertionError as error:
            flat_error = str(error)
        for what, a, b in items:  # name the failing tensor (outside the except: no chained traceback)
            _assert_close(a, b, ctx, what, tolerance)
        raise AssertionError(ctx(f"concatenated comparison with {vs} failed: {flat_error}"))


def _worst(worst, errs, items):
    """Fold ``errs`` (``errors`` of the concatenation of ``items``) into ``worst``."""
    max_abs, max_rel, max_ratio, index, _ = errs
    worst[0] = max(worst[0], max_abs)
    worst[1] = max(worst[1], max_rel)
    if max_ratio > worst[2]:
        worst[2] = max_ratio
        for what, a, _ in items:
            if index < a.numel():
                worst[3] = f"{what} element {index}"
                break
            index -= a.numel()


def _assert_close(a, b, ctx, what, tolerance=None):
    torch.testing.assert_close(a, b, msg=lambda m: ctx(f"{what}: {m}"), **(tolerance or {}))


def _same_loss(a, b):
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


# ---------------------------------------------------------------------------------------------
# branch coverage checks (``Case.expect``), evaluated on torch's optimizer


def _value(x):
    return x.item() if isinstance(x, torch.Tensor) else float(x)


def _first_state(opt):
    for st in opt.state.values():
        if st:
            return st
    return None


def branches(opt, step_done: bool) -> set:
    """The expect-able branches this torch optimizer is in (call before and after a step)."""
    group = opt.param_groups[0]
    name = type(opt).__name__
    out = set()
    st = _first_state(opt)
    if name == "RAdam" and step_done and st is not None:
        # rho_t of the step just taken, as torch computes it
        beta2 = _value(group["betas"][1])
        step = _value(st["step"])
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / (1 - beta2**step)
        out.add("rectified" if rho_t > 5 else "unrectified")
    if name == "ASGD" and not step_done:
        # mu used by the step about to be taken
        if any(s and _value(s["mu"]) != 1 for s in opt.state.values()):
            out.add("averaging")
    if name == "Rprop" and step_done:
        lo, hi = group["step_sizes"]
        for s in opt.state.values():
            if not s:
                continue
            ss = s["step_size"]
            ss = torch.view_as_real(ss) if ss.is_complex() else ss
            if bool((ss == torch.tensor(lo, dtype=ss.dtype)).any()):
                out.add("step_size_min")
            if bool((ss == torch.tensor(hi, dtype=ss.dtype)).any()):
                out.add("step_size_max")
    return out


# ---------------------------------------------------------------------------------------------
# the runs


THREADS_ENV = "ROUNDPIPE_CONFORMANCE_THREADS"


def conformance_threads() -> int:
    """torch's intra-op thread count while a case runs: ``$ROUNDPIPE_CONFORMANCE_THREADS``, else 1.

    Elementwise results do not depend on the thread count, and on a busy 2-core machine two
    OpenMP threads make every op many times slower (a parallel region waits for a descheduled
    thread), so the suite steps on one thread by default; roundpipe follows torch's count.
    Set ``ROUNDPIPE_CONFORMANCE_THREADS=2`` to run the cases multi-threaded.
    """
    env = os.environ.get(THREADS_ENV)
    if not env:
        return 1
    n = int(env)
    if n < 1:
        raise ValueError(f"{THREADS_ENV}={env!r} is not a positive integer")
    return n


def harness_threads():
    """The harness's own tensor work (checks, statistics) runs on one thread."""
    return torch_threads(1)


def steps(case: Case, run: str, keep: bool, seen: set | None = None):
    """Step ``case`` on ``run`` (``TORCH`` or a backend name) from a fresh copy of its parameters;
    yield a ``Snapshot`` after each step (``keep``: cloned). ``seen`` collects the ``expect``-able
    branches reached (torch's run only)."""
    ctx = Context(case, run)
    specs = case_params(case)
    params = make_params(specs)
    if run == TORCH:
        opt = getattr(torch.optim, case.optimizer)(params, **case.make_kwargs())
    else:
        opt = getattr(roundpipe.optim, case.optimizer)(params, **case.make_kwargs(), backend=run)
        assert opt.backend == run, ctx(f"optimizer.backend is {opt.backend!r}")
    for step in range(case.steps):
        ctx.step = step
        grads = gradients(step, specs)
        if seen is not None:
            with harness_threads():
                seen |= branches(opt, step_done=False)
        if step % CLOSURE_EVERY == CLOSURE_EVERY - 1:

            def closure(params=params, grads=grads, step=step):
                set_grads(params, grads)
                return torch.tensor(float(step))

            loss = opt.step(closure)
        else:
            set_grads(params, grads)
            loss = opt.step()
        with harness_threads():
            if seen is not None:
                seen |= branches(opt, step_done=True)
            check_grads_untouched(params, grads, ctx, lambda i: param_label(i, specs))
            snap = snapshot(params, opt, loss, keep)
        yield snap


def check_grads_untouched(params, grads, ctx, label):
    """Raise unless each parameter's ``.grad`` is still the gradient it was given (torch never
    writes ``p.grad`` in a step)."""
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if (p.grad is None) != (g is None) or (g is not None and not torch.equal(p.grad, g)):
            raise AssertionError(ctx(f"step() modified the gradient of {label(i)}"))


@dataclass
class Trajectory:
    snapshots: list
    seen: set  # the expect-able branches reached (torch's run)


_trajectories: dict = {}  # run -> (case id, Trajectory): the latest case's, per shared run
_trajectory_lock = threading.Lock()


def trajectory(case: Case, run: str) -> Trajectory:
    """The kept snapshots of ``case`` on ``run`` (one of ``SHARED_RUNS``); the latest case's are
    cached per run, so the tests of one case (on every backend) step it once."""
    with _trajectory_lock:
        hit = _trajectories.get(run)
        if hit is not None and hit[0] == case.id:
            return hit[1]
        for other in [r for r, (case_id, _) in _trajectories.items() if case_id != case.id]:
            del _trajectories[other]  # another case's: free it before stepping this one
        seen = set() if run == TORCH else None
        traj = Trajectory(list(steps(case, run, keep=True, seen=seen)), seen)
        _trajectories[run] = (case.id, traj)
        return traj


def run_case(case: Case, backend: str):
    """Check ``case`` on ``backend`` against torch (and the reference backend) after every step."""
    with torch_threads(conformance_threads()):
        _run_case(case, backend)


def _run_case(case: Case, backend: str):
    deviation = deviations.lookup(case, backend)
    if deviation is not None and deviation.tolerance is None:
        deviation = None  # an expected failure: checked at the default tolerance
    by = {
        c: deviation if deviation is not None and c in deviation.comparisons else None
        for c in deviations.COMPARISONS
    }
    theirs = trajectory(case, TORCH)
    ref = trajectory(case, "reference") if backend != "reference" else None
    # the reference backend's own test compares its kept run; any other backend is stepped live
    ours = (
        iter(trajectory(case, backend).snapshots)
        if backend in SHARED_RUNS
        else steps(case, backend, keep=False)
    )
    # bit for bit where the backend claims it (and so against the reference backend, which is
    # bit for bit torch's), assert_close elsewhere (exact_backend)
    exact, note = exact_backend(backend, {s.dtype for s in case_params(case)})
    ctx = Context(case, backend)
    for step, snap in enumerate(ours):
        ctx.step = step
        with harness_threads():
            expected = theirs.snapshots[step]
            if not _same_loss(snap.loss, expected.loss):
                raise AssertionError(
                    ctx(f"step() returned {snap.loss!r}, torch's returned {expected.loss!r}")
                )
            compare_structure(snap, expected, ctx)
            compare_values(snap, expected, ctx, backend, by["torch"], exact, note)
            if ref is not None:
                compare_values(
                    snap, ref.snapshots[step], ctx, f"{backend}-vs-reference", by["reference"], exact, note
                )

    missing = set(case.expect) - theirs.seen
    if missing:
        raise AssertionError(
            ctx(f"the case never reached {sorted(missing)} on torch's run (reached {sorted(theirs.seen)})")
        )
