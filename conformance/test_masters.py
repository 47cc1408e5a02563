"""fp32 masters with bf16/fp16 partners (``roundpipe.optim.masters``): every case of ``cases.py``
on every backend, against the composition that defines them.

Test ids read ``<Optimizer>-<kwargs>-<backend>-<partner dtype>``. Three runs step the same
parameters ``STEPS`` times:

* ``paired``: roundpipe on the backend under test, each master paired with its partner (the
  partner's initial value is the conformance parameter rounded to the partner dtype, the
  master its exact widening), the gradients set on the partners, rounded to their dtype;
* ``composed``: roundpipe on the same backend, unpaired, the composition written out:
  ``master.grad = partner.grad.float()``, ``step()``, ``partner.copy_(master)``;
* ``torch``: the same composition with ``torch.optim`` (its for-loop).

After every step the paired run's masters, partners and state tensors must equal the composed
run's bit for bit, on every backend (the pairing is defined as that composition), and, on the
backends that claim torch's for-loop bit for bit (``harness.exact_backend``), the torch run's
too, except where ``deviations.py`` declares a difference from torch for the case.

Roles in the parameter set (``harness.PARAMS`` without its complex entries, which cannot be
paired): ``3x5`` is an fp32 parameter without a partner, ``1 element`` a master with its own
fp32 gradient (its partner written, never read), ``7x11`` gets no gradient every third step (not
stepped, its partner not written); the others read their partner's gradient. So every step
runs units of three pairings side by side, and the empty and 0-d parameters are paired too.
"""

from __future__ import annotations

import pytest
import torch

import roundpipe.optim
from roundpipe.optim.masters import pair

from . import deviations
from .cases import BACKENDS, CASES
from .harness import PARAMS, bits_mismatch, exact_backend, gradients, make_params

STEPS = 6
DTYPES = (torch.bfloat16, torch.float16)
REAL = [i for i, s in enumerate(PARAMS) if not s.dtype.is_complex]
UNPAIRED = next(i for i in REAL if PARAMS[i].desc == "3x5")
OWN_GRAD = next(i for i in REAL if PARAMS[i].desc == "1 element")


def start_pairs(dtype):
    """(masters, partners): partners None where a parameter has none."""
    values = make_params()
    masters, partners = [], []
    for i in REAL:
        v = values[i].detach()
        if i == UNPAIRED:
            masters.append(v.clone())
            partners.append(None)
        else:
            q = v.to(dtype)
            masters.append(q.float())
            partners.append(q)
    return masters, partners


def _grads(step, dtype):
    """Per parameter: (the master's own gradient, the partner's gradient)."""
    grads = gradients(step)
    out = []
    for i in REAL:
        g = grads[i]
        if g is None:
            out.append((None, None))
        elif i in (UNPAIRED, OWN_GRAD):
            out.append((g.clone(), None))
        else:
            out.append((None, g.to(dtype)))
    return out


def _composed_step(opt, masters, partners, grads):
    stepped = []
    for m, q, (own, low) in zip(masters, partners, grads, strict=True):
        m.grad = own if own is not None else (low.float() if low is not None else None)
        stepped.append(m.grad is not None and q is not None)
    opt.step()
    with torch.no_grad():
        for m, q, s in zip(masters, partners, stepped, strict=True):
            if s:
                q.copy_(m)


def _paired_step(opt, masters, partners, grads):
    for m, q, (own, low) in zip(masters, partners, grads, strict=True):
        m.grad = own
        if q is not None:
            q.grad = low
    opt.step()


def _state(opt, masters):
    out = []
    for m in masters:
        st = opt.state.get(m, {})
        out.append({k: v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _signless_mismatch(a, b):
    """``bits_mismatch`` with the sign of zeros ignored (-0.0 + 0.0 is +0.0; every other bit kept)."""
    return bits_mismatch(a + 0.0, b + 0.0)


def compare_masters(where, ours, theirs, zero_sign=True):
    diff = bits_mismatch if zero_sign else _signless_mismatch  # deviations.PARTNER_SIGNED_ZERO
    (om, oq, os_), (tm, tq, ts) = ours, theirs
    for k, i in enumerate(REAL):
        desc = PARAMS[i].desc
        problem = diff(om[k], tm[k])
        assert problem is None, f"{where}: master {desc!r}: {problem}"
        if oq[k] is not None:
            problem = diff(oq[k], tq[k])
            assert problem is None, f"{where}: partner {desc!r}: {problem}"
        assert os_[k].keys() == ts[k].keys(), (
            f"{where}: state keys of {desc!r}: {sorted(os_[k])} vs {sorted(ts[k])}"
        )
        for name in os_[k]:
            problem = diff(os_[k][name], ts[k][name])
            assert problem is None, f"{where}: state {name!r} of {desc!r}: {problem}"


def _params():
    for case in CASES:
        for backend in BACKENDS:
            for dtype in DTYPES:
                yield pytest.param(case, backend, dtype, id=f"{case.id}-{backend}-{str(dtype).split('.')[1]}")


@pytest.mark.parametrize("case, backend, dtype", list(_params()))
def test_partners(case, backend, dtype):
    cls = getattr(roundpipe.optim, case.optimizer)
    runs = {}
    for run in ("paired", "composed", "torch"):
        masters, partners = start_pairs(dtype)
        if run == "paired":
            for m, q in zip(masters, partners, strict=True):
                if q is not None:
                    pair(m, q)
        if run == "torch":
            opt = getattr(torch.optim, case.optimizer)(masters, **case.make_kwargs(), foreach=False)
        else:
            opt = cls(masters, **case.make_kwargs(), backend=backend)
        runs[run] = (opt, masters, partners)
    declared = deviations.lookup(case, backend)
    vs_torch = exact_backend(backend)[0] and declared is None
    zero_sign = not any(d.matches(case, backend) for d in deviations.PARTNER_SIGNED_ZERO)
    for step in range(STEPS):
        grads = _grads(step, dtype)
        snap = {}
        for run, (opt, masters, partners) in runs.items():
            (_paired_step if run == "paired" else _composed_step)(opt, masters, partners, grads)
            snap[run] = (masters, partners, _state(opt, masters))
        compare_masters(f"step {step}, paired vs composed", snap["paired"], snap["composed"])
        if vs_torch:
            where = f"step {step}, paired vs torch.optim composed"
            compare_masters(where, snap["paired"], snap["torch"], zero_sign)
    # the masters' state_dict is the composed run's (same layout, same values)
    sd_p, sd_c = runs["paired"][0].state_dict(), runs["composed"][0].state_dict()
    assert sd_p["param_groups"] == sd_c["param_groups"] or _same_groups(sd_p, sd_c)
    assert sd_p["state"].keys() == sd_c["state"].keys()


def _same_groups(a, b) -> bool:
    ga, gb = a["param_groups"], b["param_groups"]
    if len(ga) != len(gb):
        return False
    for x, y in zip(ga, gb, strict=True):
        if x.keys() != y.keys():
            return False
        for k in x:
            u, v = x[k], y[k]
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                if not torch.equal(torch.as_tensor(u), torch.as_tensor(v)):
                    return False
            elif u != v:
                return False
    return True
