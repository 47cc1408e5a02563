"""A step of a staged spec (``spec/staged.py``): ``run_staged_step``.

The same contract as ``launches.run_step``: everything is validated, the state created, the
scalars computed and every stage but the last run (they only read) before anything a user sees
is written; if any of that fails, the state the step created is rolled back and nothing else
has moved. Then the 0-d state is written, the last pass runs, the committed state entries are
copied in and each master's partner rounded from it (``masters.py``).

Each pass runs as one backend launch per program over every parameter that runs it
(``Backend.prepare_staged``). The plan and replay of ``launches.py`` are not used: a staged
step computes per-parameter values between its passes anyway.
"""

from __future__ import annotations

import torch

from ..backend_api import Backend
from ..spec.core import Options, Scratch
from ..spec.staged import Between, Pass
from ..tensors import is_dtensor
from .checks import (
    check_duplicates,
    check_overlap,
    raise_problem,
    scalar_state_problem,
    tensor_problem,
    where_of,
)
from .state import create_state, rollback
from .step_plan import stepped_params

_LOW = (torch.bfloat16, torch.float16)


def run_staged_step(opt, backend: Backend, factors=None) -> None:
    """One step of ``opt``, whose spec is a ``StagedSpec``, on ``backend``; ``factors``: the
    gradient factors loss scaling and clipping left for it (``amp.py``)."""
    spec = opt.spec
    name = type(opt).__name__
    work, seen = [], set()
    for gi, group in enumerate(opt.param_groups):
        indices, params, pairs = stepped_params(name, gi, group["params"])
        check_duplicates(name, gi, indices, params, seen)
        seen.update(map(id, params))
        work.append((gi, group, indices, params, pairs))
    check_overlap(name, work)
    created: list = []
    try:
        entries, memo = [], {}
        for gi, group, indices, params, pairs in work:
            spec.check_group(group)
            states = create_state(spec, group, params, opt.state, created)[0]
            for k, (pi, p, st) in enumerate(zip(indices, params, states, strict=True)):
                partner = pairs[0][k] if pairs is not None else None
                from_partner = pairs is not None and pairs[1][k]
                entries.append(_entry(spec, name, gi, group, pi, p, st, partner, from_partner, factors, memo))
        finals = _run_stages(backend, entries)
        launches = [backend.prepare_staged(program, *_columns(program, ctxs)) for program, ctxs in finals]
    except BaseException:
        rollback(opt.state, created)
        raise
    # Nothing has been written so far; every check has passed and every read-only stage ran.
    for e in entries:
        for n, scratch in e.scratch.items():
            _write_scalar(e.state[n], scratch)
    for launch in launches:
        launch()
    for e in entries:
        for entry, ctx_name in spec.commit:
            if entry in e.state:
                e.state[entry].copy_(e.ctx[ctx_name])
        if e.partner is not None:
            e.partner.copy_(e.param)


class _Entry:
    """One parameter of a staged step: its state, the scratch copies of its 0-d state, its
    stages and its context (``spec/staged.py``)."""

    __slots__ = ("param", "partner", "state", "scratch", "stages", "ctx")

    def __init__(self, param, partner, state, scratch, stages, ctx):
        self.param, self.partner, self.state = param, partner, state
        self.scratch, self.stages, self.ctx = scratch, stages, ctx


_F32 = torch.float32
_STRIDED = torch.strided


def _plain_state(t, shape) -> bool:
    """The common case of a state tensor, checked fast: a plain float32 CPU tensor, dense,
    contiguous, of ``shape`` (anything else goes through ``tensor_problem`` for its message)."""
    return (
        type(t) is torch.Tensor
        and t.dtype is _F32
        and t.is_cpu
        and t.layout is _STRIDED
        and t.is_contiguous()
        and t.shape == shape
    )


def _check_state(st, names, where):
    for n, shape in names.items():
        t = st.get(n)
        if _plain_state(t, shape):
            continue
        problem = tensor_problem(t, f": optimizer state {n!r}")
        if problem is None and tuple(t.shape) != tuple(shape):
            problem = (
                RuntimeError,
                f": optimizer state {n!r} has shape {tuple(t.shape)}, expected {tuple(shape)}",
            )
        if problem is not None:
            raise_problem(problem, where())


def _entry(spec, name, gi, group, pi, p, st, partner, from_partner, factors, memo):
    def where():
        return where_of(name, gi, pi, p)

    if is_dtensor(p):
        raise ValueError(
            f"{where()}: a DTensor; roundpipe.optim.{name} steps whole tensors (its statistics of "
            "a matrix span every shard, which each rank alone does not see): gather the "
            "parameter, or use torch.optim's on the full tensor"
        )
    o = spec.options(group, p)
    for n in spec.scalar_state:
        problem = scalar_state_problem(st.get(n), f": optimizer state {n!r}")
        if problem is not None:
            raise_problem(problem, where())
    names = spec.state_names(Options(o), p)
    _check_state(st, {n: torch.Size(shape) for n, shape in names.items()}, where)
    grad = partner.grad if from_partner else p.grad
    if grad.dtype in _LOW:  # a partner's gradient, as the fp32 master gradient torch would step
        grad = grad.float()
    scratch, values = _scalars(spec, name, gi, group, st, memo)
    found = factors.for_pairing(from_partner) if factors else ()
    if found:
        o = {**o, "grad_factors": len(found)}
        values = {**values, **{f"grad_factor_{i}": f for i, f in enumerate(found)}}
    ctx = {**values, "group": group, "options": o, "param": p, "grad": grad}
    for n in names:
        ctx[n] = st[n]
    return _Entry(p, partner, st, scratch, spec.stages(o), ctx)


def _scalars(spec, name, gi, group, st, memo):
    """``(scratch, values)``: the parameter's 0-d state advanced on scratch copies and its
    scalars; computed once per group and distinct 0-d state in a step (``memo``), as the
    elementwise specs' units do (``scalars`` sees nothing else)."""
    before = tuple((n, st[n].item(), st[n].dtype) for n in spec.scalar_state)
    hit = memo.get((gi, before))
    if hit is None:
        scratch = {n: Scratch(v, dtype) for n, v, dtype in before}
        try:
            values = spec.scalars(group, scratch)
        except (ValueError, TypeError, RuntimeError) as e:
            raise type(e)(
                f"roundpipe.optim.{name}: param_groups[{gi}]: "
                f"cannot compute this step's scalars from the group's hyperparameters: {e}"
            ) from e
        hit = memo[(gi, before)] = (scratch, values)
    return hit


def _run_stages(backend, entries):
    """Run every stage but the last of every entry, in rounds (stage k of each, one launch
    per program); return the last passes, grouped: ``[(program, contexts)]``."""
    depth = max((len(e.stages) for e in entries), default=0)
    for k in range(depth - 1):
        passes: dict = {}
        for e in entries:
            if k >= len(e.stages) - 1:
                continue
            stage = e.stages[k]
            if isinstance(stage, Between):
                stage.fn(e.ctx)
            else:
                passes.setdefault(stage.program, []).append(e.ctx)
        for program, ctxs in passes.items():
            results = backend.prepare_staged(program, *_columns(program, ctxs))()
            for ctx, reduced in zip(ctxs, results, strict=True):
                ctx.update(reduced)
    finals: dict = {}
    for e in entries:
        last = e.stages[-1]
        assert isinstance(last, Pass)
        finals.setdefault(last.program, []).append(e.ctx)
    return list(finals.items())


def _columns(program, ctxs):
    """A pass's per-parameter scalars and tensors, from the contexts."""
    scalars = [{n: float(ctx[n]) for n in program.scalars} for ctx in ctxs]
    tensors = [{n: ctx[n] for n in program.tensors} for ctx in ctxs]
    return scalars, tensors


def _write_scalar(t, scratch):
    if isinstance(scratch, Scratch):
        t.fill_(scratch.value)
    else:
        t.copy_(scratch)
