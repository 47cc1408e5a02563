"""A step's launches, run on the optimizer's plan: ``run_step``.

A step checks its plan (``StepPlan.check``; rebuilt with full validation by ``build`` when
something changed), computes each unit's scalars on scratch copies of its 0-d state, groups the
units into one launch per program, and has the backend prepare every launch (compiled, its
workspace allocated) before anything is written: then the 0-d state is written and the launches
run. If anything fails before that point, the state the step created is rolled back and nothing
else has moved.

When the last step's launches each ran one unit and nothing but the scalars and the gradients
changed, the step is a *replay* (``Replay``): each launch is the backend's ``rebind`` of the
last one, instead of grouping the units and preparing the launches again, which is most of what
a step of one small parameter costs (docs/step-plan.md). This is the only replay path.
"""

from __future__ import annotations

import torch

from .. import fused_kernels
from ..backend_api import Backend
from ..spec.core import Scratch
from ..spec.modes import StepMode
from ..spec.variants import has_remainder, resolved, stored, with_remainder
from ..storage import step_scalars
from ..tensors import LOW_PRECISION, Checked
from .state import rollback
from .step_plan import build

# 0-d state entries whose scalars are computed on Scratch values rather than tensor clones
_SCRATCH_DTYPES = (torch.float32, torch.float64)
_PLAN = "_roundpipe_plan"  # the optimizer's StepPlan, in its __dict__


class Replay:
    """What a step on an unchanged plan repeats (``StepPlan.replay``): every launch ran one
    unit, on a backend that rebinds a launch to new scalars and gradients."""

    __slots__ = ("backend", "entries")

    def __init__(self, backend, entries):
        self.backend = backend
        self.entries = entries  # (group plan, group index, unit, flags, backend's handle)


class _Launch:
    """One launch of a step: a program over every unit that runs it."""

    __slots__ = ("program", "scalars", "columns", "cache", "sole_unit")

    def __init__(self, program, scalars, columns, cache, sole_unit):
        self.program = program
        self.scalars = scalars
        self.columns = columns
        self.cache = cache  # the backend's cache for these units and this program
        self.sole_unit = sole_unit  # (group plan, unit) when it runs one unit, for a replay


def run_step(opt, backend: Backend, factors=None) -> None:
    """One step of ``opt`` (a roundpipe optimizer) on ``backend``; ``factors``: the gradient
    factors loss scaling and clipping left for it (``amp.py``)."""
    spec = opt.spec
    plan = opt.__dict__.get(_PLAN)
    grads = plan.check(opt, spec) if plan is not None else None
    if grads is not None and plan.replay is not None:
        try:
            ready = _replayed(opt, plan, grads, factors)
        except BaseException:
            opt.__dict__[_PLAN] = None  # rebuilt (and re-validated) by the next step
            raise
        if ready is not None:
            _write_and_launch(*ready, factors)
            return
    created: list = []
    try:
        if grads is None:
            # (a step on an unchanged plan has its settings checked by the backend's prepare)
            backend.check_settings()
            opt.__dict__[_PLAN] = None
            plan, grads, created = build(opt, spec, backend)
            opt.__dict__[_PLAN] = plan
        plan.replay = None
        scheduled = _schedule(opt, plan, grads, factors)
        if scheduled is None:  # a unit's 0-d state is no longer uniform: re-bucket
            plan, grads, more = build(opt, spec, backend)
            created += more
            opt.__dict__[_PLAN] = plan
            scheduled = _schedule(opt, plan, grads, factors)
        writeback, launches = scheduled
        # every launch of the step is prepared before any is run: if one cannot start, none does
        ready = [backend.prepare(ln.program, ln.scalars, ln.columns, ln.cache) for ln in launches]
    except BaseException:
        rollback(opt.state, created)
        opt.__dict__[_PLAN] = None  # rebuilt (and re-validated) by the next step
        raise
    # Nothing has been written so far; every check has passed.
    _write_and_launch(writeback, ready, factors)
    for st, name, rounded in plan.deferred:  # (float32 this step, as the float32 step created it)
        st[name] = rounded.copy_(st[name])
    plan.deferred = []
    if not plan.valid_for_one_step and all(ln.sole_unit for ln in launches):
        plan.replay = _replay_of(backend, plan, launches)


def _write_and_launch(writeback, ready, factors):
    if factors is not None and factors.before_launch is not None:
        factors.before_launch()
    for unit, scratch in writeback:
        unit.write(scratch)
    for launch in ready:
        launch()


def _unit_scalars(opt, gp, unit):
    """A unit's step: ``(scratch, values, flags)``, its 0-d state advanced on scratch copies,
    the float scalars, and the flags selecting its program. Writes nothing."""
    heads = unit.scalar_heads
    if all([t.dtype in _SCRATCH_DTYPES for _, t in heads]):
        scratch = {n: Scratch(t.item(), t.dtype) for n, t in heads}
    else:
        scratch = {n: t.clone() for n, t in heads}
    try:
        computed = opt.spec.scalars(gp.group, scratch)
        # bools are flags (they select the program), the rest float scalars
        values = {k: v if type(v) is float else float(v) for k, v in computed.items() if type(v) is not bool}
        if unit.storage:  # stepped widened: torch's float32 step, its scalars as float32's
            if unit.storage == StepMode.STOCHASTIC:
                values.update(step_scalars(opt._roundpipe_sr_seed, opt._roundpipe_sr_steps))
        elif unit.dtype in LOW_PRECISION and opt.spec.low_precision_scalars is not None:
            zero_dim = unit.flags.get("zero_dim", False)
            values = opt.spec.low_precision_scalars(gp.group, values, unit.dtype, zero_dim)
    except (ValueError, TypeError, RuntimeError) as e:
        raise type(e)(
            f"roundpipe.optim.{type(opt).__name__}: param_groups[{gp.gi}]: "
            f"cannot compute this step's scalars from the group's hyperparameters: {e}"
        ) from e
    flags = unit.flags
    if len(values) != len(computed):
        flags = {**flags, **{k: v for k, v in computed.items() if type(v) is bool}}
    return scratch, values, flags


def _with_factors(factors, unit, flags, values):
    """A unit's flags and scalars with the gradient factors its gradients take (``amp.py``):
    a partner's low-precision gradient, or its own."""
    found = factors.for_pairing(unit.pairing[0] is not torch.float32)
    if not found:
        return flags, values
    flags = {**flags, "grad_factors": len(found)}
    return flags, {**values, **{f"grad_factor_{i}": f for i, f in enumerate(found)}}


def _schedule(opt, plan, grads, factors):
    """``(writeback, launches)``: each unit's scalars (on scratch copies of its 0-d state) and
    the step's launches, one per distinct program over every unit that runs it. Writes nothing.
    None when a unit's 0-d state has stopped being uniform (the plan is rebuilt)."""
    spec = opt.spec
    writeback = []
    by_program: dict = {}
    for gp, group_grads in zip(plan.groups, grads, strict=True):
        for unit in gp.units:
            if not unit.uniform():
                return None
            scratch, values, flags = _unit_scalars(opt, gp, unit)
            if factors:
                flags, values = _with_factors(factors, unit, flags, values)
            writeback.append((unit, scratch))
            memo = plan.programs.get(unit)  # the unit's last flags and their program
            if memo is not None and memo[0] == flags:
                program = memo[1]
            else:
                program = spec.program({**gp.options, **flags})
                if has_remainder(program):  # (a fused group's: its remainder's step, measured)
                    step = fused_kernels.remainder_step(unit.dtype)
                    program = resolved(program, False) if step is None else with_remainder(program, step)
                if unit.storage:
                    program = stored(program, unit.storage)
                plan.programs[unit] = (flags, program)
            grad_col = gp.grad_columns(group_grads, unit)
            # (a bfloat16 unit's program equals a float32 one's, but its launch rounds otherwise)
            key = (program, unit.pairing, unit.dtype, unit.state_dtypes)
            by_program.setdefault(key, []).append((gp, unit, values, grad_col))
    launches = [_launch(plan, key[0], key[1], parts) for key, parts in by_program.items()]
    return writeback, launches


def _launch(plan, program, pairing, parts):
    """The launch of ``program`` over the units of ``parts`` (``(group plan, unit, scalars,
    gradient column)`` each); its static columns and backend cache kept in the plan."""
    key = (program, *[id(unit) for _, unit, _, _ in parts])
    hit = plan.launch_caches.get(key)
    if hit is None:
        names = (*program.tensors, "partner") if pairing[1] is not None else program.tensors
        static = {
            n: Checked(t for _, unit, _, _ in parts for t in unit.columns[n]) for n in names if n != "grad"
        }
        if program.storage == StepMode.STOCHASTIC:  # each parameter's id (ints, not tensors)
            static["sr_ids"] = tuple(i for _, unit, _, _ in parts for i in unit.columns["sr_ids"])
        hit = plan.launch_caches[key] = (static, {})
    static, cache = hit
    columns = dict(static)
    if "grad" in program.tensors:
        columns["grad"] = parts[0][3] if len(parts) == 1 else Checked(t for *_, col in parts for t in col)
    if len(parts) == 1:
        scalars = parts[0][2]
    else:
        scalars = [(values, len(unit.positions)) for _, unit, values, _ in parts]
    sole_unit = (parts[0][0], parts[0][1]) if len(parts) == 1 and "grad" in program.tensors else None
    return _Launch(program, scalars, columns, cache, sole_unit)


def _replay_of(backend, plan, launches):
    """The ``Replay`` of this step's launches (each ran one unit), or None where the backend
    does not replay one of them."""
    gis = {id(gp): gi for gi, gp in enumerate(plan.groups)}
    entries = []
    for ln in launches:
        gp, unit = ln.sole_unit
        handle = backend.replay_handle(ln.program, ln.cache)
        if handle is None:
            return None
        entries.append((gp, gis[id(gp)], unit, plan.programs[unit][0], handle))
    return Replay(backend, tuple(entries))


def _replayed(opt, plan, grads, factors):
    """The step as the last one ran, when nothing but the scalars and the gradients changed:
    ``(writeback, launches)`` ready to run, or None (the full path runs). Writes nothing the
    full path would not overwrite (the backends' scalar rows)."""
    replay = plan.replay
    backend = replay.backend
    writeback, ready = [], []
    for gp, gi, unit, flags, handle in replay.entries:
        if not unit.uniform():
            return None
        scratch, values, now = _unit_scalars(opt, gp, unit)
        if factors:
            now, values = _with_factors(factors, unit, now, values)
        if now is not flags and now != flags:
            return None
        launch = backend.rebind(handle, values, gp.grad_columns(grads[gi], unit))
        if launch is None:
            return None
        writeback.append((unit, scratch))
        ready.append(launch)
    return writeback, ready
