"""The optimizer classes' shared machinery: API, validation and the step loop.

Each ``roundpipe.optim`` class subclasses its ``torch.optim`` namesake and reuses its
``__init__``: the signature, defaults, hyperparameter checks, ``param_groups`` layout,
``__setstate__`` and ``state_dict`` are torch's own, so they match by construction. What this
module adds:

* a keyword-only ``backend=`` argument (and ``ROUNDPIPE_OPTIM_BACKEND``), not stored in
  ``defaults`` or ``param_groups``, so state dicts stay interchangeable with torch.optim;
* the contract's placeholders: ``foreach``/``fused`` are ignored with a warning,
  ``capturable=True``/``differentiable=True`` raise ``ValueError``;
* ``step()``: checks the step plan (``plan/``: built once, checked cheaply every step, rebuilt
  with full validation when something changed), computes every unit's scalars, and only when
  all of that has passed writes anything: the 0-d state, then one backend launch per program.
  When the last step's launches each ran one unit and nothing but the scalars and gradients
  changed, the step is a *replay*: it repeats them (``_Replay``: the backend's ``rebind``)
  instead of grouping the units and preparing the launches again, which is most of what a
  step of one small parameter costs (docs/step-plan.md).
"""

from __future__ import annotations

import inspect
import itertools
import sys
import warnings
from typing import ClassVar

import torch
from torch.optim import optimizer as _torch_optimizer

from . import amp, backends, torch_support
from .masters import partner_of
from .plan import adopt_flat_state, rollback
from .plan import build as build_plan
from .spec.core import OptimizerSpec, Scratch
from .tensors import Checked

# 0-d state entries whose scalars are computed on Scratch values rather than tensor clones
_SCRATCH_DTYPES = (torch.float32, torch.float64)


class RoundpipeOptimizer(torch.optim.Optimizer):
    """Base of the ``roundpipe.optim`` classes (``optimizers.py``); subclasses set ``spec``."""

    spec: ClassVar[OptimizerSpec | None] = None
    _roundpipe_backend: str
    # torch's GradScaler hands the unscale and its inf check to the step (amp.py)
    _step_supports_amp_scaling = True
    _roundpipe_folds_grad_factors = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.spec is None:
            return
        torch_cls = cls.spec.torch_class
        if not issubclass(cls, torch_cls):
            raise TypeError(f"{cls.__name__} must subclass {torch_cls.__name__}")
        cls.__init__ = _make_init(cls, torch_cls)  # type: ignore[method-assign]
        if torch_cls.__doc__:  # help() shows torch's description of the algorithm and arguments
            cls.__doc__ = f"{cls.__doc__ or ''}\n\n{inspect.cleandoc(torch_cls.__doc__)}"

    @property
    def backend(self) -> str:
        """The name of the backend this optimizer runs on."""
        return self._roundpipe_backend

    def __getstate__(self):
        state = super().__getstate__()
        state["_roundpipe_backend"] = self._roundpipe_backend
        return state

    def __setstate__(self, state):
        # torch's load_state_dict() calls this too, without the backend: keep ours then
        if "_roundpipe_backend" not in state and "_roundpipe_backend" not in self.__dict__:
            state = {**state, "_roundpipe_backend": backends.resolve(None)}
        super().__setstate__(state)

    def __repr__(self):
        return (
            super()
            .__repr__()
            .replace(f"{type(self).__name__} (", f"{type(self).__name__} (backend={self.backend!r},", 1)
        )

    def step(*args, **kwargs):  # noqa: N805 (``self`` is args[0], as in torch's wrapper)
        """Perform a single optimization step, as ``torch.optim``'s ``step`` does.

        All or nothing: everything that can fail (validation, the scalars, the engine's
        compilation and workspaces) happens before the first write, so an exception (or a
        KeyboardInterrupt) before it leaves every parameter and state entry as it was."""
        if "torch._dynamo" in sys.modules and torch.compiler.is_compiling():
            return _disabled(_hooked_step)(*args, **kwargs)
        return _hooked_step(*args, **kwargs)

    # torch's __init__ wraps an unmarked step in its hook runner (profile_hook_step); ours runs
    # the same hooks (_hooked_step) for less, which a step of one parameter pays
    step.hooked = True

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """``torch.nn.utils.clip_grad_norm_`` over every gradient the next step reads, the
        masters' partners' included (widened, unscaled): returns the total norm; the next step
        applies the clip coefficient in its own pass (``roundpipe.optim.amp``)."""
        return amp.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach)

    @torch._disable_dynamo
    def zero_grad(self, set_to_none: bool = True):
        """torch's ``zero_grad``, and the same for the gradients of the masters' partners
        (``roundpipe.optim.pair``): the step reads those. A clip or unscale recorded for the
        next step is dropped with the gradients it was computed from."""
        amp.clear(self)
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                q = partner_of(p)
                if q is not None and q.grad is not None:
                    if set_to_none:
                        q.grad = None
                    else:
                        if q.grad.grad_fn is not None:
                            q.grad.detach_()
                        else:
                            q.grad.requires_grad_(False)
                        q.grad.zero_()

    def _unit_scalars(self, gp, unit):
        """A unit's step: ``(scratch, values, flags)``, its 0-d state advanced on scratch copies,
        the float scalars, and the flags selecting its program. Writes nothing."""
        heads = unit.scalar_heads
        if all([t.dtype in _SCRATCH_DTYPES for _, t in heads]):
            scratch = {n: Scratch(t.item(), t.dtype) for n, t in heads}
        else:
            scratch = {n: t.clone() for n, t in heads}
        try:
            computed = self.spec.scalars(gp.group, scratch)
            # bools are flags (they select the program), the rest float scalars
            values = {
                k: v if type(v) is float else float(v) for k, v in computed.items() if type(v) is not bool
            }
        except (ValueError, TypeError, RuntimeError) as e:
            raise type(e)(
                f"roundpipe.optim.{type(self).__name__}: param_groups[{gp.gi}]: "
                f"cannot compute this step's scalars from the group's hyperparameters: {e}"
            ) from e
        flags = unit.flags
        if len(values) != len(computed):
            flags = {**flags, **{k: v for k, v in computed.items() if type(v) is bool}}
        return scratch, values, flags

    def _schedule(self, plan, grads, factors=None):
        """Each unit's scalars (on scratch copies of its 0-d state) and the step's launches: one
        per distinct program, over every unit that runs it. Writes nothing. None when a unit's
        0-d state has stopped being uniform (the plan is rebuilt)."""
        spec = self.spec
        writeback = []
        by_program: dict = {}
        for gp, group_grads in zip(plan.groups, grads, strict=True):
            for unit in gp.units:
                if not unit.uniform():
                    return None
                scratch, values, flags = self._unit_scalars(gp, unit)
                if factors:
                    flags, values = _with_factors(factors, unit, flags, values)
                writeback.append((unit, scratch))
                memo = plan.cache.get(unit)  # the unit's last flags and their program
                if memo is not None and memo[0] == flags:
                    program = memo[1]
                else:
                    program = spec.program({**gp.options, **flags})
                    plan.cache[unit] = (flags, program)
                grad_col = gp.grad_columns(group_grads, unit)
                by_program.setdefault((program, unit.pairing), []).append((gp, unit, values, grad_col))
        launches = []
        for (program, pairing), parts in by_program.items():
            key = (program, *[id(unit) for _, unit, _, _ in parts])
            hit = plan.cache.get(key)
            if hit is None:
                names = (*program.tensors, "partner") if pairing[1] is not None else program.tensors
                static = {
                    n: Checked(t for _, unit, _, _ in parts for t in unit.columns[n])
                    for n in names
                    if n != "grad"
                }
                hit = plan.cache[key] = (static, {})
            static, cache = hit
            columns = dict(static)
            if "grad" in program.tensors:
                columns["grad"] = (
                    parts[0][3] if len(parts) == 1 else Checked(t for *_, col in parts for t in col)
                )
            if len(parts) == 1:
                scalars = parts[0][2]
            else:
                scalars = [(values, len(unit.positions)) for _, unit, values, _ in parts]
            # (the group plan and unit when the launch runs one unit: see _Replay)
            sole_unit = (parts[0][0], parts[0][1]) if len(parts) == 1 and "grad" in program.tensors else None
            launches.append((program, scalars, columns, cache, sole_unit))
        return writeback, launches

    def _replay_schedule(self, plan, grads, factors=None):
        """The step as the last one ran, when nothing but the scalars and the gradients
        changed: ``(writeback, launches)`` ready to run, or None (the full path runs). Writes
        nothing the full path would not overwrite (the backends' scalar rows)."""
        replay = plan.replay
        backend = replay.backend
        writeback, ready = [], []
        for gp, gi, unit, flags, handle in replay.entries:
            if not unit.uniform():
                return None
            scratch, values, now = self._unit_scalars(gp, unit)
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


class _Replay:
    """What a step on an unchanged plan repeats (``StepPlan.replay``): every launch ran one
    unit, on a backend that can rebind a launch to new scalars and gradients. Per step it
    skips the grouping of units into launches and the backend's full ``prepare``."""

    __slots__ = ("backend", "entries")

    def __init__(self, backend, entries):
        self.backend = backend
        self.entries = entries  # (group plan, group index, unit, flags, backend's handle)


def _with_factors(factors, unit, flags, values):
    """A unit's flags and scalars with the gradient factors its gradients take (``amp.py``):
    a partner's low-precision gradient, or its own."""
    found = factors.for_pairing(unit.pairing[0] is not torch.float32)
    if not found:
        return flags, values
    flags = {**flags, "grad_factors": len(found)}
    return flags, {**values, **{f"grad_factor_{i}": f for i, f in enumerate(found)}}


def _run_step(opt):
    factors = amp.begin_step(opt)  # raises before anything moves where scaling cannot be seen
    if factors is not None:  # None: an inf or NaN under loss scaling, the step modifies nothing
        _run_plan(opt, factors)
    amp.clear(opt)  # (a step that raised keeps what was recorded for it: it changed nothing)


def _run_plan(opt, factors):
    plan = opt.__dict__.get("_roundpipe_plan")
    grads = plan.check(opt, opt.spec) if plan is not None else None
    if grads is not None and plan.replay is not None:
        try:
            ready = opt._replay_schedule(plan, grads, factors)
        except BaseException:
            opt._roundpipe_plan = None  # rebuilt (and re-validated) by the next step
            raise
        if ready is not None:
            for unit, scratch in ready[0]:
                unit.write(scratch)
            for launch in ready[1]:
                launch()
            return
    backend = backends.get(opt._roundpipe_backend)
    created = []
    try:
        if grads is None:
            # (a step on an unchanged plan has its settings checked by the backend's prepare)
            backend.check_settings()
            opt._roundpipe_plan = None
            plan, grads, created = build_plan(opt, opt.spec, backend)
            opt._roundpipe_plan = plan
        plan.replay = None
        schedule = opt._schedule(plan, grads, factors)
        if schedule is None:  # a unit's 0-d state is no longer uniform: re-bucket
            plan, grads, more = build_plan(opt, opt.spec, backend)
            created += more
            opt._roundpipe_plan = plan
            schedule = opt._schedule(plan, grads, factors)
        writeback, launches = schedule
        # every launch of the step is prepared (compiled, its workspace allocated) before any
        # is run: if one cannot start, none does
        ready = [
            backend.prepare(prog, scalars, columns, cache) for prog, scalars, columns, cache, _ in launches
        ]
    except BaseException:
        rollback(opt.state, created)
        opt._roundpipe_plan = None  # rebuilt (and re-validated) by the next step
        raise
    # Nothing has been written so far; every check has passed.
    for unit, scratch in writeback:
        unit.write(scratch)
    for launch in ready:
        launch()
    if (
        not plan.valid_for_one_step
        and hasattr(backend, "replay_handle")
        and all(sole_unit for *_, sole_unit in launches)
    ):
        # the next step may repeat this one's launches (plan.cache holds each unit's flags)
        gis = {id(gp): gi for gi, gp in enumerate(plan.groups)}
        entries = tuple(
            (gp, gis[id(gp)], unit, plan.cache[unit][0], backend.replay_handle(prog, cache))
            for prog, _, _, cache, (gp, unit) in launches
        )
        if all(e[-1] is not None for e in entries):
            plan.replay = _Replay(backend, entries)


def _hooked_step(*args, **kwargs):
    """torch's ``Optimizer.profile_hook_step`` wrapper, the same hooks in the same order with
    the same arguments, under a ``record_function`` of the same name (torch's cheap C++ one
    where it has it: the Python one costs far more, even with no profiler running)."""
    self = args[0]
    cls = type(self)
    if cls.step is not RoundpipeOptimizer.step:
        # a subclass's own step: torch wrapped that one in its hook runner, which runs the hooks
        return _step_body(*args, **kwargs)
    name = _step_names.get(cls)
    if name is None:
        name = _step_names[cls] = f"Optimizer.step#{cls.__name__}.step"
    with _record_function(name):
        if _torch_optimizer._global_optimizer_pre_hooks or self._optimizer_step_pre_hooks:
            for pre_hook in itertools.chain(
                _torch_optimizer._global_optimizer_pre_hooks.values(),
                self._optimizer_step_pre_hooks.values(),
            ):
                result = pre_hook(self, args, kwargs)
                if result is not None:
                    if isinstance(result, tuple) and len(result) == 2:
                        args, kwargs = result
                    else:
                        raise RuntimeError(
                            f"{_step_body} must return None or a tuple of (new_args, new_kwargs), "
                            f"but got {result}."
                        )
        out = _step_body(*args, **kwargs)
        self._optimizer_step_code()
        if self._optimizer_step_post_hooks or _torch_optimizer._global_optimizer_post_hooks:
            for post_hook in itertools.chain(
                self._optimizer_step_post_hooks.values(),
                _torch_optimizer._global_optimizer_post_hooks.values(),
            ):
                post_hook(self, args, kwargs)
        return out


def _step_body(self, closure=None):
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    grad_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        _run_step(self)
    finally:
        torch._C._set_grad_enabled(grad_enabled)
    return loss


_step_names: dict = {}  # class -> its step's profiler name (as torch's wrapper names it)
_record_function = getattr(torch._C._profiler, "_RecordFunctionFast", torch.autograd.profiler.record_function)
_disabled_fns: dict = {}


def _disabled(fn):
    """``fn`` run as itself inside ``torch.compile``: dynamo would otherwise trace into numba's
    dispatcher (and fail) or recompile the torch engine's ops with inductor (other rounding).
    Only called once dynamo is imported (``torch.compiler.disable`` imports it, which is slow)."""
    hit = _disabled_fns.get(fn)
    if hit is None:
        hit = _disabled_fns[fn] = torch.compiler.disable(fn, recursive=True)
    return hit


# ----------------------------------------------------------------------------------------------
# __init__: torch's signature plus ``backend``


_PLACEHOLDER_WARN = ("foreach", "fused")
_PLACEHOLDER_FALSE = ("capturable", "differentiable")


def _make_init(cls, torch_cls):
    torch_sig = inspect.signature(torch_cls.__init__)
    backend_param = inspect.Parameter(
        "backend", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None"
    )
    public_sig = torch_sig.replace(parameters=[*torch_sig.parameters.values(), backend_param])

    def __init__(self, *args, backend=None, **kwargs):
        bound = torch_sig.bind(self, *args, **kwargs)
        arguments = bound.arguments
        for opt in _PLACEHOLDER_FALSE:
            if arguments.get(opt):
                raise ValueError(
                    f"roundpipe.optim.{cls.__name__} does not support {opt}=True "
                    "(it steps fp32 tensors on the CPU in place)"
                )
        for opt in _PLACEHOLDER_WARN:
            if arguments.get(opt) is not None:
                warnings.warn(
                    f"roundpipe.optim.{cls.__name__}: {opt}={arguments[opt]!r} is ignored; "
                    "roundpipe runs its own CPU implementation",
                    UserWarning,
                    stacklevel=2,
                )
                arguments[opt] = None
        self._roundpipe_backend = backends.resolve(backend)
        torch_cls.__init__(*bound.args, **bound.kwargs)
        below = getattr(backends.get(self._roundpipe_backend), "flat_state_below", 0)
        if self.state:  # state torch's __init__ created (Adagrad): nobody has seen it
            for group in self.param_groups:
                params = [p for p in group["params"] if p in self.state]
                names = (
                    [n for n in self.state[params[0]] if n not in self.spec.scalar_state] if params else []
                )
                states = [self.state[p] for p in params]
                adopt_flat_state(params, states, names, below, self.spec.scalar_state)
        torch_support.check_groups(cls, self.param_groups)

    __init__.__signature__ = public_sig
    __init__.__qualname__ = f"{cls.__name__}.__init__"
    __init__.__doc__ = torch_cls.__init__.__doc__
    return __init__
