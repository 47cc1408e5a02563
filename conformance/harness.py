"""The conformance harness: parameters, gradients, the lockstep run and the error statistics.

One case (``cases.Case``) on one backend is run as follows:

* identical copies of ``PARAMS`` are made: one for ``torch.optim.<Name>(..., foreach=False)``,
  one for ``roundpipe.optim.<Name>(..., backend=backend)`` and, for a backend other than
  ``reference`` (``fast``), one for the ``reference`` backend as well;
* at every step each copy gets the same fresh gradients (``gradients(step)``, seeded, cloned
  per optimizer); on the steps where ``step % CLOSURE_EVERY == CLOSURE_EVERY - 1`` the
  gradients are set inside a closure passed to ``step(closure)`` and the returned losses are
  compared;
* after every step, every parameter and every entry of ``optimizer.state[p]`` (the key sets
  must be equal; tensors are compared with ``torch.testing.assert_close`` at its defaults for
  their dtype, i.e. float32: rtol=1.3e-6, atol=1e-5, dtype and shape checked) is compared with
  torch's; for ``fast``, also with the ``reference`` backend's (same check, recorded as
  ``fast-vs-reference``). Gradients must be left unmodified. (The tensors of one dtype are
  checked in one assert_close call on their concatenation, which passes exactly when each
  per-tensor call would; on a failure each tensor is checked on its own, so the message names
  the parameter and the state key.)
* a case's ``expect``ed branches must have been reached on torch's trajectory;
* torch (and so roundpipe, which follows torch's thread count) runs on one intra-op thread
  unless ``ROUNDPIPE_CONFORMANCE_THREADS`` says otherwise (see ``conformance_threads``).

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
  measures the modulus of the complex difference, so there the ratio is indicative).

Non-finite values must match exactly (same positions, same values); otherwise the errors are
``inf``.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field

import torch

from roundpipe.optim.threads import torch_threads

from .cases import Case

# assert_close's defaults for float32 / complex64 (torch.testing._comparison)
RTOL, ATOL = 1.3e-6, 1e-5
TINY = torch.finfo(torch.float32).tiny

CLOSURE_EVERY = 4  # steps 3, 7, 11, ... set their gradients in a closure


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the set and how its gradients are made (see ``gradients``)."""

    desc: str
    shape: tuple
    dtype: torch.dtype = torch.float32
    scale: float = 1.0  # gradient scale on every step
    tiny_on_odd_steps: bool = False  # gradient scaled by 1e-20 on odd steps
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


def make_params():
    """Fresh leaf tensors with the set's initial values (identical on every call)."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(s.shape, dtype=s.dtype, generator=g).requires_grad_() for s in PARAMS]


_grad_cache: dict = {}
_grad_lock = threading.Lock()


def gradients(step: int):
    """The gradients of step ``step``: one tensor (or None) per parameter; cached, never mutated."""
    with _grad_lock:
        grads = _grad_cache.get(step)
        if grads is None:
            grads = [_gradient(i, s, step) for i, s in enumerate(PARAMS)]
            _grad_cache[step] = grads
        return grads


def _gradient(index: int, spec: ParamSpec, step: int):
    if spec.none_every and step % spec.none_every == 0:
        return None
    g = torch.Generator().manual_seed(10_000 * (step + 1) + index)
    grad = torch.randn(spec.shape, dtype=spec.dtype, generator=g)
    scale = spec.scale * (1e-20 if spec.tiny_on_odd_steps and step % 2 else 1.0)
    if scale != 1.0:
        grad = grad * scale
    if spec.zero_every:
        grad.view(-1)[:: spec.zero_every] = 0
    return grad


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
    compared: int = 0  # comparisons recorded (one per dtype group per step)

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
    """Worst errors per (optimizer, comparison); a comparison is a backend's name (against
    torch) or '<backend>-vs-reference'."""

    def __init__(self):
        self.stats: dict[tuple[str, str], Stats] = {}
        self.lock = threading.Lock()

    def add(self, optimizer, comparison, case_id, where, errors):
        max_abs, max_rel, max_ratio = errors
        with self.lock:
            st = self.stats.setdefault((optimizer, comparison), Stats())
            st.compared += 1
            st.cases.add(case_id)
            st.max_abs = max(st.max_abs, max_abs)
            st.max_rel = max(st.max_rel, max_rel)
            if max_ratio > st.max_ratio:
                st.max_ratio = max_ratio
                st.worst = f"{case_id} {where}"


RECORDER = Recorder()


def errors(a: torch.Tensor, b: torch.Tensor):
    """``(max_abs, max_rel, max_ratio, index)`` of ``a`` against ``b`` (same shape and dtype).

    See the module docstring; ``index`` is the flat (element, not component) index where
    max_ratio is reached, or -1.
    """
    if a.numel() == 0:
        return (0.0, 0.0, 0.0, -1)
    per_element = 2 if a.is_complex() else 1
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    diff = (a - b).abs_()
    max_abs = diff.max().item()
    if not math.isfinite(max_abs):
        # Non-finite values must match exactly (same positions, same values).
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        if not torch.equal(fa, fb) or not torch.equal(a[~fa], b[~fb]):
            bad = (fa != fb) | ((~fa) & (a != b))
            return (math.inf, math.inf, math.inf, int(bad.nonzero()[0, 0]) // per_element)
        diff = torch.where(fa, diff, 0.0)
        max_abs = diff.max().item()
        b = torch.where(fb, b, 0.0)
    mag = b.abs()
    ratio = diff / mag.mul(RTOL).add_(ATOL)
    index = int(ratio.argmax())
    max_rel = torch.where(mag >= TINY, diff / mag, 0.0).max().item()
    return (max_abs, max_rel, ratio[index].item(), index // per_element)


# ---------------------------------------------------------------------------------------------
# comparisons


class Context:
    """What a failure message says: optimizer, kwargs, backend, step."""

    def __init__(self, case: Case, backend: str):
        self.case = case
        self.backend = backend
        self.step = -1

    def __call__(self, what: str) -> str:
        return (
            f"{self.case.optimizer}(kwargs={self.case.kwargs!r}) backend={self.backend!r} "
            f"step={self.step} (0-based, of {self.case.steps}): {what}"
        )


def param_label(i: int) -> str:
    s = PARAMS[i]
    return f"param[{i}] ({s.desc}; shape {s.shape}, {str(s.dtype).removeprefix('torch.')})"


def _same_meta(a, b) -> bool:
    return (a.dtype, a.shape, a.device, a.layout) == (b.dtype, b.shape, b.device, b.layout)


def compare_optimizers(params_a, opt_a, params_b, opt_b, ctx: Context, comparison: str):
    """Every parameter and every state entry of ``opt_a`` (roundpipe) against ``opt_b``.

    Each pair of tensors must pass ``torch.testing.assert_close(a, b)`` at its defaults. To keep
    the suite fast, the pairs of one dtype are checked in one call on their concatenation
    (assert_close's check is elementwise, and dtype, shape, device and layout are checked per
    pair first, so this passes exactly when every per-pair call passes); when it fails, every
    pair is checked on its own, so the failure names the parameter and the state key.
    """
    vs = "the reference backend" if comparison.endswith("-vs-reference") else "torch"
    pairs = []  # (what, a, b)
    for i, (pa, pb) in enumerate(zip(params_a, params_b, strict=True)):
        label = param_label(i)
        pairs.append((f"{label} value vs {vs}", pa.detach(), pb.detach()))
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        if set(sa) != set(sb):
            raise AssertionError(ctx(f"{label}: state keys {sorted(sa)} differ from {vs}'s {sorted(sb)}"))
        for key in sb:
            va, vb = sa[key], sb[key]
            what = f"{label} state[{key!r}] vs {vs}"
            if isinstance(vb, torch.Tensor) or isinstance(va, torch.Tensor):
                if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
                    raise AssertionError(ctx(f"{what}: {type(va).__name__} vs {type(vb).__name__}"))
                pairs.append((what, va.detach(), vb.detach()))
            elif va != vb:
                raise AssertionError(ctx(f"{what}: {va!r} != {vb!r}"))

    groups: dict = {}
    for what, a, b in pairs:
        if (
            not _same_meta(a, b)
            or a.layout != torch.strided
            or a.dtype not in (torch.float32, torch.complex64)
        ):
            _assert_close(a, b, ctx, what)  # raises on a metadata mismatch
            _record(ctx, comparison, [(what, a, b)], a, b)
            continue
        groups.setdefault(a.dtype, []).append((what, a, b))
    for items in groups.values():
        flat_a = torch.cat([a.reshape(-1) for _, a, _ in items])
        flat_b = torch.cat([b.reshape(-1) for _, _, b in items])
        _record(ctx, comparison, items, flat_a, flat_b)
        try:
            torch.testing.assert_close(flat_a, flat_b)
            continue
        except AssertionError as error:
            flat_error = str(error)
        for what, a, b in items:  # name the failing tensor (outside the except: no chained traceback)
            _assert_close(a, b, ctx, what)
        raise AssertionError(ctx(f"concatenated comparison with {vs} failed: {flat_error}"))


def _assert_close(a, b, ctx, what):
    torch.testing.assert_close(a, b, msg=lambda m: ctx(f"{what}: {m}"))


def _record(ctx, comparison, items, flat_a, flat_b):
    """Record the errors of ``flat_a`` against ``flat_b``, the concatenation of ``items``."""
    if not _same_meta(flat_a, flat_b):
        return
    max_abs, max_rel, max_ratio, index = errors(flat_a, flat_b)
    where = ""
    for what, a, _ in items:
        if index < a.numel():
            where = f"{what} element {index}"
            break
        index -= a.numel()
    RECORDER.add(
        ctx.case.optimizer, comparison, ctx.case.id, f"step {ctx.step} {where}", (max_abs, max_rel, max_ratio)
    )


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
# the run


def roundpipe_class(name: str):
    import roundpipe.optim

    cls = getattr(roundpipe.optim, name, None)
    if cls is None:
        raise AssertionError(
            f"roundpipe.optim.{name} does not exist: the conformance table has cases for it "
            f"(roundpipe.optim has {sorted(n for n in dir(roundpipe.optim) if not n.startswith('_'))})"
        )
    torch_cls = getattr(torch.optim, name)
    if not (isinstance(cls, type) and issubclass(cls, torch_cls)):
        raise AssertionError(f"roundpipe.optim.{name} is not a subclass of torch.optim.{name}")
    return cls


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


def run_case(case: Case, backend: str):
    """Run ``case`` on ``backend`` (and, unless it is 'reference', the reference backend too)."""
    with torch_threads(conformance_threads()):
        _run_case(case, backend)


def _run_case(case: Case, backend: str):
    torch_cls = getattr(torch.optim, case.optimizer)
    rp_cls = roundpipe_class(case.optimizer)
    ctx = Context(case, backend)

    runs = {"torch": None, backend: None}
    if backend != "reference":
        runs["reference"] = None
    for name in runs:
        params = make_params()
        if name == "torch":
            opt = torch_cls(params, **case.make_kwargs(), foreach=False)
        else:
            opt = rp_cls(params, **case.make_kwargs(), backend=name)
            assert opt.backend == name, ctx(f"optimizer.backend is {opt.backend!r}")
        runs[name] = (params, opt)

    seen: set = set()
    for step in range(case.steps):
        ctx.step = step
        grads = gradients(step)
        with harness_threads():
            seen |= branches(runs["torch"][1], step_done=False)
        losses = {}
        for name, (params, opt) in runs.items():
            if step % CLOSURE_EVERY == CLOSURE_EVERY - 1:

                def closure(params=params, grads=grads, step=step):
                    set_grads(params, grads)
                    return torch.tensor(float(step))

                losses[name] = opt.step(closure)
            else:
                set_grads(params, grads)
                losses[name] = opt.step()
        with harness_threads():
            seen |= branches(runs["torch"][1], step_done=True)
            check_step(runs, backend, grads, losses, ctx)

    missing = set(case.expect) - seen
    if missing:
        raise AssertionError(
            ctx(f"the case never reached {sorted(missing)} on torch's trajectory (reached {sorted(seen)})")
        )


def check_step(runs, backend, grads, losses, ctx):
    """After a step: the losses, the gradients (untouched), then parameters and state."""
    for name, loss in losses.items():
        if not _same_loss(loss, losses["torch"]):
            raise AssertionError(ctx(f"{name} step() returned {loss!r}, torch returned {losses['torch']!r}"))
    for name, (params, _) in runs.items():
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if (p.grad is None) != (g is None) or (g is not None and not torch.equal(p.grad, g)):
                raise AssertionError(ctx(f"{name} modified the gradient of {param_label(i)}"))
    tp, topt = runs["torch"]
    rp, ropt = runs[backend]
    compare_optimizers(rp, ropt, tp, topt, ctx, backend)
    if backend != "reference":
        xp, xopt = runs["reference"]
        compare_optimizers(rp, ropt, xp, xopt, ctx, f"{backend}-vs-reference")


def harness_threads():
    """The harness's own tensor work (checks, statistics) runs on one thread."""
    return torch_threads(1)


def _same_loss(a, b):
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
