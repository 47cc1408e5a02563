"""Loss scaling and gradient clipping with fp32 masters: ``GradScaler`` and ``clip_grad_norm_``.

A step reads each master's gradient from its partner (``masters.py``), in bfloat16 or float16,
where torch's ``GradScaler`` and ``torch.nn.utils.clip_grad_norm_`` never look: they read
``p.grad`` of the optimizer's parameters. Their meaning here is the composition a user would
write with torch.optim: widen each partner's gradient into an fp32 master gradient, unscale it
(``GradScaler``), clip it (``clip_grad_norm_``), step, round the master back into the partner.

Both fold into the step instead of writing gradients: each records a factor (``1 / scale``, the
clip coefficient) that the next step multiplies the gradient by, in float32 and in the order
they ran, inside its own pass (the spec option ``grad_factors``), so the stepped result equals
the composition bit for bit. ``.grad`` keeps what backward wrote, except where torch's
contract says otherwise: ``scaler.unscale_(opt)`` unscales the fp32 gradients of unpaired
parameters in place, as torch does, so a user may clip those with torch afterwards.

* ``GradScaler``: ``torch.amp.GradScaler`` that also checks the partners' gradients for
  inf/NaN (the scale backs off, the step is skipped) and records their unscale. The optimizers
  declare ``_step_supports_amp_scaling`` (torch's contract for optimizers that unscale inside
  their step): torch's own ``GradScaler`` then works as well where no parameter is paired, and
  where one is, the step raises before anything moves instead of stepping scaled gradients.
* ``clip_grad_norm_(opt, max_norm, ...)`` (also ``opt.clip_grad_norm_``): the total norm of
  every gradient the next step reads (partners widened and unscaled); returns it as a tensor.

On the numba engine the inf check and the norm are one read-only pass over the gradients as
stored (``numba_engine.norms``: float64 sums; the check's sums of squares serve a 2-norm clip
that follows with the gradients unchanged). Its norm is the float64 norm rounded once, which is
torch's ``get_total_norm`` to torch's own float32 rounding, not bit for bit; the step then
applies the coefficient from that norm bit for bit. The composing engines (``reference``,
``fast:torch``, ``fast:numexpr``) take torch's foreach norms, bit for bit, and torch's inf check.
"""

from __future__ import annotations

import functools
import math
import numbers
import weakref
from itertools import compress, repeat
from operator import attrgetter, is_

import numpy as np
import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from . import backends, masters
from .tensors import LOW_PRECISION

# an optimizer's pending factors, by who reads the gradient: its own ``.grad`` or a partner's
_FACTORS = "_roundpipe_grad_factors"
_CHECKED = "_roundpipe_partners_checked"  # this iteration's inf check saw the partners' grads
_SUMS = "_roundpipe_grad_sums"  # the inf check's sums of squares, for a clip before the step
_PARTNERS = "_roundpipe_partners"  # each group's partners (``_partners``)
_GRAD = attrgetter("grad")
_VERSION = attrgetter("_version")


class GradFactors:
    """The per-step factors waiting for the next step, in the order they were recorded."""

    __slots__ = ("before_launch", "measured", "own", "partner")

    def __init__(self):
        self.own: list = []  # float32 values, as Python floats
        self.partner: list = []
        # a clip's coefficient holds for the gradients it measured: (weak references to those
        # tensors, their versions); weak, so a pending clip never keeps a set of gradients alive
        self.measured: tuple | None = None
        # what the step runs once it can no longer fail, before it writes (``_fused_unscale``)
        self.before_launch = None

    def add(self, value: float, own: bool = True, partner: bool = True) -> None:
        if own:
            self.own.append(value)
        if partner:
            self.partner.append(value)

    def copy(self) -> GradFactors:
        other = GradFactors()
        other.own, other.partner = list(self.own), list(self.partner)
        return other

    def for_pairing(self, paired: bool) -> tuple:
        return tuple(self.partner if paired else self.own)

    def __bool__(self):
        return bool(self.own or self.partner or self.before_launch)


_NONE = GradFactors()  # nothing pending (never added to: pending() makes an optimizer its own)


def pending(opt) -> GradFactors:
    factors = opt.__dict__.get(_FACTORS)
    if factors is None:
        factors = opt.__dict__[_FACTORS] = GradFactors()
    return factors


def clear(opt) -> None:
    opt.__dict__.pop(_FACTORS, None)
    opt.__dict__.pop(_CHECKED, None)
    opt.__dict__.pop(_SUMS, None)


def _gradients(opt) -> tuple[list, list]:
    """``(gradients, from a partner)``, in the parameters' order, for every parameter whose
    gradient the next step reads: its own ``.grad``, else its partner's (``masters.py``)."""
    grads, paired = [], []
    for group, partners in zip(opt.param_groups, _partners(opt), strict=True):
        own = list(map(_GRAD, group["params"]))
        if partners is None or not any(map(is_, own, repeat(None))):  # (C-level maps)
            present = [g for g in own if g is not None]
            grads += present
            paired += [False] * len(present)
        elif not any(map(is_, partners, repeat(None))) and all(map(is_, own, repeat(None))):
            low = [g for g in map(_GRAD, partners) if g is not None]  # every gradient a partner's
            grads += low
            paired += [True] * len(low)
        else:
            for g, q in zip(own, partners, strict=True):
                if g is not None:
                    grads.append(g)
                    paired.append(False)
                elif q is not None and q.grad is not None:
                    grads.append(q.grad)
                    paired.append(True)
    return grads, paired


def _partners(opt) -> list:
    """Per group, each parameter's partner (None for a group without any), cached on the
    optimizer until its groups or any pairing change."""
    cached = opt.__dict__.get(_PARTNERS)
    groups = opt.param_groups
    if cached is not None and cached[0] == masters.generation() and len(cached[1]) == len(groups):
        if all(_same(g["params"], params) for g, params in zip(groups, cached[1], strict=True)):
            return cached[2]
    partners = []
    for group in groups:
        found = list(map(masters.partner_of, group["params"]))
        partners.append(None if all(q is None for q in found) else found)
    opt.__dict__[_PARTNERS] = (masters.generation(), [list(g["params"]) for g in groups], partners)
    return partners


def _same(a, b) -> bool:
    return len(a) == len(b) and all(map(is_, a, b))


def _partner_grads(opt) -> list:
    grads, paired = _gradients(opt)
    return list(compress(grads, paired))


def begin_step(opt):
    """What loss scaling asks of this step (nothing recorded changes; ``clear`` after it ran):
    ``None`` to skip it (an inf or NaN gradient: it
    modifies nothing, as torch's GradScaler skips the step), else the pending factors (with
    this step's unscale added when the scaler left it to the step). Raises, before anything
    moves, under torch's own GradScaler when a partner's gradient would be stepped unseen."""
    recorded = opt.__dict__.get(_FACTORS)
    if recorded is not None and recorded.measured is not None:
        _check_measured(opt, recorded, "step()")
    found_inf = getattr(opt, "found_inf", None)
    scaling = found_inf is not None or "grad_scale" in opt.__dict__
    if not scaling:  # (no allocation: every step of every optimizer passes here)
        return recorded or _NONE
    if not opt.__dict__.get(_CHECKED) and _partner_grads(opt):
        raise RuntimeError(
            f"roundpipe.optim.{type(opt).__name__}: torch.amp.GradScaler reads only param.grad, and "
            "this optimizer steps fp32 masters whose gradients live on their low-precision partners "
            "(roundpipe.optim.pair / fp32_masters): it would step them scaled and miss their infs. "
            "Use roundpipe.optim.GradScaler, a drop-in subclass that sees them."
        )
    factors = pending(opt)
    grad_scale = getattr(opt, "grad_scale", None)
    fused = None
    if grad_scale is not None and any(g.get("fused") for g in opt.param_groups):
        fused = _fused_unscale(opt, factors, grad_scale)  # (its refusals hold on a skipped step too)
    if found_inf is not None and float(found_inf) != 0:
        return None
    if fused is not None:
        return fused
    if grad_scale is not None:  # the scaler left the unscale to this step: every gradient
        factors = factors.copy()
        factors.add(_inverse(grad_scale))
    return factors


def _fused_unscale(opt, factors, grad_scale) -> GradFactors:
    """torch's fused protocol, for a step the scaler left the unscale to: the kernel divides
    each gradient by the scale (a true division, where ``unscale_`` multiplies by the inverse)
    and writes the quotient back, then steps it. Returned as the step's ``before_launch``, run
    once the step can no longer fail; what it does not model raises here, before anything moves."""
    who = f"roundpipe.optim.{type(opt).__name__}(fused=True) under GradScaler without unscale_"
    if factors:
        raise RuntimeError(
            f"{who}: a clip is pending (clip_grad_norm_ before scaler.step); torch's clip would have "
            "scaled the scaled gradients before its kernel divides them. Call scaler.unscale_(optimizer) "
            "before clipping, as torch's AMP recipe does"
        )
    for gi, group in enumerate(opt.param_groups):
        if not group.get("fused") and any(p.grad is not None for p in group["params"]):
            raise RuntimeError(
                f"{who}: param_groups[{gi}] is not fused, and torch's for-loop step takes no grad_scale "
                "(it asserts); call scaler.unscale_(optimizer) before scaler.step(optimizer)"
            )
    grads, paired = _gradients(opt)
    wide = [g.dtype for g in grads if g.dtype is not torch.float32]
    if any(paired) or wide:
        raise RuntimeError(
            f"{who}: {'a partner' if any(paired) else wide[0]} gradient: the fused kernel steps the "
            "unrounded float32 quotient of a 16-bit gradient, which roundpipe does not model; call "
            "scaler.unscale_(optimizer) before scaler.step(optimizer), or use float32 parameters"
        )
    out = GradFactors()
    out.before_launch = functools.partial(_divide, grads, grad_scale)
    return out


@torch.no_grad()
def _divide(grads, scale) -> None:
    for g in grads:
        g.div_(scale.to(g.device))


def drop_scaler_attributes(opt) -> None:
    """Undo what a ``GradScaler.step`` (torch's or ours) set on ``opt``, for a step that raises:
    the scaler deletes them only after a step returns, and left behind, the next step (a plain
    one, or the next ``scaler.step``, which multiplies them in) would unscale by a stale scale."""
    opt.__dict__.pop("grad_scale", None)
    opt.__dict__.pop("found_inf", None)


def _inverse(scale) -> float:
    """GradScaler's ``inv_scale``: ``scale.double().reciprocal().float()``."""
    return float(scale.double().reciprocal().float())


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for roundpipe optimizers with fp32 masters: the same API and
    scale history, and the inf/NaN check and unscale cover the partners' gradients, which
    ``torch.amp.GradScaler`` cannot see. With any other optimizer it is torch's."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        grads = _partner_grads(optimizer) if _is_roundpipe(optimizer) else []
        if not grads:
            return per_device
        optimizer.__dict__[_CHECKED] = True
        found = per_device.get(found_inf.device, found_inf)
        sums = _sums(optimizer, grads, 2.0)
        if sums is not None:  # one read-only pass; its sums serve a clip before the step
            optimizer.__dict__[_SUMS] = (grads, list(map(_VERSION, grads)), sums)
            if not math.isfinite(float(sums.sum())):
                found.fill_(1.0)
        else:
            # a factor of 1: torch's own check, which writes back the same values; the
            # partners' gradients stay scaled in their low precision, as in the composition,
            # and are unscaled by the step
            one = torch.ones((), dtype=torch.float32, device=found.device)
            by_dtype: dict = {}
            for g in grads:
                by_dtype.setdefault(g.dtype, []).append(g)
            with torch.no_grad():
                for same in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(same, found, one)
        return {**per_device, found.device: found}

    def unscale_(self, optimizer):
        super().unscale_(optimizer)
        if self._enabled and optimizer.__dict__.get(_CHECKED):  # the check saw partners' grads
            # the unpaired fp32 gradients are unscaled in place now (torch's contract); the
            # partners' when the step (or clip_grad_norm_) widens them
            pending(optimizer).add(_inverse(self._scale), own=False)


def _is_roundpipe(optimizer) -> bool:
    """A roundpipe optimizer (it folds the factors into its step), without importing it."""
    return getattr(optimizer, "_roundpipe_folds_grad_factors", False)


@torch.no_grad()
def clip_grad_norm_(
    opt: torch.optim.Optimizer,
    max_norm: float | torch.Tensor,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over every gradient the next step of ``opt`` reads,
    partners' included, widened to float32 and unscaled as the composition has them. Returns
    the total norm (a tensor); the clip coefficient is applied by the next step, in its pass,
    instead of being written into the gradients now. On the numba engine the norm is one
    read-only pass's (``_total``: torch's to rounding); elsewhere torch's foreach norms, bit
    for bit. ``foreach`` is accepted for torch's signature.

    Takes the optimizer, not parameters as torch's does: the coefficient is not written into
    ``.grad`` but applied by that optimizer's next step to every gradient it reads, and
    parameters do not say which optimizer that is (a master may be in two; a partner knows
    none; a part of an optimizer's parameters cannot be clipped alone). Parameters raise
    ``TypeError`` naming the call to make."""
    _check_clip_arguments(opt, max_norm)
    norm_type = float(norm_type)
    max_norm = float(max_norm)
    grads, paired = _gradients(opt)
    factors = opt.__dict__.get(_FACTORS)
    if factors is not None and factors.measured is not None:
        _check_measured(opt, factors, "clip_grad_norm_()", grads)
    factors = pending(opt)
    if not grads:
        return torch.tensor(0.0)
    total = _total(opt, grads, paired, norm_type, factors)
    if total is None:
        total = _torch_total(grads, paired, norm_type, factors)
    if error_if_nonfinite and (total.isnan() or total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
            "anyway, set `error_if_nonfinite=False`"
        )
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if float(clip_coef) != 1.0:  # a factor of 1 changes no bits: no factor
        factors.add(float(clip_coef))
        factors.measured = (list(map(weakref.ref, grads)), list(map(_VERSION, grads)))
    return total


def _check_clip_arguments(opt, max_norm) -> None:
    """``TypeError`` naming the call to make, for what torch's habits put in ``clip_grad_norm_``'s
    place: parameters (model.parameters(), masters, one tensor) instead of the optimizer, a
    torch.optim optimizer (its step would never apply the coefficient), parameters as max_norm."""
    if not _is_roundpipe(opt):
        if isinstance(opt, torch.optim.Optimizer):
            got = f"a {type(opt).__module__}.{type(opt).__name__}, whose step would not apply the clip"
            instead = "torch.nn.utils.clip_grad_norm_(params, max_norm) for a torch.optim optimizer"
        else:
            what = "a tensor" if isinstance(opt, torch.Tensor) else type(opt).__name__
            got = f"{what} (parameters, as torch.nn.utils.clip_grad_norm_ takes)"
            instead = "opt.clip_grad_norm_(max_norm), or roundpipe.optim.clip_grad_norm_(opt, max_norm)"
        raise TypeError(
            f"roundpipe.optim.clip_grad_norm_ takes the roundpipe optimizer whose next step the clip "
            f"applies to, over every gradient that step reads (the masters' partners' too); got {got}. "
            f"Call {instead}."
        )
    if isinstance(max_norm, torch.nn.Parameter) or not (
        isinstance(max_norm, numbers.Real) or (isinstance(max_norm, torch.Tensor) and max_norm.dim() == 0)
    ):
        raise TypeError(
            f"roundpipe.optim.{type(opt).__name__}.clip_grad_norm_: max_norm must be a number, got "
            f"{type(max_norm).__name__}. The optimizer clips every gradient its step reads: call "
            "opt.clip_grad_norm_(max_norm), without parameters."
        )


def _check_measured(opt, factors, call, grads=None) -> None:
    """Raises, recording nothing, where the gradients a pending clip coefficient was computed
    from are not the ones the next step reads: torch's clip would have scaled those, not these."""
    refs, versions = factors.measured
    if grads is None:
        grads = _gradients(opt)[0]
    if _same([r() for r in refs], grads) and list(map(_VERSION, grads)) == versions:
        return
    raise RuntimeError(
        f"roundpipe.optim.{type(opt).__name__}.{call}: the gradients changed since clip_grad_norm_ "
        "measured them (another backward, a gradient written or replaced, model.zero_grad() after a clip "
        "that came after step()), so the coefficient pending for the next step was computed from other "
        "gradients. Call opt.clip_grad_norm_ after the last backward, right before the step; "
        "opt.zero_grad() drops a pending clip."
    )


def _sums(opt, grads, order):
    """The backend's one-pass sums of ``grads`` for a norm of ``order`` (None: it has none)."""
    return backends.get(opt._roundpipe_backend).gradient_sums(grads, order)


def _total(opt, grads, paired, norm_type, factors):
    """The total norm from the backend's one-pass sums, in float64, rounded to float32 once;
    each side's pending factors (own gradients, partners') multiply its sum. None where the
    backend has no such pass (or for other orders than 1, 2, inf)."""
    if norm_type not in _ORDERS:
        return None
    if any(g.dtype in LOW_PRECISION and not p for g, p in zip(grads, paired, strict=True)):
        return None  # a bfloat16/float16 parameter's own gradients: torch's norms, in their dtype
    parts = []
    for side in (False, True):
        these = [g for g, p in zip(grads, paired, strict=True) if p is side]
        if not these:
            continue
        sums = _cached_sums(opt, these, norm_type)
        if sums is None:
            sums = _sums(opt, these, norm_type)
        if sums is None:
            return None
        scale = math.prod(abs(f) for f in factors.for_pairing(side))
        if norm_type == 2.0:
            parts.append(float(np.sum(sums)) * scale * scale)
        elif norm_type == 1.0:
            parts.append(float(np.sum(sums)) * scale)
        else:
            parts.append(float(np.max(sums)) * scale)
    if norm_type == math.inf:
        total = max(parts) if not any(math.isnan(x) for x in parts) else math.nan
    else:
        total = math.fsum(parts) if all(math.isfinite(x) for x in parts) else sum(parts)
    if norm_type == 2.0:
        total = math.sqrt(total) if total == total else total
    return torch.tensor(total, dtype=torch.float32)


def _cached_sums(opt, grads, norm_type):
    """The inf check's sums of squares of these very gradients, if nothing wrote them since."""
    cached = opt.__dict__.get(_SUMS)
    if norm_type != 2.0 or cached is None:
        return None
    seen, versions, sums = cached
    if len(seen) != len(grads) or not all(map(is_, seen, grads)):
        return None
    return sums if list(map(_VERSION, grads)) == versions else None


def _torch_total(grads, paired, norm_type, factors):
    """The total norm as torch's ``get_total_norm`` computes it from the gradients the step
    reads (a partner's widened): per tensor ``torch._foreach_norm`` (``_norms``), in the norm's
    dtype (a bfloat16 or float16 parameter's own gradient: its own), the norms in torch's order
    (the parameters', or where their dtypes differ torch's groups by device and dtype), then
    the norm of the norms."""
    norms = [None] * len(grads)
    for side in (False, True):
        at = [i for i, p in enumerate(paired) if p is side]
        if at:
            found = _norms([grads[i] for i in at], norm_type, factors.for_pairing(side), widen=side)
            for i, n in zip(at, found, strict=True):
                norms[i] = n
    if len({n.dtype for n in norms}) > 1:  # torch's order: its groups by device and dtype
        stand_ins = [torch.empty(0, device=g.device) if p else g for g, p in zip(grads, paired, strict=True)]
        groups = _group_tensors_by_device_and_dtype([stand_ins], with_indices=True)
        norms = [norms[i] for _, indices in groups.values() for i in indices]
    return torch.linalg.vector_norm(torch.stack([_local(n) for n in norms]), norm_type)


_ORDERS = (1.0, 2.0, math.inf)  # the norms the one-pass sums give


# norms that commute with a power-of-two factor: torch accumulates in double, where scaling every
# element by 2**k scales every partial sum and the root exactly
_SCALABLE = (1.0, 2.0, float("inf"))


def _norms(grads, norm_type, factors=(), widen=True):
    """Each gradient's norm as ``torch.linalg.vector_norm`` of the gradient the step reads
    (``widen``: a partner's, in float32; else in its own dtype; times ``factors``) computes it,
    bit for bit. Where that allows, a read of the gradients as they are (torch widens on load)
    and the factors applied to the norms; otherwise the scaled gradient is made one tensor at a
    time (a low-precision one rounded to its dtype by each factor, as torch's in-place ``mul_``)."""
    if not widen and any(g.dtype in LOW_PRECISION for g in grads):
        if factors:
            return [torch.linalg.vector_norm(_as_stepped(g, factors, widen), norm_type) for g in grads]
        return list(torch._foreach_norm(grads, norm_type))
    if norm_type in _SCALABLE and all(math.frexp(f)[0] == 0.5 for f in factors):
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
        for f in factors:
            norms = torch._foreach_mul(norms, torch.tensor(f, dtype=torch.float32))
        return list(norms)
    return [torch.linalg.vector_norm(_as_stepped(g, factors), norm_type) for g in grads]


def _as_stepped(g, factors, widen=True):
    """The gradient the step would read: widened (a partner's), times the pending factors."""
    if widen and g.dtype is not torch.float32:
        g = g.float()
    for f in factors:
        g = g * torch.tensor(f, dtype=torch.float32)
    return g


def _local(norm):
    """A DTensor's norm (FSDP2) reduced over its mesh: every rank gets the same total."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
