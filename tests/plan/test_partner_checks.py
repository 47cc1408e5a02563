"""The step plan's checks of paired masters (``roundpipe.optim.masters``): what ``pair`` cannot see
(tampering after pairing, overlaps, both gradients, bad partner gradients) is refused by
``step`` (``plan/checks.py``, ``GroupPlan.grads``), with a message naming
``param_groups[0]['params'][i]`` and nothing modified; and the mutations between steps the
plan must see (``pair``, ``unpair``, a partner's ``.data`` swapped).

Two gaps found by these tests and fixed: a partner re-viewed at its own address after a step
(``.data =`` a view of its storage: other strides, shape or dtype) is re-validated, and a partner
sharing memory with another partner's gradient is refused (the fused pass would write it before
reading that gradient; the composition widens every gradient first).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import roundpipe.optim
from roundpipe.optim.masters import pair, partner_of, unpair
from tests._util import assert_bits_equal, assert_unchanged, bits_equal, snapshot
from tests.masters._runs import (
    DTYPE_IDS,
    DTYPES,
    ENGINES,
    assert_state_dicts_bits,
    composition_kind,
    make_optimizer,
    randn,
)

SHAPES = [(3, 4), (5,), (6,)]


def _setup(engine, dtype=torch.bfloat16):
    """Three masters paired with plain (no requires_grad) partners; AdamW."""
    masters, partners = [], []
    for i, s in enumerate(SHAPES):
        q = randn(s, i, dtype)
        m = nn.Parameter(q.float(), requires_grad=False)
        masters.append(pair(m, q))
        partners.append(q)
    opt = roundpipe.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, backend=engine)
    return masters, partners, opt


def _partner_grads(partners, k):
    for i, q in enumerate(partners):
        q.grad = randn(q.shape, 100 * k + i, q.dtype)


def _repair_overlapping_partners(ms, qs, opt):
    buf = torch.zeros(20, dtype=torch.bfloat16)
    new = [buf[:12].view(3, 4), buf[10:15]]
    for m, q in zip(ms[:2], new, strict=True):
        pair(m, q)
        q.grad = torch.ones_like(q)


def _pair_with(i, make):
    def tamper(ms, qs, opt):
        q = make(ms, qs, opt)
        pair(ms[i], q)
        q.grad = torch.ones_like(q)

    return tamper


def _grad_data(i, make):
    def tamper(ms, qs, opt):
        qs[i].grad.data = make(qs[i])

    return tamper


STEP_REFUSES = {
    # id: (tamper(masters, partners, opt), index named, exception, message, needs a step first)
    "partner .data other shape": (
        lambda ms, qs, o: setattr(qs[1], "data", torch.empty(6, dtype=torch.bfloat16)),
        1,
        ValueError,
        "shape",
        False,
    ),
    "partner .data float32": (
        lambda ms, qs, o: setattr(qs[1], "data", torch.zeros(5)),
        1,
        TypeError,
        "bfloat16 or torch.float16",
        False,
    ),
    "partner .data float64": (
        lambda ms, qs, o: setattr(qs[0], "data", torch.zeros(3, 4, dtype=torch.float64)),
        0,
        TypeError,
        "bfloat16 or torch.float16",
        False,
    ),
    "partner .data int32": (
        lambda ms, qs, o: setattr(qs[2], "data", torch.zeros(6, dtype=torch.int32)),
        2,
        TypeError,
        "bfloat16 or torch.float16",
        False,
    ),
    # the pass would write partner 0 before it reads partner 1's gradient: refused (the
    # composition widens every gradient first), also once the plan is checked per step only
    "a partner grad on another partner": (
        lambda ms, qs, o: setattr(qs[1], "grad", qs[0].detach().view(-1)[2:7]),
        0,
        ValueError,
        r"overlaps in memory with the gradient of param_groups\[0\]\['params'\]\[1\]",
        False,
    ),
    "partner .data overlaps its master": (
        lambda ms, qs, o: setattr(qs[2], "data", ms[2].detach().view(torch.bfloat16)[:6]),
        2,
        ValueError,
        "overlaps its master",
        False,
    ),
    "partner .data not contiguous": (
        lambda ms, qs, o: setattr(qs[0], "data", torch.zeros(4, 3, dtype=torch.bfloat16).t()),
        0,
        ValueError,
        "not contiguous",
        False,
    ),
    "partners overlap": (
        _repair_overlapping_partners,
        1,
        ValueError,
        r"overlaps in memory with the partner of param_groups\[0\]\['params'\]\[0\]",
        False,
    ),
    "partner overlaps another master": (
        _pair_with(0, lambda ms, qs, o: ms[2].detach().view(torch.bfloat16).view(3, 4)),
        0,
        ValueError,
        r"overlaps in memory with a parameter or state tensor of param_groups\[0\]\['params'\]\[2\]",
        False,
    ),
    "partner overlaps a state tensor of another master": (
        _pair_with(1, lambda ms, qs, o: o.state[ms[2]]["exp_avg"].view(torch.bfloat16)[:5]),
        1,
        ValueError,
        r"overlaps in memory with a parameter or state tensor of param_groups\[0\]\['params'\]\[2\]",
        True,
    ),
    "both grads": (
        lambda ms, qs, o: setattr(ms[1], "grad", torch.zeros(5)),
        1,
        ValueError,
        "ambiguous",
        False,
    ),
    "partner grad float16": (
        _grad_data(1, lambda q: torch.zeros(5, dtype=torch.float16)),
        1,
        RuntimeError,
        "partner's grad",
        False,
    ),
    "partner grad float32": (
        _grad_data(1, lambda q: torch.zeros(5)),
        1,
        RuntimeError,
        "partner's grad",
        False,
    ),
    "partner grad other shape": (
        _grad_data(2, lambda q: torch.zeros(7, dtype=torch.bfloat16)),
        2,
        RuntimeError,  # as for an unpaired grad of the wrong shape
        "partner's grad",
        False,
    ),
    "partner grad not contiguous": (
        lambda ms, qs, o: setattr(qs[0], "grad", torch.zeros(4, 3, dtype=torch.bfloat16).t()),
        0,
        ValueError,
        "partner's grad",
        False,
    ),
    "master .data other shape": (
        lambda ms, qs, o: setattr(ms[1], "data", torch.zeros(6)),
        1,
        ValueError,
        "shape",
        False,
    ),
    "master .data complex64": (
        lambda ms, qs, o: setattr(ms[1], "data", torch.zeros(5, dtype=torch.complex64)),
        1,
        TypeError,
        "must be float32",
        False,
    ),
    "master .data float64": (
        lambda ms, qs, o: setattr(ms[2], "data", torch.zeros(6, dtype=torch.float64)),
        2,
        TypeError,
        "must be float32",
        False,
    ),
}


def _partner_snapshot(opt):
    out = []
    for group in opt.param_groups:
        for m in group["params"]:
            q = partner_of(m)
            g = None if q is None else q.grad
            out.append(
                (
                    q,
                    None if q is None else (q.data_ptr(), q.detach().clone()),
                    g,
                    None if g is None else g.detach().clone(),
                )
            )
    return out


def _assert_partners_unchanged(opt, snap):
    now = _partner_snapshot(opt)
    assert len(now) == len(snap)
    for i, ((q, val, g, gval), (q2, _, g2, _)) in enumerate(zip(snap, now, strict=True)):
        assert q2 is q, f"param {i}: pairing changed"
        assert g2 is g, f"param {i}: partner grad replaced"
        if q is not None:
            assert q.data_ptr() == val[0], f"param {i}: partner moved"
            assert_bits_equal(q.detach(), val[1], f"param {i}: partner was modified")
        if g is not None:
            assert_bits_equal(g.detach(), gval, f"param {i}: partner grad was modified")


def _good_steps(opt, qs):
    """Two steps: the first creates the state (its plan holds for that step only), the second
    builds the plan that later steps check cheaply (what a tamper must get past)."""
    for k in range(2):
        _partner_grads(qs, k)
        opt.step()
    assert opt._roundpipe_plan is not None and not opt._roundpipe_plan.valid_for_one_step


def _assert_step_refused(opt, index, exc, match):
    snap, psnap = snapshot(opt), _partner_snapshot(opt)
    where = rf"param_groups\[0\]\['params'\]\[{index}\]"
    with pytest.raises(exc, match=where) as info:
        opt.step()
    assert info.match(match)
    assert_unchanged(opt, snap)
    _assert_partners_unchanged(opt, psnap)


@pytest.mark.parametrize(
    ("case", "after_a_step"),
    [
        pytest.param(case, later, id=f"{case}-{'later steps' if later else 'first step'}")
        for case, (*_, needs_state) in STEP_REFUSES.items()
        for later in ([True] if needs_state else [False, True])
    ],
)
@pytest.mark.parametrize("engine", ENGINES)
def test_step_refuses(engine, case, after_a_step):
    tamper, index, exc, match, _ = STEP_REFUSES[case]
    ms, qs, opt = _setup(engine)
    if after_a_step:
        _good_steps(opt, qs)
    _partner_grads(qs, 2)
    tamper(ms, qs, opt)
    _assert_step_refused(opt, index, exc, match)
    # and it keeps refusing (the failed step left no plan behind that would accept it)
    _assert_step_refused(opt, index, exc, match)


def _same_address(make):
    """A tamper that gives the partner new metadata over the same memory."""

    def tamper(ms, qs, opt):
        q = qs[1]
        q.data = make(q)
        assert q.data_ptr() == opt._roundpipe_plan.groups[0].partners[1].data_ptr()

    return tamper


# Tampering with a partner after a step without moving its address (``.data =`` a view of its own
# storage): the plan's per-step check compares each partner's address, shape, strides and dtype.
SAME_ADDRESS = {
    # the partner of ms[1] (shape (5,)) lives in a buffer of 10: re-viewed with stride 2
    "not contiguous": (
        _same_address(lambda q: q._base_buf.as_strided((5,), (2,))),
        ValueError,
        "not contiguous",
    ),
    "reshaped": (_same_address(lambda q: q.detach()[:4].view(2, 2)), ValueError, "shape"),
    # the partner's bfloat16 grad stays, the partner becomes float16: ambiguous bits
    "float16 view": (_same_address(lambda q: q.detach().view(torch.float16)), RuntimeError, "partner's grad"),
}


@pytest.mark.parametrize("case", list(SAME_ADDRESS))
@pytest.mark.parametrize("engine", ENGINES)
def test_step_refuses_same_address_tampering(engine, case):
    tamper, exc, match = SAME_ADDRESS[case]
    ms, qs, opt = _setup(engine)
    buf = torch.zeros(10, dtype=torch.bfloat16)
    buf[:5] = qs[1]
    q = buf[:5]
    q._base_buf = buf
    pair(ms[1], q)
    qs[1] = q
    _good_steps(opt, qs)
    _partner_grads(qs, 2)
    tamper(ms, qs, opt)
    _assert_step_refused(opt, 1, exc, match)


def test_partner_sharing_memory_with_a_partner_grad():
    """a's partner is b's partner's gradient (same memory): refused, or the composition."""
    n = 64
    qa, qb = randn((n,), 1, torch.bfloat16), randn((n,), 2, torch.bfloat16)
    qb.grad = randn((n,), 3, torch.bfloat16)
    qa_on_grad = qb.grad.detach()  # the same memory as qb.grad
    qa_on_grad.copy_(qa)  # a's partner's value ... which is also b's partner's gradient now
    qa_on_grad.grad = randn((n,), 4, torch.bfloat16)
    ms = [nn.Parameter(q.float(), requires_grad=False) for q in (qa_on_grad, qb)]
    pair(ms[0], qa_on_grad)
    pair(ms[1], qb)
    # the composition, written out on copies
    cms = [m.detach().clone() for m in ms]
    cms[0].grad = qa_on_grad.grad.float()
    cms[1].grad = qb.grad.float()
    torch.optim.SGD(cms, lr=0.1, foreach=False).step()
    opt = roundpipe.optim.SGD(ms, lr=0.1, backend="fast:numba")
    snap, psnap = snapshot(opt), _partner_snapshot(opt)
    try:
        opt.step()
    except ValueError as e:
        assert re.search(r"param_groups\[0\]\['params'\]\[[01]\]", str(e)), e
        assert_unchanged(opt, snap)
        _assert_partners_unchanged(opt, psnap)
        return
    for i in range(2):
        assert_bits_equal(ms[i].detach(), cms[i], f"master {i}")
    assert_bits_equal(qb.detach(), cms[1].to(torch.bfloat16), "b's partner")
    assert_bits_equal(qa_on_grad.detach(), cms[0].to(torch.bfloat16), "a's partner")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_mutations_between_steps(engine, dtype):
    """Step by step, against the composition (each master's current partner, if any, read and
    written; every other tensor left alone):

    0. a, c paired; b unpaired, stepped with its own gradient;
    1. pair(b, qb): b reads qb's gradient, qb is written from now on;
    2. unpair(c): c steps with its own gradient, qc is no longer written (nor read);
    3. qa.data swapped to new storage of the same shape and dtype: the new storage is written,
       the old one left alone;
    4. pair(a, qa2), a new partner: qa2 read and written, qa no longer;
    5. unpair(b), and b without a gradient of its own: b not stepped (qb's gradient not read).

    Every tensor that is or was a partner has a gradient at every step (only partners' are read).
    """
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    shapes = [(3, 4), (5,), (6,)]

    def build(kind):
        qs = [randn(s, 10 + i, dtype) for i, s in enumerate(shapes)]
        ms = [nn.Parameter(q.float(), requires_grad=False) for q in qs]
        return ms, qs, make_optimizer(kind, "AdamW", ms, engine, **kwargs)

    ms, qs, opt = build("paired")
    cms, _, copt = build(composition_kind(engine))
    qa2 = randn((3, 4), 99, dtype)
    pair(ms[0], qs[0])
    pair(ms[2], qs[2])
    cur = [qs[0], None, qs[2]]  # the composition's partner of each master
    own = {0: {1}, 2: {2}, 3: {2}, 4: {2}, 5: {2}}  # masters with a gradient of their own
    old = None
    for k in range(6):
        if k == 1:
            pair(ms[1], qs[1])
            cur[1] = qs[1]
        elif k == 2:
            assert unpair(ms[2]) is qs[2]
            cur[2] = None
        elif k == 3:
            old = qs[0].data
            qs[0].data = old.clone()
            assert qs[0].data_ptr() != old.data_ptr()
        elif k == 4:
            pair(ms[0], qa2)
            cur[0] = qa2
        elif k == 5:
            assert unpair(ms[1]) is qs[1]
            cur[1] = None
        assert [partner_of(m) for m in ms] == cur
        tensors = [*qs, qa2] + ([old] if old is not None else [])
        for j, t in enumerate([*qs, qa2]):
            t.grad = randn(t.shape, 1000 * k + j, dtype)
        before = [t.detach().clone() for t in tensors]
        for i, s in enumerate(shapes):
            ms[i].grad = randn(s, 5000 * k + i) if i in own.get(k, ()) else None
        opt.step()
        # the composition
        for i in range(3):
            if ms[i].grad is not None:
                cms[i].grad = ms[i].grad.clone()
            else:
                cms[i].grad = None if cur[i] is None else cur[i].grad.float()
        copt.step()
        stepped = [cms[i].grad is not None for i in range(3)]
        for i in range(3):
            assert_bits_equal(ms[i].detach(), cms[i].detach(), f"step {k}: master {i}")
        assert_state_dicts_bits(opt.state_dict(), copt.state_dict(), ignore=("foreach",))
        written = {id(cur[i]): i for i in range(3) if cur[i] is not None and stepped[i]}
        for t, b in zip(tensors, before, strict=True):
            if id(t) in written:
                i = written[id(t)]
                assert_bits_equal(t.detach(), cms[i].detach().to(dtype), f"step {k}: master {i}'s partner")
            else:
                assert_bits_equal(t.detach(), b, f"step {k}: a tensor that is no partner of a stepped master")
    assert stepped == [True, False, True]
    assert opt.state[ms[1]]["step"].item() == 5  # steps 0 to 4
    assert not bits_equal(qs[0].detach(), old)  # step 3 wrote the new storage
