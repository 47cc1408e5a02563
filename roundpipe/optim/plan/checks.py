"""The contract, checked: one function per kind of tensor, returning what is wrong (None:
nothing), and the checks across tensors (duplicates, overlapping parameters, partners that
overlap what the step reads). Nothing here modifies anything."""

from __future__ import annotations

import operator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..tensors import LOW_PRECISION, PLAIN_TYPES, dtensor_types, is_dtensor, local

SUPPORTED_DTYPES = (torch.float32, torch.complex64)
# parameters the elementwise optimizers also step as they are, rounding each op to their dtype
# as torch does (docs/low-precision.md); the staged ones refuse them (``tensor_problem``)
LOW_PRECISION_DTYPES = LOW_PRECISION
_STRIDED = torch.strided
_PLAIN = PLAIN_TYPES
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def tensor_problem(t, what: str, like=None, low_precision=False, dtype=None):
    """``(exception class, message)`` if ``t`` breaks the contract, else None.

    ``like``: the parameter whose dtype and shape ``t`` (a gradient or state tensor) must have
    (``dtype``: another dtype, a state tensor's state dtype). ``low_precision``: a parameter
    (``like`` None) may also be bfloat16 or float16.
    """
    if not isinstance(t, torch.Tensor):
        return KeyError, f"{what} is missing or not a tensor ({type(t).__name__})"
    if like is not None and is_dtensor(like):
        problem = _dtensor_mismatch(t, what, like)
        if problem is not None:
            return problem
    if is_dtensor(t):
        _, Replicate, Shard = dtensor_types()
        bad = [p for p in t.placements if not isinstance(p, (Shard, Replicate))]
        if bad:
            return ValueError, f"{what} is a DTensor with placements {t.placements}; only Shard and Replicate"
        t, like = t._local_tensor, (local(like) if like is not None else None)
    elif type(t) not in PLAIN_TYPES and is_traceable_wrapper_subclass(t):
        return TypeError, (
            f"{what} is a {type(t).__name__} (a tensor subclass); roundpipe steps plain tensors and "
            "DTensor shards"
        )
    if t.device.type != "cpu":
        return ValueError, f"{what} is on device {t.device}; only CPU tensors are supported"
    if t.layout != _STRIDED:
        return RuntimeError, f"{what} has layout {t.layout}; only dense tensors are supported (no sparse)"
    if like is None:
        problem = _dtype_problem(t, what, low_precision)
    else:
        problem = _unlike_problem(t, what, like, dtype)
    if problem is not None:
        return problem
    if not t.is_contiguous():
        return ValueError, f"{what} is not contiguous (strides {t.stride()}); call .contiguous()"
    return None


def _dtensor_mismatch(t, what, like):
    # a plain tensor next to a DTensor parameter (an unsharded gradient or checkpoint) would be
    # read shard by shard at the wrong elements: refuse, as torch.optim does
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
    return None


def _dtype_problem(t, what, low_precision=False):
    if t.dtype in SUPPORTED_DTYPES or (low_precision and t.dtype in LOW_PRECISION_DTYPES):
        return None
    if t.dtype in LOW_PRECISION_DTYPES:
        return TypeError, (
            f"{what}: dtype {t.dtype} is not supported by this optimizer (roundpipe.optim steps "
            "bfloat16 and float16 parameters with its elementwise optimizers only); give it float32 "
            "masters of them: roundpipe.optim.fp32_masters(model)"
        )
    supported = "torch.float32, torch.bfloat16, torch.float16" if low_precision else "torch.float32"
    return TypeError, (
        f"{what}: dtype {t.dtype} is not supported; the parameters must be {supported} (or torch.complex64)"
    )


def _unlike_problem(t, what, like, dtype=None):
    expected = like.dtype if dtype is None else dtype
    if t.dtype != expected:
        # torch's ops raise RuntimeError on such a mismatch
        return RuntimeError, f"{what} has dtype {t.dtype}, expected {expected}"
    if t.shape != like.shape:
        return RuntimeError, f"{what} has shape {tuple(t.shape)}, expected {tuple(like.shape)}"
    return None


def scalar_state_problem(t, what: str):
    if not (isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()):
        return KeyError, f"{what} must be a 0-d floating tensor, got {t!r}"
    return None


def raise_problem(problem, where: str):
    cls, msg = problem
    raise cls(f"{where}{msg}")


def where_of(cls_name, gi, pi, p) -> str:
    return (
        f"roundpipe.optim.{cls_name}: param_groups[{gi}]['params'][{pi}] "
        f"(shape {tuple(p.shape)}, dtype {p.dtype})"
    )


def grads_ok(grads, shapes, dtypes) -> bool:
    """The fast form of tensor_problem for plain gradients (True: all well formed; a None is
    not: its type is not a tensor's). ``shapes`` and ``dtypes``: tuples."""
    return (
        all([type(g) in _PLAIN and g.is_cpu and g.layout is _STRIDED and g.is_contiguous() for g in grads])
        and tuple(map(_SHAPE, grads)) == shapes
        and tuple(map(_DTYPE, grads)) == dtypes
    )


def check_state(cls_name, gi, indices, params, states, scalar_names, inputs, storage=None, deferred=()):
    """Raise on the first state entry a step would read that breaks the contract: of its
    parameter's shape, and dtype or state dtype (``storage``); float32 where ``deferred``
    (``state.create_state``) says it is rounded to it after this step."""
    later = {id(st[n]) for st, n, _ in deferred}
    for p, pi, st in zip(params, indices, states, strict=True):
        where = where_of(cls_name, gi, pi, p)
        for n in scalar_names:
            problem = scalar_state_problem(st.get(n), f": optimizer state {n!r}")
            if problem is not None:
                raise_problem(problem, where)
        dtype = None if storage is None else storage.state_dtype_of(p.dtype)
        for n in inputs:
            t = st.get(n)
            expected = torch.float32 if id(t) in later else dtype
            problem = tensor_problem(t, f": optimizer state {n!r}", like=p, dtype=expected)
            if problem is not None:
                raise_problem(problem, where)


def check_duplicates(cls_name, gi, indices, params, seen):
    """Refuse a parameter listed twice (in this group, or in one before it: ``seen``, ids)."""
    ids = list(map(id, params))
    if len(set(ids)) == len(ids) and seen.isdisjoint(ids):
        return
    ids_here = set()
    for pi, p in zip(indices, params, strict=True):
        if id(p) in seen or id(p) in ids_here:
            raise ValueError(
                f"{where_of(cls_name, gi, pi, p)} appears more than once in param_groups; "
                "torch.optim would step it twice (deprecated there), roundpipe refuses"
            )
        ids_here.add(id(p))


def check_overlap(cls_name, work):
    """Refuse parameters that overlap in memory: torch's for-loop and foreach paths give
    different results for them (each updates in place what the other reads). A DTensor is
    checked by its local shard (its own ``data_ptr()`` is 0). ``work``: ``(gi, group,
    indices, params, pairs)`` per group."""
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


_PARTNER, _TENSOR, _GRAD = range(3)
_KINDS = {_PARTNER: "the partner of", _TENSOR: "a parameter or state tensor of", _GRAD: "the gradient of"}


def check_partners(cls_name, groups):
    """Refuse a partner that overlaps in memory any parameter, state tensor, gradient the step
    reads or other partner (its writes would change what the step reads: the composition
    widens every gradient and steps every master before it writes any partner).
    ``groups``: GroupPlans."""
    spans = _partner_spans(groups)
    if not spans:
        return
    spans += _read_spans(groups)
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


def _partner_spans(groups):
    spans = []
    for gp in groups:
        if gp.partners is None:
            continue
        for i, q in enumerate(gp.partners):
            if q is not None and q.numel():
                start = q.data_ptr()
                spans.append((start, start + q.numel() * q.element_size(), _PARTNER, gp, i))
    return spans


def _read_spans(groups):
    """The memory of every parameter, input state tensor and gradient the step reads."""
    spans = []
    for gp in groups:
        grads = gp.current_grads()
        for i, p in enumerate(gp.params):
            t = local(p)
            read = [(t, _TENSOR), *((gp.state_columns[n][i], _TENSOR) for n in gp.inputs), (grads[i], _GRAD)]
            for x, kind in read:
                x = local(x)
                if x.numel():
                    spans.append((x.data_ptr(), x.data_ptr() + x.numel() * x.element_size(), kind, gp, i))
    return spans
