"""``StepPlan``, the plan of one optimizer, its per-step ``check``, and ``build``, which
validates everything and makes one."""

from __future__ import annotations

import operator

import torch

from .. import masters
from ..masters import partner_of, partner_problem
from ..spec.core import Options
from ..storage import DEFAULT, FUSED, fused_refusal
from .checks import (
    check_duplicates,
    check_overlap,
    check_partners,
    check_state,
    raise_problem,
    tensor_problem,
    where_of,
)
from .groups import GroupPlan, ptrs
from .state import adopt_flat_state, create_state, rollback


class StepPlan:
    """The plan of one optimizer (see the package docstring)."""

    __slots__ = (
        "param_groups",
        "n_groups",
        "state",
        "state_dicts",
        "pairings",
        "groups",
        "programs",
        "launch_caches",
        "valid_for_one_step",
        "replay",
        "deferred",
    )

    def __init__(self, opt, groups):
        self.param_groups = opt.param_groups
        self.n_groups = len(opt.param_groups)
        self.state = opt.state
        self.state_dicts = tuple(opt.state.values())
        self.pairings = masters.generation()  # pair()/unpair() since: rebuild
        self.groups = tuple(groups)
        self.programs: dict = {}  # unit -> (its last flags, their program)
        # (program, its units' ids) -> (the launch's static columns, the backend's cache)
        self.launch_caches: dict = {}
        # init flags (SGD's ``first``) hold for the step that created the state only
        self.valid_for_one_step = False
        self.replay = None  # what the next step may repeat (launches.Replay)
        # state created in float32 that the step's launches read as such, rounded into its
        # state dtype after them (state.create_state)
        self.deferred: list = []

    def check(self, opt, spec):
        """This step's gradients per group, or None if the plan no longer holds."""
        if self.valid_for_one_step:
            return None
        if opt.param_groups is not self.param_groups or len(opt.param_groups) != self.n_groups:
            return None
        state = opt.state
        if state is not self.state or len(state) != len(self.state_dicts):
            return None
        if not all(map(operator.is_, state.values(), self.state_dicts)):
            return None
        if masters.generation() != self.pairings:
            return None
        out = []
        is_ = operator.is_
        for gp, group in zip(self.groups, opt.param_groups, strict=False):
            if group is not gp.group or group["params"] is not gp.params_list:
                return None
            if len(gp.params_list) != gp.n_params or spec.options(group) != gp.options:
                return None
            if gp.n_stepped != gp.n_params and gp.stepped() != gp.n_stepped:
                return None
            grads = gp.grads() if gp.params else []
            if grads is None or not all(map(is_, gp.params_list, gp.params_items)):
                return None
            if not all(map(is_, [st.get(n) for n in gp.tensor_names for st in gp.states], gp.state_tensors)):
                return None
            if ptrs(gp.ptr_tensors, gp.no_dtensors) != gp.ptrs:
                return None
            out.append(grads)
        if len(out) != len(self.groups):  # a group with grads that the plan has not seen
            return None
        return out


def build(opt, spec, backend=None):
    """Validate everything, create missing state, return ``(plan, grads, created)``.

    ``created`` lists the state entries this call added, for ``rollback`` if the step fails
    later; on a failure here they are rolled back before the error propagates.
    """
    name = type(opt).__name__
    state = opt.state
    storage = getattr(opt, "_roundpipe_storage", DEFAULT)
    work = stepped_work(opt, low_precision=True, storage=storage)
    created = []  # (param, state dict, number of entries it had, whether it was added to state)
    deferred: list = []  # (state dict, name, its tensor of the state dtype): see create_state
    below = backend.flat_state_below if backend is not None else 0
    first_pid = 0  # a parameter's id: its position in the optimizer (state_dict's numbering)
    try:
        groups = []
        for gi, group, indices, params, pairs in work:
            options = spec.options(group)
            kept = fused_storage(name, gi, params, storage) if options.get("fused") else storage
            inputs = [n for n in spec.inputs(Options(options)) if n not in ("param", "grad")]
            states, init_flags, new_positions = create_state(
                spec, group, params, state, created, kept, deferred
            )
            if len(new_positions) > 1:
                # state nobody has seen yet is created in flat buffers; existing state (loaded,
                # or the caller's) is always updated where it is
                new_states = [states[i] for i in new_positions]
                new_params = [params[i] for i in new_positions]
                adopt_flat_state(new_params, new_states, inputs, below, spec.scalar_state)
            check_state(name, gi, indices, params, states, spec.scalar_state, inputs, kept, deferred)
            pids = tuple(first_pid + pi for pi in indices)
            first_pid += len(group["params"])
            groups.append(
                GroupPlan(spec, gi, group, indices, params, states, init_flags, options, pairs, kept, pids)
            )
        check_partners(name, groups)
        plan = StepPlan(opt, groups)
        plan.deferred = deferred
        plan.valid_for_one_step = bool(created)
    except BaseException:
        rollback(state, created)
        raise
    return plan, [gp.current_grads() for gp in groups], created


def fused_storage(name, gi, params, storage):
    """The storage of a ``fused=True`` group (``FUSED``: its 16-bit parameters widened), after
    torch's check of its parameters and the keywords fused steps do not take."""
    if storage != DEFAULT:
        raise TypeError(fused_refusal(name))
    for p in params:
        if not torch.is_floating_point(p):  # torch's _device_dtype_check_for_fused, its words
            raise RuntimeError(
                "`fused=True` requires all the params to be floating point Tensors of "
                f"supported devices: ['cpu'] but {p.dtype} and {p.device.type} "
                f"(roundpipe.optim.{name}: param_groups[{gi}])"
            )
    return FUSED


def stepped_work(opt, low_precision=False, storage=DEFAULT) -> list:
    """Each param group's ``(gi, group, indices, params, pairs)`` (``stepped_params``), checked
    for a parameter listed twice and for parameters that overlap in memory. ``low_precision``:
    bfloat16 and float16 parameters are stepped as they are (the elementwise specs); else
    refused (the staged ones). ``storage``: the optimizer's (``storage.py``), which some
    parameters' dtypes refuse."""
    name = type(opt).__name__
    work, seen = [], set()
    for gi, group in enumerate(opt.param_groups):
        indices, params, pairs = stepped_params(name, gi, group["params"], low_precision, storage)
        check_duplicates(name, gi, indices, params, seen)
        seen.update(map(id, params))
        work.append((gi, group, indices, params, pairs))
    check_overlap(name, work)
    return work


def stepped_params(cls_name, gi, group_params, low_precision=False, storage=DEFAULT):
    """The group's parameters this step updates, validated: ``(indices, params, pairs)``;
    ``pairs`` is ``(partners, grad_from_partner)`` (see GroupPlan) or None when no parameter
    has a partner (masters.py)."""
    partners = [partner_of(p) for p in group_params]
    if not any(q is not None for q in partners):
        partners = None
    indices = [
        pi
        for pi, p in enumerate(group_params)
        if p.grad is not None
        or (partners is not None and partners[pi] is not None and partners[pi].grad is not None)
    ]
    params = [group_params[pi] for pi in indices]
    grad_from_partner = []
    for pi, p in zip(indices, params, strict=True):
        where = where_of(cls_name, gi, pi, p)
        q = partners[pi] if partners is not None else None
        if q is not None:
            problem = partner_problem(p, q)
            if problem is not None:
                raise_problem(problem, f"{where}, paired with a partner: ")
            if p.grad is not None and q.grad is not None:
                raise ValueError(
                    f"{where} has a gradient of its own and its partner (dtype {q.dtype}) has one too: "
                    "ambiguous; set one of them to None (the master's own is used when the partner's is None)"
                )
        from_partner = q is not None and p.grad is None
        grad_from_partner.append(from_partner)
        problem = tensor_problem(p, "", low_precision=low_precision) or (
            tensor_problem(q.grad, ": its partner's grad", like=q)
            if from_partner
            else tensor_problem(p.grad, ": its grad", like=p)
        )
        if problem is not None:
            raise_problem(problem, where)
        refused = storage.problem(p.dtype)
        if refused is not None:
            raise TypeError(f"{where}: {refused}")
    if partners is None:
        return indices, params, None
    return indices, params, ([partners[pi] for pi in indices], grad_from_partner)
