"""roundpipe.optim's staged optimizers (Adafactor, Muon) against torch.optim, bit for bit.

Test ids read ``<Optimizer>-<kwargs>-<backend>``, e.g. ``Adafactor-d=2-fast:numexpr``; the cases
and parameter sets are ``staged_cases.py``'s. As in ``harness.py``: torch's for-loop and
roundpipe (on each backend of ``cases.BACKENDS``) step identical copies of the case's
parameters with the same fresh gradients (set inside a closure every ``CLOSURE_EVERY`` steps),
and after every step the loss, ``state_dict()``'s structure (state entries, keys,
``param_groups``), every parameter and every state tensor (``step`` included) must be equal
bit for bit (``harness.bits_mismatch``: an integer view, ``-0.0 != 0.0``, NaN meeting NaN by
position), dtypes and shapes too, on every backend: no tolerance, no declared deviation.

Also: ``state_dict`` carried across (torch's loaded into roundpipe's optimizer and roundpipe's
into torch's, then both stepped on), and the errors of a step, raised as torch raises them
(the same exception type) but before anything has moved: no parameter, no state value, no new
state entry.
"""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch

import roundpipe.optim
from roundpipe.optim.threads import torch_threads

from .cases import BACKENDS, T
from .harness import (
    CLOSURE_EVERY,
    TORCH,
    ParamSpec,
    bits_mismatch,
    check_grads_untouched,
    conformance_threads,
    harness_threads,
    same_meta,
    same_value,
    step_gradient,
)
from .staged_cases import (
    STAGED_CASES,
    StagedCase,
    adafactor_branches,
)

HAS_MUON = hasattr(torch.optim, "Muon")


# ---------------------------------------------------------------------------------------------
# parameters and gradients


def make_params(specs):
    """Fresh leaf tensors with the set's initial values (identical on every call)."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(s.shape, dtype=s.dtype, generator=g).requires_grad_() for s in specs]


_grad_cache: dict = {}
_grad_lock = threading.Lock()


def gradients(specs, step: int):
    """The gradients of step ``step`` for the set ``specs`` (``harness``'s recipe); cached."""
    with _grad_lock:
        key = (specs, step)
        grads = _grad_cache.get(key)
        if grads is None:
            grads = [step_gradient(i, s, step) for i, s in enumerate(specs)]
            _grad_cache[key] = grads
        return grads


def set_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone()


def make_optimizer(optimizer: str, run: str, params, kwargs):
    if run == TORCH:
        return getattr(torch.optim, optimizer)(params, **kwargs)
    opt = getattr(roundpipe.optim, optimizer)(params, **kwargs, backend=run)
    assert opt.backend == run
    return opt


# ---------------------------------------------------------------------------------------------
# snapshots and comparisons


class Context:
    """What a failure message says: optimizer, kwargs, run, step (``specs``: the parameters)."""

    def __init__(self, case: StagedCase, run: str, specs=None):
        self.case, self.run, self.step = case, run, -1
        self.specs = case.params if specs is None else specs

    def __call__(self, what: str) -> str:
        on = "torch.optim" if self.run == TORCH else f"backend={self.run!r}"
        return (
            f"{self.case.optimizer}(kwargs={self.case.kwargs!r}) {on} "
            f"step={self.step} (0-based, of {self.case.steps}): {what}"
        )

    def label(self, i: int) -> str:
        s = self.specs[i]
        return f"param[{i}] ({s.desc}; shape {s.shape})"


def _kept(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def snapshot(params, opt, loss, keep: bool):
    """``(loss, params, state, param_groups)`` of ``opt`` now; ``keep``: cloned."""
    sd = opt.state_dict()
    if not keep:
        return loss, [p.detach() for p in params], sd["state"], sd["param_groups"]
    state = {pid: {k: _kept(v) for k, v in entry.items()} for pid, entry in sd["state"].items()}
    return loss, [p.detach().clone() for p in params], state, copy.deepcopy(sd["param_groups"])


def assert_same(ours, theirs, ctx, vs="torch"):
    """Every value of snapshot ``ours`` equal to ``theirs``'s: structure, then bit for bit."""
    loss_a, params_a, state_a, groups_a = ours
    loss_b, params_b, state_b, groups_b = theirs
    if (loss_a is None) != (loss_b is None) or (
        loss_a is not None and not torch.equal(torch.as_tensor(loss_a), torch.as_tensor(loss_b))
    ):
        raise AssertionError(ctx(f"step() returned {loss_a!r}, {vs}'s returned {loss_b!r}"))
    if set(state_a) != set(state_b):
        raise AssertionError(
            ctx(f"state_dict()['state'] has entries for {sorted(state_a)}, {vs}'s for {sorted(state_b)}")
        )
    if len(groups_a) != len(groups_b):
        raise AssertionError(ctx(f"{len(groups_a)} param_groups, {vs} has {len(groups_b)}"))
    for g, (ga, gb) in enumerate(zip(groups_a, groups_b, strict=True)):
        if list(ga) != list(gb):
            raise AssertionError(ctx(f"param_groups[{g}] has keys {list(ga)}, {vs}'s {list(gb)}"))
        for key, vb in gb.items():
            if not same_value(ga[key], vb):
                raise AssertionError(ctx(f"param_groups[{g}][{key!r}] is {ga[key]!r}, {vs}'s is {vb!r}"))
    pairs = []
    for i, (pa, pb) in enumerate(zip(params_a, params_b, strict=True)):
        pairs.append((f"{ctx.label(i)} value", pa, pb))
    for pid, entry in state_b.items():
        if set(state_a[pid]) != set(entry):
            raise AssertionError(
                ctx(f"{ctx.label(pid)}: state keys {sorted(state_a[pid])}, {vs}'s {sorted(entry)}")
            )
        for key, vb in entry.items():
            va, what = state_a[pid][key], f"{ctx.label(pid)} state[{key!r}]"
            if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
                pairs.append((what, va, vb))
            elif isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor) or va != vb:
                raise AssertionError(ctx(f"{what}: {va!r} vs {vs}'s {vb!r}"))
    for what, a, b in pairs:
        if not same_meta(a, b):
            raise AssertionError(
                ctx(f"{what}: dtype/shape {a.dtype} {tuple(a.shape)}, {vs}'s {b.dtype} {tuple(b.shape)}")
            )
        why = bits_mismatch(a, b)
        if why is not None:
            raise AssertionError(ctx(f"{what} vs {vs}: not bit for bit: {why}"))


# ---------------------------------------------------------------------------------------------
# the runs


def take_step(opt, params, grads, step: int):
    """``opt.step()`` with ``grads``; on the steps of ``CLOSURE_EVERY``, set in a closure."""
    if step % CLOSURE_EVERY == CLOSURE_EVERY - 1:

        def closure():
            set_grads(params, grads)
            return torch.tensor(float(step))

        return opt.step(closure)
    set_grads(params, grads)
    return opt.step()


def steps(case: StagedCase, run: str, keep: bool, seen: set | None = None):
    """Step ``case`` on ``run`` (``TORCH`` or a backend); yield a snapshot after each step.
    ``seen`` collects the ``expect``-able branches reached (torch's Adafactor run)."""
    ctx = Context(case, run)
    params = make_params(case.params)
    opt = make_optimizer(case.optimizer, run, params, case.make_kwargs())
    track = seen is not None and case.optimizer == "Adafactor"
    for step in range(case.steps):
        ctx.step = step
        grads = gradients(case.params, step)
        if track:
            set_grads(params, grads)
            with harness_threads():
                seen |= adafactor_branches(opt, before=True)
        loss = take_step(opt, params, grads, step)
        with harness_threads():
            if track:
                seen |= adafactor_branches(opt, before=False)
            check_grads_untouched(params, grads, ctx, ctx.label)
            snap = snapshot(params, opt, loss, keep)
        yield snap


_torch_runs: dict = {}  # the latest case's: case id -> (snapshots, branches seen)
_torch_lock = threading.Lock()


def torch_run(case: StagedCase):
    """torch's kept snapshots of ``case`` (stepped once for its tests on every backend)."""
    with _torch_lock:
        hit = _torch_runs.get(case.id)
        if hit is None:
            _torch_runs.clear()
            seen: set = set()
            hit = (list(steps(case, TORCH, keep=True, seen=seen)), seen)
            _torch_runs[case.id] = hit
        return hit


@pytest.mark.parametrize(
    "case, backend",
    [
        pytest.param(
            case,
            backend,
            id=f"{case.id}-{backend}",
            marks=[pytest.mark.skipif(case.optimizer == "Muon" and not HAS_MUON, reason="torch < 2.9")],
        )
        for case in STAGED_CASES
        for backend in BACKENDS
    ],
)
def test_staged(case, backend):
    with torch_threads(conformance_threads()):
        theirs, seen = torch_run(case)
        ctx = Context(case, backend)
        for step, snap in enumerate(steps(case, backend, keep=False)):
            ctx.step = step
            with harness_threads():
                assert_same(snap, theirs[step], ctx)
        missing = set(case.expect) - seen
        if missing:
            raise AssertionError(
                ctx(f"the case never reached {sorted(missing)} on torch's run (reached {sorted(seen)})")
            )


# ---------------------------------------------------------------------------------------------
# state_dict, both ways

STATE_DICT_CASES = (
    StagedCase("Adafactor", {"lr": T(0.01), "weight_decay": 0.1, "maximize": True}, 10),
    StagedCase("Muon", {"lr": 0.02, "momentum": 0.9, "adjust_lr_fn": "match_rms_adamw"}, 6),
)
DIRECTIONS = ("torch-into-roundpipe", "roundpipe-into-torch")


def _state_dict_params():
    for case in STATE_DICT_CASES:
        skip = [pytest.mark.skipif(case.optimizer == "Muon" and not HAS_MUON, reason="torch < 2.9")]
        # after step 1 the 7x11 parameter (grad None at step 0) has no state yet
        for at in (1, case.steps // 2):
            for direction in DIRECTIONS:
                for backend in BACKENDS:
                    yield pytest.param(
                        case, at, direction, backend, marks=skip, id=f"{case.id}-at{at}-{direction}-{backend}"
                    )


@pytest.mark.parametrize("case, at, direction, backend", list(_state_dict_params()))
def test_state_dict(case, at, direction, backend):
    """One optimizer steps ``at`` steps; its ``state_dict()`` (equal to torch's there, keys,
    dtypes and bits) is loaded into the other's, on copies of the parameters, which steps on:
    equal to torch's uninterrupted run after every step."""
    source, dest = (TORCH, backend) if direction == DIRECTIONS[0] else (backend, TORCH)
    with torch_threads(conformance_threads()):
        theirs, _ = torch_run(case)
        params = make_params(case.params)
        opt = make_optimizer(case.optimizer, source, params, case.make_kwargs())
        ctx = Context(case, source)
        for step in range(at):
            ctx.step = step
            loss = take_step(opt, params, gradients(case.params, step), step)
        with harness_threads():
            assert_same(snapshot(params, opt, loss, keep=False), theirs[at - 1], ctx)
        saved = copy.deepcopy(opt.state_dict())
        copies = [p.detach().clone().requires_grad_() for p in params]
        loaded = make_optimizer(case.optimizer, dest, copies, case.make_kwargs())
        loaded.load_state_dict(saved)
        ctx = Context(case, dest)
        ctx.step = at - 1
        with harness_threads():
            assert_same(snapshot(copies, loaded, theirs[at - 1][0], keep=False), theirs[at - 1], ctx)
        for step in range(at, case.steps):
            ctx.step = step
            loss = take_step(loaded, copies, gradients(case.params, step), step)
            with harness_threads():
                assert_same(snapshot(copies, loaded, loss, keep=False), theirs[step], ctx)


# ---------------------------------------------------------------------------------------------
# errors: torch's exception type, raised before anything moves


def _stepped(run, specs, kwargs, grads_before, optimizer, prepare=None):
    """An optimizer on ``run`` over ``specs``, stepped with each of ``grads_before``, then
    ``prepare(opt, params)`` (if given): ``(optimizer, its parameters)``."""
    params = make_params(specs)
    opt = make_optimizer(optimizer, run, params, copy.deepcopy(kwargs))
    for step, grads_k in enumerate(grads_before):
        take_step(opt, params, grads_k, step)
    if prepare is not None:
        params = prepare(opt, params)
    return opt, params


def _failed_step(run, specs, kwargs, grads_before, grads, error, match, optimizer, prepare=None):
    """On ``run``: an optimizer over ``specs`` steps with each of ``grads_before``; then
    ``prepare(opt, params)`` (if given) and a step with ``grads``, which must raise ``error``.
    Returns the optimizer, its parameters and a kept snapshot from before the failing step."""
    opt, params = _stepped(run, specs, kwargs, grads_before, optimizer, prepare)
    before = snapshot(params, opt, None, keep=True)
    set_grads(params, grads)
    with pytest.raises(error, match=match):
        opt.step()
    return opt, params, before


def _check_error(
    optimizer,
    backend,
    specs,
    kwargs,
    grads_before,
    grads,
    error,
    match,
    prepare=None,
    after=None,
    labels=None,
):
    """torch raises ``error`` on the step with ``grads``; roundpipe raises it too and leaves
    every parameter, every state value and the set of state entries as they were. Then (where
    ``after`` gives the grads of a step that torch takes) roundpipe steps on with ``after``
    exactly as a torch optimizer that never took the failing step."""
    case = StagedCase(optimizer, kwargs, len(grads_before) + 1)
    with torch_threads(conformance_threads()):
        _failed_step(TORCH, specs, kwargs, grads_before, grads, error, match, optimizer, prepare)
        opt, params, before = _failed_step(
            backend, specs, kwargs, grads_before, grads, error, match, optimizer, prepare
        )
        ctx = Context(case, backend, labels or specs)
        ctx.step = len(grads_before)
        with harness_threads():
            assert_same(snapshot(params, opt, None, keep=False), before, ctx, vs="before the failed step")
        if after is None:
            return
        fix, grads_after = after
        fix(opt)
        ref_opt, ref = _stepped(TORCH, specs, kwargs, grads_before, optimizer, prepare)
        fix(ref_opt)
        loss = take_step(ref_opt, ref, grads_after, len(grads_before))
        mine = take_step(opt, params, grads_after, len(grads_before))
        with harness_threads():
            assert_same(
                snapshot(params, opt, mine, keep=False),
                snapshot(ref, ref_opt, loss, keep=False),
                ctx,
                vs="torch's without the failed step",
            )


def _grads(specs, step, none=()):
    return [None if i in none else g for i, g in enumerate(gradients(specs, step))]


def _nothing(opt):
    pass


ADAFACTOR_COMPLEX = (ParamSpec("3x5", (3, 5)), ParamSpec("complex 4", (4,), torch.complex64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stepped", [0, 2], ids=lambda n: f"after{n}steps")
def test_adafactor_complex_param(stepped, backend):
    specs = ADAFACTOR_COMPLEX
    _check_error(
        "Adafactor",
        backend,
        specs,
        {"weight_decay": 0.1},
        [_grads(specs, k, none={1}) for k in range(stepped)],
        _grads(specs, stepped),
        RuntimeError,
        "complex",
        after=(_nothing, _grads(specs, stepped, none={1})),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stepped", [0, 2], ids=lambda n: f"after{n}steps")
@pytest.mark.parametrize("empty", [(0,), (3, 0)], ids=lambda s: "empty" + "x".join(map(str, s)))
def test_adafactor_empty_param(empty, stepped, backend):
    """torch's for-loop divides by ``numel() ** 0.5`` (ZeroDivisionError) after stepping the
    parameters before the empty one; roundpipe raises it before anything moves."""
    specs = (ParamSpec("3x5", (3, 5)), ParamSpec("7", (7,)), ParamSpec("empty", empty))
    _check_error(
        "Adafactor",
        backend,
        specs,
        {"weight_decay": 0.1},
        [_grads(specs, k, none={2}) for k in range(stepped)],
        _grads(specs, stepped),
        ZeroDivisionError,
        None,
        after=(_nothing, _grads(specs, stepped, none={2})),
    )


MUON_ERROR_PARAMS = (ParamSpec("3x5", (3, 5)), ParamSpec("9x1", (9, 1)))


def _ns_steps(n):
    def fix(opt):
        opt.param_groups[0]["ns_steps"] = n

    return fix


@pytest.mark.skipif(not HAS_MUON, reason="torch < 2.9")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stepped", [0, 2], ids=lambda n: f"after{n}steps")
def test_muon_ns_steps_100(stepped, backend):
    """``ns_steps=100``: torch's ``_zeropower_via_newtonschulz`` raises ValueError (after the
    first parameter's buffer moved); roundpipe raises it before anything moves."""
    specs = MUON_ERROR_PARAMS
    _check_error(
        "Muon",
        backend,
        specs,
        {"lr": 0.02},
        [_grads(specs, k) for k in range(stepped)],
        _grads(specs, stepped),
        ValueError,
        "less than 100",
        prepare=lambda opt, params: (_ns_steps(100)(opt), params)[1],
        after=(_ns_steps(5), _grads(specs, stepped)),
    )


@pytest.mark.skipif(not HAS_MUON, reason="torch < 2.9")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(7,), (2, 3, 4)], ids=lambda s: "x".join(map(str, s)))
def test_muon_grad_not_2d(shape, backend):
    """A parameter that is not a matrix, in a group added after the constructor's check: torch
    raises ValueError on its gradient (after stepping the first group); roundpipe raises it
    before anything moves."""
    specs = MUON_ERROR_PARAMS
    extra_spec = ParamSpec("x".join(map(str, shape)), shape)
    g = torch.Generator().manual_seed(99)
    extra_value = torch.randn(shape, generator=g)

    def add_group(opt, params):
        p = extra_value.clone().requires_grad_()
        opt.add_param_group({"params": [p]})
        return [*params, p]

    grads = [*_grads(specs, 1), torch.randn(shape, generator=torch.Generator().manual_seed(7))]
    _check_error(
        "Muon",
        backend,
        specs,
        {"lr": 0.02},
        [_grads(specs, 0)],
        grads,
        ValueError,
        "2D",
        prepare=add_group,
        after=(_nothing, [*_grads(specs, 1), None]),
        labels=(*specs, extra_spec),
    )


# ---------------------------------------------------------------------------------------------
# the comparison itself


def test_assert_same_sees_every_bit():
    """One ulp, the sign of a zero, a missing state entry and a dtype each fail ``assert_same``."""
    case = StagedCase("Adafactor", {}, 1)
    params = make_params(case.params[:2])
    opt = torch.optim.Adafactor(params)
    set_grads(params, gradients(case.params, 0)[:2])
    opt.step()
    ctx = Context(case, TORCH)
    base = snapshot(params, opt, None, keep=True)
    assert_same(snapshot(params, opt, None, keep=True), base, ctx)

    def changed(edit):
        snap = snapshot(params, opt, None, keep=True)
        edit(snap)
        return snap

    def one_ulp(snap):
        flat = snap[1][0].view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf))

    def zero_sign(snap):
        snap[2][1]["row_var"].view(-1)[0] = 0.0
        base[2][1]["row_var"].view(-1)[0] = -0.0

    def missing(snap):
        del snap[2][0]["col_var"]

    def dtype(snap):
        snap[2][0]["step"] = snap[2][0]["step"].double()

    for edit in (one_ulp, missing, dtype, zero_sign):
        with pytest.raises(AssertionError):
            assert_same(changed(edit), base, ctx)
