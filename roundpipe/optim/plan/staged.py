"""A step of a staged spec (``spec/staged.py``): ``run_staged_step``.

The same contract as ``launches.run_step``: everything is validated, the state created, the
scalars computed and every stage but the last run (they only read) before anything a user sees
is written; if any of that fails, the state the step created is rolled back and nothing else
has moved. Then the 0-d state is written, the last pass runs, the committed state entries are
copied in and each master's partner rounded from it (``masters.py``).

Each pass runs as one backend launch per program over every parameter that runs it
(``Backend.prepare_staged``). What the validation found is kept (``_StagedPlan``) and checked
cheaply at the next step, as ``StepPlan`` is. A spec whose step is one pass and commits nothing
(the 8-bit family) *replays* on an unchanged plan (``_Replay``): each launch is the backend's
``rebind`` of the last one with this step's scalars and gradients, which skips the per-parameter
contexts and the launch's preparation, most of what a step of many small parameters costs. A
staged step with ``Between`` stages computes per-parameter values between its passes anyway and
takes the full path.
"""

from __future__ import annotations

import functools
import operator

import torch

from .. import masters
from ..backend_api import Backend
from ..masters import partner_of
from ..spec.core import Options, Scratch
from ..spec.staged import Between, Pass
from ..tensors import is_dtensor
from .checks import (
    grads_ok,
    raise_problem,
    scalar_state_problem,
    tensor_problem,
    where_of,
)
from .state import create_state, rollback
from .step_plan import stepped_work

_PLAN = "_roundpipe_staged_plan"  # the optimizer's _StagedPlan, in its __dict__


def run_staged_step(opt, backend: Backend, factors=None) -> None:
    """One step of ``opt``, whose spec is a ``StagedSpec``, on ``backend``; ``factors``: the
    gradient factors loss scaling and clipping left for it (``amp.py``)."""
    spec = opt.spec
    plan = opt.__dict__.get(_PLAN)
    grads = plan.check(opt, spec) if plan is not None else None
    if grads is not None and plan.replay is not None:
        try:
            ready = _replayed(opt, spec, backend, plan, grads, factors)
        except BaseException:
            opt.__dict__[_PLAN] = None  # rebuilt (and re-validated) by the next step
            raise
        if ready is not None:
            writes, launches = ready
            _write_scalars(writes)
            for launch in launches:
                launch()
            for partner, param in plan.replay.partners:
                partner.copy_(param)
            return
    created: list = []
    try:
        if grads is None:
            opt.__dict__[_PLAN] = None
            plan, created = _build(opt, spec)
            grads = plan.check(opt, spec)
            assert grads is not None, "a plan just built holds"
        opt.__dict__[_PLAN] = plan
        plan.replay = None
        entries, memo = [], {}
        for g, (gp, group_grads) in enumerate(zip(plan.groups, grads, strict=True)):
            spec.check_group(gp.group)
            for k, grad in enumerate(group_grads):
                entries.append(_entry(spec, type(opt).__name__, gp, (g, k), grad, factors, memo))
        caches = plan.launch_caches
        finals = _run_stages(backend, entries, caches)
        launches = [
            backend.prepare_staged(program, *_columns(program, es), _cache(caches, "last", program))
            for program, es in finals
        ]
    except BaseException:
        rollback(opt.state, created)
        opt.__dict__[_PLAN] = None  # rebuilt (and re-validated) by the next step
        raise
    # Nothing has been written so far; every check has passed and every read-only stage ran.
    _write_scalars((e.state, e.scratch) for e in entries)
    for launch in launches:
        launch()
    for e in entries:
        for entry, ctx_name in spec.commit:
            if entry in e.state:
                e.state[entry].copy_(e.ctx[ctx_name])
        if e.partner is not None:
            e.partner.copy_(e.param)
    if not spec.commit and all(len(e.stages) == 1 for e in entries):
        plan.replay = _replay_of(backend, entries, finals, caches)


class _Replay:
    """What a step of a one-pass spec on an unchanged plan repeats: each last launch's program,
    its parameters (``(group, position)`` in the plan, in the launch's order), how many gradient
    factors each took, and the backend's handle (None: the backend does not replay it, and the
    pass is prepared again from the plan's contexts); the partners to round afterwards."""

    __slots__ = ("passes", "partners")

    def __init__(self, passes, partners):
        self.passes = passes  # ((program, order, factor counts, handle or None), ...)
        self.partners = partners  # ((partner, param), ...)


def _replay_of(backend, entries, finals, caches):
    """The ``_Replay`` of this step's launches."""
    passes = []
    for program, es in finals:
        handle = backend.replay_handle(program, _cache(caches, "last", program))
        counts = tuple(len(e.factors) for e in es)
        passes.append((program, tuple(e.at for e in es), counts, handle))
    partners = tuple((e.partner, e.param) for e in entries if e.partner is not None)
    return _Replay(tuple(passes), partners)


def _replayed(opt, spec, backend, plan, grads, factors):
    """The step as the last one ran, when nothing but the scalars and the gradients changed:
    ``(writes, launches)`` ready to run (``writes`` as ``_write_scalars`` takes them), or None
    (the full path runs). Writes nothing the full path would not overwrite (the backend's
    scalar rows)."""
    name = type(opt).__name__
    memo: dict = {}
    per_group, writes = [], []
    for gp in plan.groups:
        spec.check_group(gp.group)
        scalars = _group_scalars(spec, name, gp, memo)
        per_group.append(scalars)
        writes += zip(gp.states, [scratch for scratch, _ in scalars], strict=True)
    merged: dict = {}  # (id of the scalars, factors) -> the scalars with the factors
    launches = []
    for program, order, counts, handle in plan.replay.passes:
        scalars = [per_group[g][k][1] for g, k in order]
        if factors or any(counts):
            for i, ((g, k), count) in enumerate(zip(order, counts, strict=True)):
                found = factors.for_pairing(plan.groups[g].from_partner[k]) if factors else ()
                if len(found) != count:
                    return None  # another program: the full path picks it
                if found:
                    key = (id(scalars[i]), found)
                    hit = merged.get(key)
                    if hit is None:
                        values = {f"grad_factor_{j}": f for j, f in enumerate(found)}
                        hit = merged[key] = {**scalars[i], **values}
                    scalars[i] = hit
        column = [grads[g][k] for g, k in order]
        if handle is None:
            launch = _prepared(backend, plan, program, order, scalars, column)
        else:
            launch = backend.rebind(handle, scalars, column)
            if launch is None:
                return None
        launches.append(launch)
    return writes, launches


def _prepared(backend, plan, program, order, scalars, column):
    """A replayed pass the backend does not rebind: prepared from the plan's contexts (what the
    full path's entries would hold), without building the entries."""
    names = [n for n in program.tensors if n != "grad"]
    rows: dict = {}  # id of a parameter's scalars -> the pass's scalars (a parameter's first)
    values = [
        rows.get(id(v)) or rows.setdefault(id(v), {n: float(v[n]) for n in program.scalars}) for v in scalars
    ]
    tensors = []
    for (g, k), grad in zip(order, column, strict=True):
        ctx = plan.groups[g].contexts[k]
        tensors.append(
            {**{n: ctx[n] for n in names}, "grad": grad}
            if "grad" in program.tensors
            else {n: ctx[n] for n in names}
        )
    return backend.prepare_staged(program, values, tensors, _cache(plan.launch_caches, "last", program))


def _group_scalars(spec, name, gp, memo) -> list:
    """``_scalars`` of each of the group's parameters, computed once per distinct 0-d state;
    where the 0-d state is Python ints (the 8-bit family's ``step``) read without a tuple per
    parameter."""
    states = gp.states
    if not spec.scalar_state or any(n not in spec.int_state for n in spec.scalar_state):
        return [_scalars(spec, name, gp.gi, gp.group, st, memo) for st in states]
    keys = list(zip(*[[st[n] for st in states] for n in spec.scalar_state], strict=True))
    first = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))  # key -> first position
    table = {key: _scalars(spec, name, gp.gi, gp.group, states[k], memo) for key, k in first.items()}
    return list(map(table.__getitem__, keys))


class _GroupPlan:
    """A param group's stepped parameters, validated: their partners, state and options."""

    __slots__ = (
        "gi",
        "group",
        "params_list",
        "n_params",
        "stepped",
        "params",
        "partners",
        "stepped_partners",
        "from_partner",
        "states",
        "state_tensors",
        "options",
        "names",
        "stages",
        "contexts",
        "grad_shapes",
        "grad_dtypes",
    )

    def stepped_now(self) -> list:
        """Which of the group's parameters have a gradient now (their own or a partner's)."""
        if self.partners is None:
            return [p.grad is not None for p in self.params_list]
        return [p.grad is not None or (q is not None and q.grad is not None) for p, q in self.partners]


class _StagedPlan:
    """What ``_build`` validated, and the cheap per-step check that it still holds (the same
    idea as ``StepPlan``: identities and a few attribute reads; anything else rebuilds)."""

    __slots__ = (
        "param_groups",
        "n_groups",
        "state",
        "n_state",
        "generation",
        "groups",
        "launch_caches",
        "replay",
    )

    def check(self, opt, spec):
        """This step's gradients per group, or None when the plan no longer holds."""
        if opt.param_groups is not self.param_groups or len(opt.param_groups) != self.n_groups:
            return None
        if opt.state is not self.state or len(opt.state) != self.n_state:
            return None
        if masters.generation() != self.generation:
            return None
        out = []
        state_get = opt.state.get
        for gp, group in zip(self.groups, opt.param_groups, strict=True):
            if group is not gp.group or group["params"] is not gp.params_list:
                return None
            if len(gp.params_list) != gp.n_params or gp.stepped_now() != gp.stepped:
                return None
            if not all(map(operator.is_, map(state_get, gp.params), gp.states)):
                return None
            tensors = [st.get(n) for st, names in zip(gp.states, gp.names, strict=True) for n in names]
            if not all(map(operator.is_, tensors, gp.state_tensors)):
                return None
            options = [spec.param_options(group, p, st) for p, st in zip(gp.params, gp.states, strict=True)]
            if options != gp.options:
                return None
            if gp.partners is None:
                grads = [p.grad for p in gp.params]
            else:
                pairs = zip(gp.params, gp.stepped_partners, gp.from_partner, strict=True)
                grads = [q.grad if src else p.grad for p, q, src in pairs]
            if not grads_ok(grads, gp.grad_shapes, gp.grad_dtypes):
                return None
            out.append(grads)
        return out


def _build(opt, spec):
    """Validate everything and create missing state: ``(plan, created)`` (``created`` as
    ``step_plan.build``'s, rolled back here on a failure)."""
    name = type(opt).__name__
    work = stepped_work(opt)
    created: list = []
    try:
        groups = [_group_plan(spec, name, opt.state, created, *w) for w in work]
    except BaseException:
        rollback(opt.state, created)
        raise
    plan = _StagedPlan()
    plan.param_groups, plan.n_groups = opt.param_groups, len(opt.param_groups)
    plan.state, plan.n_state = opt.state, len(opt.state)
    plan.generation = masters.generation()
    plan.groups = tuple(groups)
    plan.launch_caches = {}  # (stage round or "last", program) -> the backend's cache for that pass
    plan.replay = None  # a _Replay once a step could record one
    return plan, created


def _group_plan(spec, name, state, created, gi, group, indices, params, pairs):
    """A param group's plan: its parameters and state validated (created where missing)."""
    spec.check_group(group)
    states = create_state(spec, group, params, state, created)[0]
    gp = _GroupPlan()
    gp.gi, gp.group, gp.params_list, gp.n_params = gi, group, group["params"], len(group["params"])
    gp.params, gp.states = tuple(params), tuple(states)
    if pairs is None:
        gp.partners, gp.stepped_partners, gp.from_partner = None, None, (False,) * len(params)
    else:
        gp.partners = tuple((p, partner_of(p)) for p in group["params"])
        gp.stepped_partners, gp.from_partner = tuple(pairs[0]), tuple(pairs[1])
    gp.stepped = gp.stepped_now()
    gp.options, gp.names, tensors = [], [], []
    for pi, p, st in zip(indices, params, states, strict=True):
        where = functools.partial(where_of, name, gi, pi, p)
        if is_dtensor(p):
            raise ValueError(
                f"{where()}: a DTensor; roundpipe.optim.{name} steps each rank's local shards and issues "
                "no collectives, and its statistics of a matrix span every shard: use "
                f"torch.optim.{name} for DTensor parameters (its DTensor ops gather them)"
            )
        o = spec.param_options(group, p, st)
        for n in spec.scalar_state:
            problem = _scalar_problem(n in spec.int_state, st.get(n), f": optimizer state {n!r}")
            if problem is not None:
                raise_problem(problem, where())
        names = {n: _shape_and_dtype(kind) for n, kind in spec.state_names(Options(o), p).items()}
        _check_state(st, names, where)
        gp.options.append(o)
        gp.names.append((*(n for n in spec.scalar_state if n not in spec.int_state), *names))
        tensors += [st[n] for n in gp.names[-1]]
    gp.state_tensors = tuple(tensors)
    gp.stages = [spec.stages(o) for o in gp.options]
    # each parameter's context as far as it holds from step to step (``_entry`` adds the rest)
    gp.contexts = [
        {"group": group, "options": o, "param": p, **{n: st[n] for n in names}}
        for o, p, st, names in zip(gp.options, params, states, gp.names, strict=True)
    ]
    grads = [
        q.grad if src else p.grad
        for p, q, src in zip(
            params, gp.stepped_partners or (None,) * len(params), gp.from_partner, strict=True
        )
    ]
    gp.grad_shapes = tuple(g.shape for g in grads)
    gp.grad_dtypes = tuple(g.dtype for g in grads)
    return gp


class _Entry:
    """One parameter of a staged step: its state, the scratch copies of its 0-d state, its
    stages and its context (``spec/staged.py``); where it is in the plan (``at``: group,
    position) and the gradient factors it takes."""

    __slots__ = ("param", "partner", "state", "scratch", "stages", "ctx", "at", "factors")

    def __init__(self, param, partner, state, scratch, stages, ctx, at, factors):
        self.param, self.partner, self.state = param, partner, state
        self.scratch, self.stages, self.ctx = scratch, stages, ctx
        self.at, self.factors = at, factors


_F32 = torch.float32
_STRIDED = torch.strided


def _shape_and_dtype(kind) -> tuple:
    """``state_names``' entry as ``(torch.Size, dtype)``: a bare shape is float32."""
    if len(kind) == 2 and isinstance(kind[1], torch.dtype):
        return torch.Size(kind[0]), kind[1]
    return torch.Size(kind), _F32


def _scalar_problem(is_int, value, what):
    """A 0-d state entry's problem; ``is_int``: the entry is a Python int (``int_state``)."""
    if not is_int:
        return scalar_state_problem(value, what)
    if type(value) is int and value >= 0:
        return None
    return KeyError, f"{what} must be a non-negative Python int (the step count), got {value!r}"


def _plain_state(t, shape, dtype) -> bool:
    """The common case of a state tensor, checked fast: a plain CPU tensor of ``dtype``, dense,
    contiguous, of ``shape`` (anything else goes through ``tensor_problem`` for its message)."""
    return (
        type(t) is torch.Tensor
        and t.dtype is dtype
        and t.is_cpu
        and t.layout is _STRIDED
        and t.is_contiguous()
        and t.shape == shape
    )


def _check_state(st, names, where):
    for n, (shape, dtype) in names.items():
        t = st.get(n)
        if _plain_state(t, shape, dtype):
            continue
        # (a float32 entry of another shape keeps its own message; any other dtype is checked
        # against a meta tensor of what the spec declares)
        like = None if dtype is _F32 else torch.empty(shape, dtype=dtype, device="meta")
        problem = tensor_problem(t, f": optimizer state {n!r}", like=like)
        if problem is None and tuple(t.shape) != tuple(shape):
            problem = (
                RuntimeError,
                f": optimizer state {n!r} has shape {tuple(t.shape)}, expected {tuple(shape)}",
            )
        if problem is not None:
            raise_problem(problem, where())


def _entry(spec, name, gp, at, grad, factors, memo):
    k = at[1]
    from_partner = gp.from_partner[k]
    st = gp.states[k]
    scratch, values = _scalars(spec, name, gp.gi, gp.group, st, memo)
    stages = gp.stages[k]
    found = factors.for_pairing(from_partner) if factors else ()
    if found:
        values = {**values, **{f"grad_factor_{i}": f for i, f in enumerate(found)}}
        key = (id(stages), len(found))  # (the same options share their stages: built once)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = spec.stages({**gp.options[k], "grad_factors": len(found)})
        stages = hit
    ctx = gp.contexts[k].copy()
    ctx.update(values)
    ctx["grad"] = grad
    partner = gp.stepped_partners[k] if gp.stepped_partners is not None else None
    return _Entry(gp.params[k], partner, st, scratch, stages, ctx, at, found)


def _scalars(spec, name, gi, group, st, memo):
    """``(scratch, values)``: the parameter's 0-d state advanced on scratch copies and its
    scalars; computed once per group and distinct 0-d state in a step (``memo``), as the
    elementwise specs' units do (``scalars`` sees nothing else)."""
    before = tuple(
        (n, st[n], int) if n in spec.int_state else (n, st[n].item(), st[n].dtype) for n in spec.scalar_state
    )
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


def _run_stages(backend, entries, caches):
    """Run every stage but the last of every entry, in rounds (stage k of each, one launch
    per program); return the last passes, grouped: ``[(program, entries)]``."""
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
                passes.setdefault(stage.program, []).append(e)
        for program, es in passes.items():
            results = backend.prepare_staged(program, *_columns(program, es), _cache(caches, k, program))()
            for e, reduced in zip(es, results, strict=True):
                e.ctx.update(reduced)
    finals: dict = {}
    for e in entries:
        last = e.stages[-1]
        assert isinstance(last, Pass)
        finals.setdefault(last.program, []).append(e)
    return list(finals.items())


def _cache(caches, stage, program) -> dict:
    """The backend's cache for a pass (``stage``: its round, or "last"), kept with the plan."""
    return caches.setdefault((stage, program), {})


def _columns(program, entries):
    """A pass's per-parameter scalars and tensors, from the entries' contexts."""
    scalars = [{n: float(e.ctx[n]) for n in program.scalars} for e in entries]
    tensors = [{n: e.ctx[n] for n in program.tensors} for e in entries]
    return scalars, tensors


def _write_scalars(writes):
    """Each parameter's 0-d state (``writes``: ``(state, scratch copies)`` pairs) from its scratch
    copy: one foreach copy per new value where several parameters share it (their scratch is
    shared), else a fill."""
    by_value: dict = {}
    for state, scratches in writes:
        for n, scratch in scratches.items():
            if scratch.dtype is int:
                state[n] = scratch.value
                continue
            by_value.setdefault(id(scratch), (scratch, []))[1].append(state[n])
    for scratch, tensors in by_value.values():
        if len(tensors) < 4:
            for t in tensors:
                t.fill_(scratch.value)
        else:
            value = torch.tensor(scratch.value, dtype=scratch.dtype)
            torch._foreach_copy_(tensors, [value] * len(tensors))
