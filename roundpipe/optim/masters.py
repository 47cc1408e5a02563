"""fp32 master weights for a low-precision model: each master paired with its bf16/fp16 partner.

The people who offload keep fp32 masters and optimizer state in host memory and run forward and
backward in bfloat16 or float16. A *pairing* tells a roundpipe optimizer, for one fp32 master
parameter (what it steps), which low-precision model parameter goes with it (its *partner*):

* when the master has no ``.grad`` of its own, the step reads the partner's ``.grad`` (what
  autograd produced, bfloat16 or float16), widened to float32 inside the step;
* after updating the master, the step writes the partner with the new value, rounded as
  ``partner.copy_(master)`` rounds (nearest-even; infinities and NaN as torch does).

The meaning is the composition, and every backend and engine equals it bit for bit::

    master.grad = partner.grad.float()   # (when the master has no grad of its own)
    opt.step()                           # the normal step
    partner.copy_(master)

The numba engine does all three in its one pass over memory (the bytes it saves:
docs/step-plan.md); the other engines and the reference backend run the composition as written.

A master with a gradient of its own (e.g. unscaled or clipped by the caller) is stepped with it,
and its partner written all the same. A master whose partner has no gradient (and that has none
itself) is not stepped, and its partner not written, as torch leaves a parameter without a
gradient. A master with both is refused (ambiguous). ``zero_grad()`` clears the partners'
gradients too.

Pairings live on the master tensor (``pair``/``unpair``/``partner_of``), so param groups,
``add_param_group``, ``state_dict()`` (the masters' state, interchangeable with torch.optim's) and
schedulers work as ever; ``fp32_masters(model)`` pairs a whole model.

A partner has one live master: pairing it again (``fp32_masters(model)`` run a second time, a
notebook cell re-run) makes the new master its writer, and the old one *superseded*: it keeps
naming the partner, so that a step over it raises (``partner_problem``) instead of writing the
partner from a stale master or silently skipping it; ``pair`` or ``unpair`` it to end that.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .tensors import LOW_PRECISION, is_dtensor

PARTNER_DTYPES = LOW_PRECISION
_ATTR = "_roundpipe_partner"
_SUPERSEDED = "_roundpipe_superseded"  # a later pairing took this master's partner
# each partner's live master, weakly both ways (off the partner itself, which a user may pickle)
_master_of = WeakIdKeyDictionary()
# bumped by every pair()/unpair(): a step plan built before a change is rebuilt (an O(1) check)
_changes = [0]


def generation() -> int:
    return _changes[0]


def partner_of(master: torch.Tensor) -> torch.Tensor | None:
    """The low-precision partner paired with ``master``, or None."""
    return master.__dict__.get(_ATTR) if hasattr(master, "__dict__") else None


def partner_problem(master, partner):
    """``(exception class, message)`` if ``master`` cannot step with ``partner``, else None."""
    if master.__dict__.get(_SUPERSEDED):
        return RuntimeError, (
            "its partner was paired with another master since (roundpipe.optim.fp32_masters or pair "
            "called again on the same parameter), which now writes it: build the optimizer over the new "
            "masters, or call roundpipe.optim.pair(master, partner) to make this one its writer again"
        )
    return _pair_problem(master, partner)


def _pair_problem(master, partner):
    if is_dtensor(master) or is_dtensor(partner):
        return TypeError, (
            "a DTensor (FSDP2) cannot be paired: pair the local fp32 shard's optimizer with plain tensors, "
            "or step the DTensor master without a partner"
        )
    if not isinstance(partner, torch.Tensor):
        return TypeError, f"the partner must be a tensor, got {type(partner).__name__}"
    if master.dtype != torch.float32:
        return TypeError, f"a master with a partner must be float32, got {master.dtype}"
    if partner.dtype not in PARTNER_DTYPES:
        return (
            TypeError,
            f"the partner has dtype {partner.dtype}; a partner must be torch.bfloat16 or torch.float16",
        )
    if partner.shape != master.shape:
        return ValueError, f"the partner has shape {tuple(partner.shape)}, its master {tuple(master.shape)}"
    for what, t in (("master", master), ("partner", partner)):
        if t.device.type != "cpu":
            return ValueError, f"the {what} is on device {t.device}; pairs live on the CPU"
        if t.layout != torch.strided:
            return RuntimeError, f"the {what} has layout {t.layout}; only dense tensors are supported"
        if not t.is_contiguous():
            return ValueError, f"the {what} is not contiguous (strides {t.stride()})"
    if master.numel() and _overlap(master, partner):
        return ValueError, "the partner overlaps its master in memory"
    return None


def _overlap(a, b) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def pair(master: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
    """Pair the fp32 ``master`` with its low-precision ``partner`` (see the module docstring).
    Raises (and pairs nothing) when they cannot be paired; re-pairing replaces the partner. A
    partner already paired with another master is taken from it: that master is superseded (a
    step over it raises), so that two masters never both write one partner."""
    problem = _pair_problem(master, partner)
    if problem is not None:
        cls, msg = problem
        raise cls(f"roundpipe.optim.pair: {msg}")
    old = _live_master(partner)
    if old is not None and old is not master:
        old.__dict__[_SUPERSEDED] = True
    _forget(master)
    master.__dict__[_ATTR] = partner
    _master_of[partner] = weakref.ref(master)
    _changes[0] += 1
    return master


def unpair(master: torch.Tensor) -> torch.Tensor | None:
    """Remove ``master``'s pairing (if any, superseded or not); returns the partner it had, or None."""
    _changes[0] += 1
    if not hasattr(master, "__dict__"):
        return None
    return _forget(master)


def _live_master(partner):
    """The master that writes ``partner`` now, or None."""
    ref = _master_of.get(partner)
    master = ref() if ref is not None else None
    if master is None or master.__dict__.get(_ATTR) is not partner or master.__dict__.get(_SUPERSEDED):
        return None
    return master


def _forget(master):
    """Drop ``master``'s pairing; returns its partner (or None)."""
    partner = master.__dict__.pop(_ATTR, None)
    master.__dict__.pop(_SUPERSEDED, None)
    ref = _master_of.get(partner) if partner is not None else None
    if ref is not None and ref() is master:
        del _master_of[partner]
    return partner


def fp32_masters(params: torch.nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 masters for the parameters of a low-precision model, ready for an optimizer.

    ``params``: a module (its ``parameters()``) or an iterable of tensors. Each bfloat16 or
    float16 parameter that requires grad gets a new float32 ``torch.nn.Parameter`` master (its
    value widened exactly; ``requires_grad=False``: autograd writes the partner's gradient)
    paired with it; a float32 parameter is its own master (returned as it is, no partner).
    Parameters that do not require grad are left out, shared parameters are listed once, in
    the order ``parameters()`` gives::

        model = model.to(torch.bfloat16)
        opt = roundpipe.optim.AdamW(roundpipe.optim.fp32_masters(model), lr=1e-3)
        loss = model(x).float().pow(2).mean(); loss.backward()
        opt.step()        # steps the masters, writes the bf16 model parameters
        opt.zero_grad()   # clears the model's gradients too
    """
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    masters, seen = [], set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"roundpipe.optim.fp32_masters: expected tensors, got {type(p).__name__}")
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if p.dtype == torch.float32:
            masters.append(p)
            continue
        if p.dtype not in PARTNER_DTYPES:
            raise TypeError(
                f"roundpipe.optim.fp32_masters: a parameter of dtype {p.dtype} (shape {tuple(p.shape)}); "
                "expected bfloat16, float16 or float32"
            )
        master = torch.nn.Parameter(p.detach().float().contiguous(), requires_grad=False)
        masters.append(pair(master, p))
    return masters
