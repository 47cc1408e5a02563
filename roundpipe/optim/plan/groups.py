"""A param group's plan (``GroupPlan``): its stepped parameters, their state, the tensors a
backend steps, its units, and the per-step check of its gradients (``grads``)."""

from __future__ import annotations

import itertools
import operator
from operator import is_, is_not

import numpy as np
import torch

from ..masters import partner_of
from ..spec.core import Options
from ..tensors import Checked, is_dtensor, local, real
from .checks import grads_ok, tensor_problem
from .units import bucket_units

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_GRAD_OF = operator.attrgetter("grad")
_STRIDE = torch.Tensor.stride
_DATA_PTR = torch.Tensor.data_ptr
_NONES = itertools.repeat(None)


class GroupPlan:
    # (what the per-step check and a replayed step read first, together: fewer cache lines)
    __slots__ = (
        "group",
        "params_list",
        "n_params",
        "options",
        "n_stepped",
        "params",
        "partners",
        "no_dtensors",
        "shapes",
        "dtypes",
        "params_items",
        "tensor_names",
        "states",
        "state_tensors",
        "ptr_tensors",
        "ptrs",
        "grads_are_column",
        "gi",
        "indices",
        "inputs",
        "scalar_names",
        "reals",
        "state_columns",
        "complex_positions",
        "units",
        "grad_from_partner",
        "partner_meta",
        "present_partners",
        "every_param_paired",
        "all_grads_from_partners",
        "partner_spans",
        "grad_nbytes",
        "grad_shapes",
        "grad_dtypes",
        "storage",
        "pids",
    )

    def __init__(
        self,
        spec,
        gi,
        group,
        indices,
        params,
        states,
        init_flags,
        options,
        pairs=None,
        storage=None,
        pids=None,
    ):
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
        self.no_dtensors = not any(is_dtensor(p) for p in params)
        self.complex_positions = [i for i, p in enumerate(params) if p.is_complex()]
        # the gradients themselves are the launch's gradient column (no view to take)
        self.grads_are_column = self.no_dtensors and not self.complex_positions
        # every state tensor the step reads or writes, by name, for the identity check
        self.state_columns = {n: [st[n] for st in states] for n in (*self.inputs, *self.scalar_names)}
        # the same, flat, for the per-step identity check (``st[n] for n in tensor_names for st
        # in states``: no per-entry objects, which a step of one parameter would find out of cache)
        self.tensor_names = _interned(tuple(self.state_columns))
        self.state_tensors = tuple(t for col in self.state_columns.values() for t in col)
        # where the parameters' and the input state tensors' storage is (``.data =`` or
        # ``.set_()`` moves it under the same object), in one list
        self.ptr_tensors = (*params, *(t for n in self.inputs for t in self.state_columns[n]))
        self.ptrs = ptrs(self.ptr_tensors, self.no_dtensors)
        # pairs: (partners, grad_from_partner) from build, or None when no parameter of the
        # group has a partner (the step then never looks for one). grad_from_partner[i]: the
        # step reads the partner's gradient (else the master's own)
        self.partners, self.grad_from_partner = pairs if pairs is not None else (None, None)
        if self.partners is not None:
            self._plan_partners(params)
        self.storage = storage  # the optimizer's (storage.py), or None: the default
        # each stepped parameter's position in the optimizer (state_dict's numbering)
        self.pids = tuple(indices) if pids is None else pids
        self.units = bucket_units(self, init_flags)

    def _plan_partners(self, params):
        # what the step writes through each partner: a ``.data =`` view of the same memory
        # (other shape, strides or dtype) is a change the per-step check must see
        self.present_partners = tuple(q for q in self.partners if q is not None)
        self.every_param_paired = len(self.present_partners) == len(self.partners)
        self.all_grads_from_partners = all(self.grad_from_partner)
        self.partner_meta = _partner_meta(self.present_partners)
        grad_like = [
            q if src else p for p, q, src in zip(params, self.partners, self.grad_from_partner, strict=True)
        ]
        self.grad_shapes = tuple(t.shape for t in grad_like)
        self.grad_dtypes = tuple(t.dtype for t in grad_like)
        self.grad_nbytes = np.array([t.numel() * t.element_size() for t in grad_like], dtype=np.int64)
        # the partners' memory, sorted (they do not overlap: check_partners), against which
        # each step's gradients are checked: the pass writes a partner before it has read
        # every gradient, the composition widens every gradient first
        spans = sorted(
            (q.data_ptr(), q.data_ptr() + q.numel() * q.element_size())
            for q in self.partners
            if q is not None and q.numel()
        )
        self.partner_spans = np.array(spans, dtype=np.int64).reshape(-1, 2)

    def grads(self):
        """This step's gradients, or None when a check fails (the caller rebuilds)."""
        params = self.params
        if self.partners is not None:
            return self._paired_grads()
        grads = [p.grad for p in params]
        if self.no_dtensors:
            if not grads_ok(grads, self.shapes, self.dtypes):
                return None
        else:
            if not all([g is not None for g in grads]):  # not `None in grads`: that calls Tensor.__eq__
                return None
            for p, g in zip(params, grads, strict=True):
                if tensor_problem(g, "", like=p) is not None:
                    return None
        return grads

    def _paired_grads(self):
        # C-level maps, no per-parameter Python code (the per-step check's cost: docs/step-plan.md)
        own = list(map(_GRAD_OF, self.params))
        low = (
            list(map(_GRAD_OF, self.partners))
            if self.every_param_paired
            else [None if q is None else q.grad for q in self.partners]
        )
        from_partner = self.grad_from_partner
        if list(map(is_, own, _NONES)) != from_partner or list(map(is_not, low, _NONES)) != from_partner:
            return None  # a gradient appeared or went: rebuilt (and validated)
        if self.all_grads_from_partners:
            grads = low
        else:
            grads = [lo if src else g for g, lo, src in zip(own, low, from_partner, strict=True)]
        if not grads_ok(grads, self.grad_shapes, self.grad_dtypes):
            return None
        if _partner_meta(self.present_partners) != self.partner_meta:
            return None
        if len(self.partner_spans) and self._grads_overlap_partners(grads):
            return None  # rebuilt: check_partners names the overlap
        return grads

    def _grads_overlap_partners(self, grads) -> bool:
        starts = np.fromiter(map(_DATA_PTR, grads), dtype=np.int64, count=len(grads))
        ends = starts + self.grad_nbytes
        spans = self.partner_spans
        # the last partner starting before each gradient ends: overlap if it ends after the
        # gradient starts (empty gradients: ends == starts, never an overlap)
        k = np.searchsorted(spans[:, 0], ends, side="left") - 1
        return bool(((k >= 0) & (spans[np.maximum(k, 0), 1] > starts) & (ends > starts)).any())

    def current_grads(self):
        """The gradients the step reads (a partner's where ``grad_from_partner`` says so),
        unchecked."""
        if self.partners is None:
            return [p.grad for p in self.params]
        return [
            q.grad if src else p.grad
            for p, q, src in zip(self.params, self.partners, self.grad_from_partner, strict=True)
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
        if self.grads_are_column:
            if unit.covers_group:
                return Checked(grads)
            return Checked([grads[i] for i in unit.positions])
        return Checked([real(grads[i]) for i in unit.positions])


_INTERNED: dict = {}


def _interned(t: tuple) -> tuple:
    """One shared tuple per value (a step reads shared objects from cache, its own from memory)."""
    return _INTERNED.setdefault(t, t)


def ptrs(tensors, no_dtensors):
    """The addresses of ``tensors`` (a DTensor's: its local shard's)."""
    if no_dtensors:
        return tuple(map(_DATA_PTR, tensors))
    return tuple(local(p).data_ptr() for p in tensors)


def _partner_meta(present_partners):
    """What the step writes through each partner: addresses, shapes, strides and dtypes."""
    return (
        tuple(map(_DATA_PTR, present_partners)),
        tuple(map(_SHAPE, present_partners)),
        tuple(map(_STRIDE, present_partners)),
        tuple(map(_DTYPE, present_partners)),
    )
