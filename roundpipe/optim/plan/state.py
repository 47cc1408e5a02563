"""The optimizer state a plan reads: created where missing (``create_state``), put in flat
buffers when nobody has seen it yet (``adopt_flat_state``), stored in the optimizer's state
dtype (``store_state``, ``storage.py``), and removed again when a step fails (``rollback``)."""

from __future__ import annotations

import itertools

import torch

from ..storage import DEFAULT
from ..tensors import LOW_PRECISION, PLAIN_TYPES, contiguous_run


def create_state(spec, group, params, state, created, storage=DEFAULT, deferred=None):
    """Each parameter's state dict (created by ``spec.init_state`` where missing) and init flags:
    ``(states, init_flags, new_positions)``, ``new_positions`` the parameters whose state this
    call created from nothing. Appends ``(param, state dict, entries it had, whether it was
    added to state)`` to ``created`` for each dict it changed.

    A parameter stepped widened (``storage``) gets its state as torch's float32 step creates it,
    stored in its state dtype; where that rounds an initial value (Rprop's ``step_size = lr``),
    the entry stays float32 for this step, as the float32 step reads it, and ``(state dict,
    name, tensor of the state dtype)`` goes to ``deferred``: rounded into it after the step."""
    states, init_flags, new_positions = [], [], []
    for i, p in enumerate(params):
        st = state.get(p)
        had_none = st is None
        if had_none:
            st = {}
        n_before = len(st)
        widened = storage.widened(p.dtype)
        flags = spec.init_state(group, _init_like(p) if widened else p, st) or {}
        if widened and len(st) != n_before:
            _narrow_new(spec, p, st, n_before, storage.state_dtype_of(p.dtype), deferred)
        if p.is_complex():  # torch rounds some ops differently on complex tensors
            flags = {**flags, "complex": True}
        elif p.dim() == 0 and p.dtype in LOW_PRECISION:
            # a 0-d tensor hyperparameter promotes a 0-d parameter's op to float32 where it
            # is rounded to a 1-d one's dtype (spec.low_precision_scalars): a unit of its own
            flags = {**flags, "zero_dim": True}
        init_flags.append(flags)
        if len(st) != n_before:
            if had_none:
                state[p] = st  # torch creates state only where it stores something
            created.append((p, st, n_before, had_none))
            if n_before == 0:
                new_positions.append(i)
        states.append(st)
    return states, init_flags, new_positions


def _init_like(p):
    """What ``init_state`` creates a widened parameter's state from: its float32 self (the shape
    and dtype only: no spec's ``init_state`` reads a parameter's values)."""
    return p if p.dtype is torch.float32 else torch.empty(p.shape)


def _narrow_new(spec, p, st, n_before, dtype, deferred):
    """The entries of ``st`` from ``n_before`` on (just created in float32) stored as ``dtype``."""
    for name in list(st)[n_before:]:
        t = st[name]
        if not _stored_entry(spec, p, name, t) or t.dtype is dtype:
            continue
        q = t.to(dtype)
        if deferred is None or torch.equal(q.to(t.dtype), t):
            st[name] = q
        else:
            deferred.append((st, name, q))


def _stored_entry(spec, p, name, t) -> bool:
    """Whether state entry ``name`` is one the state dtype applies to: a floating tensor of the
    parameter's shape (not the 0-d ``step`` and its kind)."""
    return (
        name not in spec.scalar_state
        and isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.shape == p.shape
    )


def store_state(opt, spec, loaded=None):
    """Every widened parameter's state in its state dtype (``storage.py``): after torch's
    ``__init__`` created some (Adagrad: created anew as the float32 step creates it, then
    rounded), or after ``load_state_dict(loaded)`` (the checkpoint's own values, which torch's
    load cast to the parameter's dtype first, rounded to the state dtype)."""
    storage = opt._roundpipe_storage
    params = list(itertools.chain.from_iterable(g["params"] for g in opt.param_groups))
    saved = None
    if loaded is not None:
        ids = itertools.chain.from_iterable(g["params"] for g in loaded["param_groups"])
        saved = {id(p): loaded["state"].get(k) for k, p in zip(ids, params, strict=True)}
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    for p in params:
        st = opt.state.get(p)
        if not st or not storage.widened(p.dtype) or storage.problem(p.dtype) is not None:
            continue
        dtype = storage.state_dtype_of(p.dtype)
        if saved is None:
            st.clear()
            spec.init_state(group_of[id(p)], _init_like(p), st)
            _narrow_new(spec, p, st, 0, dtype, None)
            continue
        original = saved.get(id(p)) or {}
        for name, t in list(st.items()):
            source = original.get(name)
            loadable = isinstance(source, torch.Tensor) and source.shape == t.shape
            if loadable and _stored_entry(spec, p, name, t):
                st[name] = source.detach().to(dtype=dtype, copy=True)


def adopt_flat_state(params, states, names, below, scalar_names=()):
    """Put state tensors nobody has seen yet in one flat buffer per name, each parameter's entry
    a view of it (values copied): ``names`` of the small plain float32 parameters (under
    ``below`` elements), and the 0-d ``scalar_names`` (``step``, ...) of all of them. A backend
    that batches small parameters then steps the buffers in place instead of gathering and
    scattering the state every step, and a step sets every ``step`` with one op. Called only on
    state just created by a step, or by torch's ``__init__`` (Adagrad).

    The entries stay ordinary tensors of the parameter's shape: ``state_dict()``, ``torch.save``
    (which stores a shared buffer once) and ``load_state_dict`` both ways work as before. State
    loaded with ``load_state_dict`` is stepped where it is (gathered and scattered each step).
    Returns whether anything moved.
    """
    small = [
        i
        for i, p in enumerate(params)
        if 0 < p.numel() < below and type(p) in PLAIN_TYPES and p.dtype is torch.float32
    ]
    members_by_name = [(n, small) for n in names] + [(n, range(len(params))) for n in scalar_names]
    moved = False
    for name, members in members_by_name:
        tensors = [states[i][name] for i in members]
        if len(tensors) < 2 or any(type(t) not in PLAIN_TYPES for t in tensors) or _tiled(tensors):
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


def adopt_init_state(opt, spec, below):
    """State that torch's ``__init__`` created (Adagrad's): nobody has seen it yet, so it goes
    into flat buffers as the state a step creates does (``adopt_flat_state``)."""
    for group in opt.param_groups:
        params = [p for p in group["params"] if p in opt.state]
        if not params:
            continue
        names = [n for n in opt.state[params[0]] if n not in spec.scalar_state]
        adopt_flat_state(params, [opt.state[p] for p in params], names, below, spec.scalar_state)


def _tiled(tensors) -> bool:
    return contiguous_run(tensors) is not None


def rollback(state, created):
    """Remove the state entries a failed step created (``created`` from ``build``)."""
    for p, st, n_before, had_none in reversed(created):
        for key in list(st)[n_before:]:
            del st[key]
        if had_none and state.get(p) is st:
            del state[p]
