"""The step plan: everything a step needs, built once and checked cheaply at every step.

A plan records, for each param group, the parameters that have a gradient, their state dicts
and state tensors, the real float32 local tensors the backends step (``view_as_real`` of complex
tensors, the local shard of a ``DTensor``), and *units*: parameters whose 0-d state (``step``,
...) and init flags are equal, so the spec's ``scalars`` runs once per unit, not per parameter.

Per step, ``StepPlan.check`` verifies only what can change between steps, with a few list
comprehensions and no per-tensor Python calls beyond attribute reads:

* the param groups, their ``params`` lists, ``optimizer.state`` and its dicts are the same
  objects (``add_param_group`` and ``load_state_dict`` replace them), the options the groups'
  hyperparameters select are the same;
* the same parameters have gradients, and the parameters' storage is where it was (a ``.data``
  swap moves it); each state tensor the step reads is the same object;
* every gradient is well formed (the contract: dense, contiguous, CPU, dtype and shape of its
  parameter).

Anything else makes ``check`` answer False, and the step rebuilds the plan (the slow path, which
validates everything, creates missing state and says exactly what is wrong). A failed check
never leaves anything modified.

Measured on ~2,000 small tensors (1 thread, AMD EPYC, Adam): a check costs about 0.8 us per
parameter (gradient attribute reads and checks 0.45, addresses 0.2, state identities 0.15).
"""

from __future__ import annotations

import itertools
import operator
import sys
from operator import is_, is_not

import numpy as np
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import masters
from .masters import partner_of, partner_problem
from .spec.core import Options, Scratch
from .tensors import Checked, contiguous_run

SUPPORTED_DTYPES = (torch.float32, torch.complex64)
# a unit's pairing (masters.py): (its gradients' dtype, its partners' dtype or None)
NO_PAIRING = (torch.float32, None)
_STRIDED = torch.strided
_PLAIN = (torch.Tensor, torch.nn.Parameter)

# DTensor is looked up only once torch.distributed.tensor has been imported (by the user, or
# FSDP2): importing it here would cost 0.7 s at ``import roundpipe.optim``, and no DTensor can
# exist before it is imported.
_DTENSOR_MODULE = "torch.distributed.tensor"


def _dtensor_types():
    mod = sys.modules.get(_DTENSOR_MODULE)
    if mod is None:
        return None
    return mod.DTensor, mod.Replicate, mod.Shard


def is_dtensor(t) -> bool:
    types = _dtensor_types()
    return types is not None and isinstance(t, types[0])


def local(t):
    """The tensor a backend steps: a DTensor's local shard, else the tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


def real(t):
    """The real float32 alias a backend steps: detached (torch's foreach copies run 3x slower
    on tensors that require grad), complex64 tensors as ``view_as_real``."""
    t = local(t).detach()
    return torch.view_as_real(t) if t.is_complex() else t


# ----------------------------------------------------------------------------------------------
# the contract: one check per kind of tensor, returning what is wrong (None: nothing)


def tensor_problem(t, what: str, like=None):
    """``(exception class, message)`` if ``t`` breaks the contract, else None.

    ``like``: the parameter whose dtype and shape ``t`` (a gradient or state tensor) must have.
    """
    if not isinstance(t, torch.Tensor):
        return KeyError, f"{what} is missing or not a tensor ({type(t).__name__})"
    if like is not None and is_dtensor(like):
        # a plain tensor next to a DTensor parameter (an unsharded gradient or checkpoint)
        # would be read shard by shard at the wrong elements: refuse, as torch.optim does
        if not is_dtensor(t):
            return TypeError, (
                f"{what} is a {type(t).__name__} but its parameter is a DTensor: expected a DTensor "
                f"with placements {like.placements} (torch.optim refuses mixed Tensor and DTensor too)"
            )
        if t.placements != like.placements or t.device_mesh != like.device_mesh:
            return ValueError, (
                f"{what} is a DTensor with placements {t.placements} on {t.device_mesh}; its parameter "
                f"has {like.placements} on {like.device_mesh}"
            )
    if is_dtensor(t):
        _, Replicate, Shard = _dtensor_types()
        bad = [p for p in t.placements if not isinstance(p, (Shard, Replicate))]
        if bad:
            return ValueError, f"{what} is a DTensor with placements {t.placements}; only Shard and Replicate"
        t, like = t._local_tensor, (local(like) if like is not None else None)
    elif type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):
        return TypeError, (
            f"{what} is a {type(t).__name__} (a tensor subclass); roundpipe steps plain tensors and "
            "DTensor shards"
        )
    if t.device.type != "cpu":
        return ValueError, f"{what} is on device {t.device}; only CPU tensors are supported"
    if t.layout != _STRIDED:
        return RuntimeError, f"{what} has layout {t.layout}; only dense tensors are supported (no sparse)"
    if like is None:
        if t.dtype not in SUPPORTED_DTYPES:
            return TypeError, (
                f"{what}: dtype {t.dtype} is not supported; use torch.float32 (or torch.complex64) "
                "master weights"
            )
    else:
        if t.dtype != like.dtype:
            # torch's ops raise RuntimeError on such a mismatch
            return RuntimeError, f"{what} has dtype {t.dtype}, expected {like.dtype}"
        if t.shape != like.shape:
            return RuntimeError, f"{what} has shape {tuple(t.shape)}, expected {tuple(like.shape)}"
    if not t.is_contiguous():
        return ValueError, f"{what} is not contiguous (strides {t.stride()}); call .contiguous()"
    return None


def scalar_state_problem(t, what: str):
    if not (isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()):
        return KeyError, f"{what} must be a 0-d floating tensor, got {t!r}"
    return None


def _raise(problem, where: str):
    cls, msg = problem
    raise cls(f"{where}{msg}")


def where_of(cls_name, gi, pi, p) -> str:
    return (
        f"roundpipe.optim.{cls_name}: param_groups[{gi}]['params'][{pi}] "
        f"(shape {tuple(p.shape)}, dtype {p.dtype})"
    )


def _grads_ok(grads, shapes, dtypes) -> bool:
    """The fast form of tensor_problem for plain gradients (True: all well formed; a None is
    not: its type is not a tensor's). ``shapes`` and ``dtypes``: tuples."""
    return (
        all([type(g) in _PLAIN and g.is_cpu and g.layout is _STRIDED and g.is_contiguous() for g in grads])
        and tuple(map(_SHAPE, grads)) == shapes
        and tuple(map(_DTYPE, grads)) == dtypes
    )


_SHAPE = operator.attrgetter("shape")
_GRAD_OF = operator.attrgetter("grad")
_STRIDE = torch.Tensor.stride
_NONES = itertools.repeat(None)
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr


# ----------------------------------------------------------------------------------------------
# the plan


class Unit:
    """Parameters of one group whose 0-d state and init flags are equal: one ``scalars`` call."""

    # No reference back to the GroupPlan: a plan holds no reference cycle, so a replaced plan
    # is freed at once (its views of the flat buffers would otherwise skew ``scalar_uses``).
    __slots__ = (
        "positions",
        "alone",
        "whole",
        "flags",
        "pairing",
        "scalar_columns",
        "scalar_heads",
        "scalar_flat",
        "scalar_uses",
        "columns",
    )

    def __init__(self, group_plan, positions, flags, pairing=NO_PAIRING):
        self.positions = positions  # indices into group_plan.params
        # (plain bools in the unit's own slots: a step reads these instead of the lists)
        self.alone = len(positions) < 2  # one member: uniform by definition
        self.whole = len(positions) == len(group_plan.params)  # every stepped one of its group
        self.flags = flags
        # (the gradients' dtype, the partners' dtype or None): one kind of pairing per unit
        self.pairing = pairing
        states = [group_plan.states[i] for i in positions]
        self.scalar_columns = {n: [st[n] for st in states] for n in group_plan.scalar_names}
        # each name's first member, whose value the step's scalars start from (all are equal)
        self.scalar_heads = tuple((n, c[0]) for n, c in self.scalar_columns.items())
        # 0-d state born in one buffer (adopt_flat_state) is checked and written in one op each
        # (one member's is written as itself: nothing to gain, and no storage to watch)
        self.scalar_flat = {
            n: contiguous_run(c) if _storage_use_count is not None and len(c) > 1 else None
            for n, c in self.scalar_columns.items()
        }
        # how many tensors share each flat buffer's storage, as the last write left it (None:
        # not written yet): a member moved to other storage (``.data =``, ``.set_()``) lowers
        # it, and the step rebuilds the plan instead of writing the buffer that no longer
        # holds that member (an O(1) check per buffer)
        self.scalar_uses = {n: None for n, f in self.scalar_flat.items() if f is not None}
        self.columns = {"param": [group_plan.reals[i] for i in positions]}
        for name in group_plan.inputs:
            self.columns[name] = [real(st[name]) for st in states]
        if pairing[1] is not None:
            self.columns["partner"] = [group_plan.partners[i] for i in positions]

    def uniform(self) -> bool:
        """Whether the members' 0-d state (``step``, ...) still holds one value per name, in
        the storage the plan writes."""
        if self.alone:  # (its 0-d state is written as itself: see scalar_flat)
            return True
        for n, uses in self.scalar_uses.items():
            if uses is not None and _uses(self.scalar_flat[n]) != uses:
                return False
        if len(self.positions) < 2:
            return True
        for n, col in self.scalar_columns.items():
            flat = self.scalar_flat[n]
            if flat is not None:
                if not bool((flat == flat[0]).all()):
                    return False
            elif not uniform_column(col):
                return False
        return True

    def write(self, scratch: dict):
        """Set every member's 0-d state to the step's new values (``scratch``)."""
        if self.alone:  # (fewer objects to read: see scalar_heads)
            for n, t in self.scalar_heads:
                new = scratch[n]
                if type(new) is Scratch:
                    t.fill_(new.value)
                else:
                    t.copy_(new)
            return
        for n, col in self.scalar_columns.items():
            flat = self.scalar_flat[n]
            new = scratch[n]
            if type(new) is Scratch:
                if flat is None:
                    for t in col:
                        t.fill_(new.value)
                    continue
                new = new.value
            if flat is not None:
                flat.fill_(new)
                self.scalar_uses[n] = _uses(flat)
            else:
                torch._foreach_copy_(col, [scratch[n]] * len(col))


# torch's count of the references to a storage (tensors and storage objects); without it (an
# older torch) the 0-d state is always read and written tensor by tensor
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _uses(t) -> int:
    return _storage_use_count(t.untyped_storage()._cdata)


class GroupPlan:
    # (what the per-step check and a steady step read first, together: fewer cache lines)
    __slots__ = (
        "group",
        "params_list",
        "n_params",
        "options",
        "n_stepped",
        "params",
        "partners",
        "plain",
        "shapes",
        "dtypes",
        "params_items",
        "tensor_names",
        "states",
        "state_tensors",
        "ptr_tensors",
        "ptrs",
        "simple",
        "gi",
        "indices",
        "inputs",
        "scalar_names",
        "reals",
        "tensors",
        "complex",
        "units",
        "sources",
        "partner_meta",
        "paired",
        "all_paired",
        "all_from_partners",
        "partner_spans",
        "grad_nbytes",
        "grad_shapes",
        "grad_dtypes",
    )

    def __init__(self, spec, gi, group, indices, params, states, init_flags, options, pairs=None):
        # What a step reads is kept in tuples (one allocation each, where a list has two: a step
        # of one small parameter finds every one of them out of cache)
        params, states = tuple(params), tuple(states)
        self.gi = gi
        self.group = group
        self.params_list = group["params"]
        self.n_params = len(self.params_list)
        # the group's parameters as they were (an element replaced in place is seen): the
        # stepped ones' tuple when that is all of them (one object less for a step to read)
        self.params_items = params if len(params) == self.n_params else tuple(self.params_list)
        self.options = options
        self.indices = indices
        self.n_stepped = len(indices)
        self.params = params
        self.states = states
        o = Options(options)
        self.inputs = [n for n in spec.inputs(o) if n not in ("param", "grad")]
        self.scalar_names = spec.scalar_state
        self.reals = [real(p) for p in params]
        self.shapes = tuple(p.shape for p in params)
        self.dtypes = tuple(p.dtype for p in params)
        self.plain = not any(is_dtensor(p) for p in params)
        self.complex = [i for i, p in enumerate(params) if p.is_complex()]
        self.simple = self.plain and not self.complex  # the gradients are the launch's column
        # every state tensor the step reads or writes, by name, for the identity check
        self.tensors = {n: [st[n] for st in states] for n in (*self.inputs, *self.scalar_names)}
        # the same, flat, for the per-step identity check (``st[n] for n in tensor_names for st
        # in states``: no per-entry objects, which a step of one parameter would find out of cache)
        self.tensor_names = _interned(tuple(self.tensors))
        self.state_tensors = tuple(t for col in self.tensors.values() for t in col)
        # where the parameters' and the input state tensors' storage is (``.data =`` or
        # ``.set_()`` moves it under the same object), in one list
        self.ptr_tensors = (*params, *(t for n in self.inputs for t in self.tensors[n]))
        self.ptrs = _ptrs(self.ptr_tensors, self.plain)
        # pairs: (partners, sources) from build, or None when no parameter of the group has a
        # partner (the step then never looks for one). sources[i]: the step reads the partner's
        # gradient (else the master's own)
        self.partners, self.sources = pairs if pairs is not None else (None, None)
        if self.partners is not None:
            # what the step writes through each partner: a ``.data =`` view of the same memory
            # (other shape, strides or dtype) is a change the per-step check must see
            self.paired = tuple(q for q in self.partners if q is not None)
            self.all_paired = len(self.paired) == len(self.partners)
            self.all_from_partners = all(self.sources)
            self.partner_meta = _partner_meta(self.paired)
            grad_like = [
                q if src else p for p, q, src in zip(params, self.partners, self.sources, strict=True)
            ]
            self.grad_shapes = tuple(t.shape for t in grad_like)
            self.grad_dtypes = tuple(t.dtype for t in grad_like)
            self.grad_nbytes = np.array([t.numel() * t.element_size() for t in grad_like], dtype=np.int64)
            # the partners' memory, sorted (they do not overlap: _check_partners), against which
            # each step's gradients are checked: the pass writes a partner before it has read
            # every gradient, the composition widens every gradient first
            spans = sorted(
                (q.data_ptr(), q.data_ptr() + q.numel() * q.element_size())
                for q in self.partners
                if q is not None and q.numel()
            )
            self.partner_spans = np.array(spans, dtype=np.int64).reshape(-1, 2)
        self.units = _units(self, init_flags)

    def grads(self):
        """This step's gradients, or None when a check fails (the caller rebuilds)."""
        params = self.params
        if self.partners is not None:
            return self._paired_grads()
        grads = [p.grad for p in params]
        if self.plain:
            if not _grads_ok(grads, self.shapes, self.dtypes):
                return None
        else:
            if not all([g is not None for g in grads]):  # not `None in grads`: that calls Tensor.__eq__
                return None
            for p, g in zip(params, grads, strict=True):
                if tensor_problem(g, "", like=p) is not None:
                    return None
        return grads

    def _paired_grads(self):
        # C-level maps, no per-parameter Python code (see the module docstring)
        own = list(map(_GRAD_OF, self.params))
        low = (
            list(map(_GRAD_OF, self.partners))
            if self.all_paired
            else [None if q is None else q.grad for q in self.partners]
        )
        sources = self.sources
        if list(map(is_, own, _NONES)) != sources or list(map(is_not, low, _NONES)) != sources:
            return None  # a gradient appeared or went: rebuilt (and validated)
        if self.all_from_partners:
            grads = low
        else:
            grads = [lo if src else g for g, lo, src in zip(own, low, sources, strict=True)]
        if not _grads_ok(grads, self.grad_shapes, self.grad_dtypes):
            return None
        if _partner_meta(self.paired) != self.partner_meta:
            return None
        if len(self.partner_spans):
            starts = np.fromiter(map(_DATA_PTR, grads), dtype=np.int64, count=len(grads))
            ends = starts + self.grad_nbytes
            spans = self.partner_spans
            # the last partner starting before each gradient ends: overlap if it ends after the
            # gradient starts (empty gradients: ends == starts, never an overlap)
            k = np.searchsorted(spans[:, 0], ends, side="left") - 1
            if ((k >= 0) & (spans[np.maximum(k, 0), 1] > starts) & (ends > starts)).any():
                return None  # rebuilt: _check_partners names the overlap
        return grads

    def current_grads(self):
        """The gradients the step reads (a partner's where ``sources`` says so), unchecked."""
        if self.partners is None:
            return [p.grad for p in self.params]
        return [
            q.grad if src else p.grad
            for p, q, src in zip(self.params, self.partners, self.sources, strict=True)
        ]

    def stepped(self) -> int:
        """How many parameters of the group have a gradient now (their own or a partner's)."""
        params = self.params_list
        if self.partners is None:
            return sum([p.grad is not None for p in params])
        n = 0
        for p in params:
            q = partner_of(p)
            n += p.grad is not None or (q is not None and q.grad is not None)
        return n

    def grad_columns(self, grads, unit):
        """The unit's real float32 local gradient tensors."""
        if self.simple:
            if unit.whole:
                return Checked(grads)
            return Checked([grads[i] for i in unit.positions])
        return Checked([real(grads[i]) for i in unit.positions])


_INTERNED: dict = {}


def _interned(t: tuple) -> tuple:
    """One shared tuple per value (a step reads shared objects from cache, its own from memory)."""
    return _INTERNED.setdefault(t, t)


def _ptrs(params, plain):
    if plain:
        return tuple(map(_DATA_PTR, params))
    return tuple(local(p).data_ptr() for p in params)


def _pairings(gp):
    if gp.partners is None:
        return [NO_PAIRING] * len(gp.params)
    return [
        (q.dtype if src else torch.float32, None if q is None else q.dtype)
        for q, src in zip(gp.partners, gp.sources, strict=True)
    ]


def _units(gp, init_flags):
    names = gp.scalar_names
    states = gp.states
    n = len(gp.params)
    pairings = _pairings(gp)
    if (
        n
        and all(f == init_flags[0] for f in init_flags)
        and all(k == pairings[0] for k in pairings)
        and _uniform(states, names)
    ):
        return [Unit(gp, list(range(n)), init_flags[0], pairings[0])]
    buckets: dict = {}
    for i, (st, flags) in enumerate(zip(states, init_flags, strict=True)):
        key = (tuple(sorted(flags.items())), tuple((st[m].item(), st[m].dtype) for m in names), pairings[i])
        buckets.setdefault(key, []).append(i)
    return [Unit(gp, pos, dict(key[0]), key[2]) for key, pos in buckets.items()]


def _uniform(states, names) -> bool:
    """True when every state holds the same values and dtypes in its 0-d entries ``names``."""
    for n in names:
        col = [st[n] for st in states]
        if not uniform_column(col):
            return False
    return True


def uniform_column(col) -> bool:
    if len(col) < 2:
        return True
    dtype = col[0].dtype
    if any(t.dtype != dtype for t in col):
        return False
    stacked = torch.stack(col)
    return bool((stacked == stacked[0]).all())


class StepPlan:
    """The plan of one optimizer (see the module docstring)."""

    __slots__ = (
        "param_groups",
        "n_groups",
        "state",
        "state_dicts",
        "pairings",
        "groups",
        "cache",
        "one_shot",
        "steady",
    )

    def __init__(self, opt, groups):
        self.param_groups = opt.param_groups
        self.n_groups = len(opt.param_groups)
        self.state = opt.state
        self.state_dicts = tuple(opt.state.values())
        self.pairings = masters.generation()  # pair()/unpair() since: rebuild
        self.groups = tuple(groups)
        self.cache: dict = {}  # launch key -> (static columns, backend cache)
        self.one_shot = False
        self.steady = None  # what the next step may repeat (optimizer._Steady)

    def check(self, opt, spec):
        """This step's gradients per group, or None if the plan no longer holds."""
        if self.one_shot:
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
            if _ptrs(gp.ptr_tensors, gp.plain) != gp.ptrs:
                return None
            out.append(grads)
        if len(out) != len(self.groups):  # a group with grads that the plan has not seen
            return None
        return out


def adopt_flat_state(params, states, names, below, scalar_names=()):
    """Put state tensors nobody has seen yet in one flat buffer per name, each parameter's entry
    a view of it (values copied): ``names`` of the small plain float32 parameters (under
    ``below`` elements), and the 0-d ``scalar_names`` (``step``, ...) of all of them. A backend
    that batches small parameters then steps the buffers in place instead of gathering and
    scattering the state every step (``fast``: 4 of Adam's 7 copies per small parameter), and a
    step sets every ``step`` with one op. Called only on state just created by a step, or by
    torch's ``__init__`` (Adagrad).

    The entries stay ordinary tensors of the parameter's shape: ``state_dict()``, ``torch.save``
    (which stores a shared buffer once) and ``load_state_dict`` both ways work as before. State
    loaded with ``load_state_dict`` is stepped where it is (gathered and scattered each step).
    Returns whether anything moved.
    """
    small = [
        i
        for i, p in enumerate(params)
        if 0 < p.numel() < below and type(p) in _PLAIN and p.dtype is torch.float32
    ]
    plan = [(n, small) for n in names] + [(n, range(len(params))) for n in scalar_names]
    moved = False
    for name, members in plan:
        tensors = [states[i][name] for i in members]
        if len(tensors) < 2 or any(type(t) not in _PLAIN for t in tensors) or _tiled(tensors):
            continue
        dtype = tensors[0].dtype
        if any(t.dtype != dtype for t in tensors):
            continue
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype)
        views = [
            v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)
        ]
        torch._foreach_copy_(views, tensors)
        for i, v in zip(members, views, strict=True):
            states[i][name] = v
        moved = True
    return moved


def _tiled(tensors) -> bool:
    return contiguous_run(tensors) is not None


def build(opt, spec, backend=None):
    """Validate everything, create missing state, return ``(plan, grads, created)``.

    ``created`` lists the state entries this call added, for ``rollback`` if the step fails
    later; on a failure here they are rolled back before the error propagates.
    """
    name = type(opt).__name__
    state = opt.state
    work, seen = [], set()
    for gi, group in enumerate(opt.param_groups):
        indices, params, pairs = _stepped(name, gi, group["params"])
        ids = list(map(id, params))
        if len(set(ids)) != len(ids) or not seen.isdisjoint(ids):
            _raise_duplicate(name, gi, indices, params, seen)
        seen.update(ids)
        work.append((gi, group, indices, params, pairs))
    _check_overlap(name, work)
    created = []  # (param, state dict, number of entries it had, whether it was added to state)
    try:
        groups = []
        for gi, group, indices, params, pairs in work:
            options = spec.options(group)
            o = Options(options)
            inputs = [n for n in spec.inputs(o) if n not in ("param", "grad")]
            states, init_flags = [], []
            born = []  # parameters whose state this call created from nothing
            for i, p in enumerate(params):
                st = state.get(p)
                fresh = st is None
                if fresh:
                    st = {}
                before = len(st)
                flags = spec.init_state(group, p, st) or {}
                if p.is_complex():  # torch rounds some ops differently on complex tensors
                    flags = {**flags, "complex": True}
                init_flags.append(flags)
                if len(st) != before:
                    if fresh:
                        state[p] = st  # torch creates state only where it stores something
                    created.append((p, st, before, fresh))
                    if before == 0:
                        born.append(i)
                states.append(st)
            below = getattr(backend, "flat_state_below", 0)
            if len(born) > 1:
                # state nobody has seen yet is born in flat buffers; existing state (loaded,
                # or the caller's) is always updated where it is
                born_states = [states[i] for i in born]
                adopt_flat_state([params[i] for i in born], born_states, inputs, below, spec.scalar_state)
            for p, pi, st in zip(params, indices, states, strict=True):
                where = where_of(name, gi, pi, p)
                for n in spec.scalar_state:
                    problem = scalar_state_problem(st.get(n), f": optimizer state {n!r}")
                    if problem is not None:
                        _raise(problem, where)
                for n in inputs:
                    problem = tensor_problem(st.get(n), f": optimizer state {n!r}", like=p)
                    if problem is not None:
                        _raise(problem, where)
            groups.append(GroupPlan(spec, gi, group, indices, params, states, init_flags, options, pairs))
        _check_partners(name, groups)
        plan = StepPlan(opt, groups)
        # init flags (SGD's ``first``) hold for the step that created the state only
        plan.one_shot = bool(created)
    except BaseException:
        rollback(state, created)
        raise
    return plan, [gp.current_grads() for gp in groups], created


def _stepped(cls_name, gi, group_params):
    """The group's parameters this step updates, validated: ``(indices, params, pairs)``;
    ``pairs`` is ``(partners, sources)`` (see GroupPlan) or None when no parameter has a
    partner (masters.py)."""
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
    sources = []
    for pi, p in zip(indices, params, strict=True):
        where = where_of(cls_name, gi, pi, p)
        q = partners[pi] if partners is not None else None
        if q is not None:
            problem = partner_problem(p, q)
            if problem is not None:
                _raise(problem, f"{where}, paired with a partner: ")
            if p.grad is not None and q.grad is not None:
                raise ValueError(
                    f"{where} has a gradient of its own and its partner (dtype {q.dtype}) has one too: "
                    "ambiguous; set one of them to None (the master's own is used when the partner's is None)"
                )
        from_partner = q is not None and p.grad is None
        sources.append(from_partner)
        problem = tensor_problem(p, "") or (
            tensor_problem(q.grad, ": its partner's grad", like=q)
            if from_partner
            else tensor_problem(p.grad, ": its grad", like=p)
        )
        if problem is not None:
            _raise(problem, where)
    if partners is None:
        return indices, params, None
    return indices, params, ([partners[pi] for pi in indices], sources)


def _partner_meta(paired):
    """What the step writes through each partner (``paired``: no None): addresses, shapes,
    strides and dtypes."""
    return (
        tuple(map(_DATA_PTR, paired)),
        tuple(map(_SHAPE, paired)),
        tuple(map(_STRIDE, paired)),
        tuple(map(_DTYPE, paired)),
    )


_PARTNER, _TENSOR, _GRAD = range(3)
_KINDS = {_PARTNER: "the partner of", _TENSOR: "a parameter or state tensor of", _GRAD: "the gradient of"}


def _check_partners(cls_name, groups):
    """Refuse a partner that overlaps in memory any parameter, state tensor, gradient the step
    reads or other partner (its writes would change what the step reads: the composition
    widens every gradient and steps every master before it writes any partner)."""
    spans = []
    for gp in groups:
        if gp.partners is None:
            continue
        for i, q in enumerate(gp.partners):
            if q is not None and q.numel():
                start = q.data_ptr()
                spans.append((start, start + q.numel() * q.element_size(), _PARTNER, gp, i))
    if not spans:
        return
    for gp in groups:
        grads = gp.current_grads()
        for i, p in enumerate(gp.params):
            t = local(p)
            read = [(t, _TENSOR), *((gp.tensors[n][i], _TENSOR) for n in gp.inputs), (grads[i], _GRAD)]
            for x, kind in read:
                x = local(x)
                if x.numel():
                    spans.append((x.data_ptr(), x.data_ptr() + x.numel() * x.element_size(), kind, gp, i))
    spans.sort(key=lambda s: (s[0], s[1]))
    end, prev = spans[0][1], spans[0]
    for span in spans[1:]:
        if span[0] < end and _PARTNER in (span[2], prev[2]):
            part = span if span[2] == _PARTNER else prev
            other = prev if part is span else span
            kind = _KINDS[other[2]]
            gp, i = part[3], part[4]
            where = where_of(cls_name, gp.gi, gp.indices[i], gp.params[i])
            ogp, oi = other[3], other[4]
            raise ValueError(
                f"{where}: its partner overlaps in memory with {kind} "
                f"param_groups[{ogp.gi}]['params'][{ogp.indices[oi]}]; a partner must have memory of its own"
            )
        if span[1] > end:
            end, prev = span[1], span


def rollback(state, created):
    """Remove the state entries a failed step created (``created`` from ``build``)."""
    for p, st, before, fresh in reversed(created):
        for key in list(st)[before:]:
            del st[key]
        if fresh and state.get(p) is st:
            del state[p]


def _raise_duplicate(cls_name, gi, indices, params, seen):
    local_ids = set()
    for pi, p in zip(indices, params, strict=True):
        if id(p) in seen or id(p) in local_ids:
            raise ValueError(
                f"{where_of(cls_name, gi, pi, p)} appears more than once in param_groups; "
                "torch.optim would step it twice (deprecated there), roundpipe refuses"
            )
        local_ids.add(id(p))


def _check_overlap(cls_name, work):
    """Refuse parameters that overlap in memory: torch's for-loop and foreach paths give
    different results for them (each updates in place what the other reads). A DTensor is
    checked by its local shard (its own ``data_ptr()`` is 0)."""
    spans = []
    for gi, _, indices, params, _pairs in work:
        for pi, p in zip(indices, params, strict=True):
            t = local(p)
            n = t.numel()
            if n:
                start = t.data_ptr()
                spans.append((start, start + n * t.element_size(), gi, pi, p))
    if len(spans) < 2:
        return
    spans.sort(key=lambda s: s[0])
    end, prev = spans[0][1], spans[0]
    for span in spans[1:]:
        if span[0] < end:
            raise ValueError(
                f"{where_of(cls_name, span[2], span[3], span[4])} overlaps in memory with "
                f"param_groups[{prev[2]}]['params'][{prev[3]}]; parameters must not share elements"
            )
        if span[1] > end:
            end, prev = span[1], span
