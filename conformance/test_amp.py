"""Loss scaling and clipping with fp32 masters (``roundpipe.optim.amp``): one case per optimizer
on every backend and partner dtype, against the composition that defines them.

Test ids read ``<Optimizer>-<kwargs>-<backend>-<partner dtype>``. Three runs step the same
parameters through the same script of ``SCRIPT`` (one iteration a row):

* ``fused``: roundpipe on the backend under test, masters paired with their partners,
  ``roundpipe.optim.GradScaler`` and ``opt.clip_grad_norm_``: the unscale and the clip
  coefficient are folded into the step;
* ``composed``: roundpipe on the same backend without pairings, the composition written out:
  ``master.grad = partner.grad.float()``, torch's ``GradScaler.unscale_`` and
  ``torch.nn.utils.clip_grads_with_norm_`` writing the fp32 gradients, the step,
  ``partner.copy_``;
* ``torch``: the same composition with ``torch.optim``'s for-loop.

After every iteration the fused run's masters, partners, state and loss scale must equal the
composed run's bit for bit on every backend, and the torch run's on the backends that claim
torch's for-loop bit for bit. The script has a step whose gradients clip and one whose do not,
a partner gradient with an inf and an own gradient with a NaN (both steps skipped, the scale
backs off), steps unscaled by ``scaler.unscale_`` and steps left to ``scaler.step``.

The composed runs clip with the fused run's total norm: the numba engine's norm is its one
read-only pass's (float64 sums: within an ulp of the float64 norm, and within 1e-5 of torch's
``get_total_norm``, checked here), so the coefficients are equal and the steps are compared
bit for bit; on the composing engines the norm is torch's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import roundpipe.optim
from roundpipe.optim.masters import pair

from . import deviations
from .cases import BACKENDS, CASES_BY_OPTIMIZER
from .harness import PARAMS, assert_norm_close, exact_backend, exact_norm, gradients
from .test_masters import DTYPES, REAL, UNPAIRED, compare_masters, start_pairs

POISONED = next(i for i in REAL if PARAMS[i].desc.startswith("70001"))  # a partner's gradient
INIT_SCALE = 2.0**12

# One row an iteration: (explicit scaler.unscale_, max_norm or None for no clip, poison) where
# poison puts an inf into a partner's gradient or a NaN into an unpaired one.
SCRIPT = (
    (True, 1e6, None),  # clip called, coefficient 1: nothing clipped
    (True, 0.5, None),  # clipped
    (False, None, None),  # the unscale left to scaler.step: folded into the step
    (True, 0.5, "inf"),  # skipped; the scale backs off
    (False, 0.25, None),  # clipped before the unscale (the composition's order: clip, unscale)
    (False, None, "nan"),  # skipped
    (True, 0.1, None),
)


def _case(name):
    """The optimizer's first case with weight decay, else its first (a program with options)."""
    cases = CASES_BY_OPTIMIZER[name]
    return next((c for c in cases if c.kwargs.get("weight_decay")), cases[0])


def _grads(step, dtype, poison):
    """Per parameter (the master's own gradient, the partner's), scaled as backward leaves them."""
    out = []
    for i in REAL:
        g = gradients(step)[i]
        if g is None:
            out.append((None, None))
            continue
        g = g * INIT_SCALE
        if i == UNPAIRED:
            if poison == "nan":
                g.view(-1)[0] = float("nan")
            out.append((g, None))
        else:
            g = g.to(dtype)
            if poison == "inf" and i == POISONED:
                g.view(-1)[-1] = float("inf")
            out.append((None, g))
    return out


def _fused_iteration(run, grads, unscale, max_norm):
    opt, scaler, masters, partners = run
    scaler.scale(torch.ones(()))  # what the loss goes through (the scale is created lazily)
    for m, q, (own, low) in zip(masters, partners, grads, strict=True):
        m.grad = own
        if q is not None:
            q.grad = low
    if unscale:
        scaler.unscale_(opt)
    norm = opt.clip_grad_norm_(max_norm) if max_norm is not None else None
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return norm


def _composed_iteration(run, grads, unscale, max_norm, norm=None):
    """The composition; ``norm``: the total norm to clip with (the fused run's). Returns
    ``(torch's total norm, the float64 norm)`` of the gradients it clipped."""
    opt, scaler, masters, partners = run
    scaler.scale(torch.ones(()))
    for m, (own, low) in zip(masters, grads, strict=True):
        m.grad = own if own is not None else (low.float() if low is not None else None)
    if unscale or max_norm is not None:
        # the composition clips what it holds: unscaled first where the script says so
        if unscale:
            scaler.unscale_(opt)
        if max_norm is not None:
            clipped = [m for m in masters if m.grad is not None]
            torchs = torch.nn.utils.get_total_norm([m.grad for m in clipped])
            norms = (torchs.item(), exact_norm([m.grad for m in clipped]))
            torch.nn.utils.clip_grads_with_norm_(clipped, max_norm, torchs if norm is None else norm)
    if not unscale:
        scaler.unscale_(opt)  # what scaler.step does first with a for-loop optimizer
    scaler.step(opt)
    scaler.update()
    with torch.no_grad():
        for m, q in zip(masters, partners, strict=True):
            if q is not None:
                q.copy_(m)
    opt.zero_grad()
    return norms if max_norm is not None else None


def _snapshot(run):
    opt, scaler, masters, partners = run
    state = [{k: v.clone() for k, v in opt.state.get(m, {}).items() if torch.is_tensor(v)} for m in masters]
    return (
        [m.detach().clone() for m in masters],
        [q.detach().clone() if q is not None else None for q in partners],
        state,
        scaler.get_scale(),
    )


def _compare(where, ours, theirs):
    (*rest, scale), (*their_rest, their_scale) = ours, theirs
    assert scale == their_scale, f"{where}: loss scale {scale} vs {their_scale}"
    compare_masters(where, rest, their_rest)


def _params():
    for name in CASES_BY_OPTIMIZER:
        case = _case(name)
        for backend in BACKENDS:
            for dtype in DTYPES:
                yield pytest.param(case, backend, dtype, id=f"{case.id}-{backend}-{str(dtype).split('.')[1]}")


@pytest.mark.parametrize("case, backend, dtype", list(_params()))
def test_scaling_and_clipping(case, backend, dtype):
    cls = getattr(roundpipe.optim, case.optimizer)
    runs = {}
    for run in ("fused", "composed", "torch"):
        masters, partners = start_pairs(dtype)
        if run == "fused":
            for m, q in zip(masters, partners, strict=True):
                if q is not None:
                    pair(m, q)
            scaler = roundpipe.optim.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
        if run == "torch":
            opt = getattr(torch.optim, case.optimizer)(masters, **case.make_kwargs(), foreach=False)
        else:
            opt = cls(masters, **case.make_kwargs(), backend=backend)
        runs[run] = (opt, scaler, masters, partners)
    vs_torch = exact_backend(backend)[0] and deviations.lookup(case, backend) is None
    scale = INIT_SCALE
    for step, (unscale, max_norm, poison) in enumerate(SCRIPT):
        grads = _grads(step, dtype, poison)
        snap, norm = {}, None
        for run, parts in runs.items():
            # each run its own copies: unscale_ writes the unpaired gradients in place
            mine = [tuple(None if g is None else g.clone() for g in pair_) for pair_ in grads]
            if run == "fused":
                norm = _fused_iteration(parts, mine, unscale, max_norm)
            else:
                norms = _composed_iteration(parts, mine, unscale, max_norm, norm)
                if norm is not None:
                    assert_norm_close(norm.item(), *norms, backend, f"iteration {step}, {run}")
            snap[run] = _snapshot(parts)
        if poison is not None:
            assert snap["fused"][3] == scale * 0.5, f"iteration {step}: the scale did not back off"
        scale = snap["fused"][3]
        _compare(f"iteration {step}, fused vs composed", snap["fused"], snap["composed"])
        if vs_torch:
            _compare(f"iteration {step}, fused vs torch.optim composed", snap["fused"], snap["torch"])
