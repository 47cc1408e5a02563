"""fp32 masters paired with bfloat16/float16 model parameters (``roundpipe.optim.masters``).

A pairing's meaning is the composition ``master.grad = partner.grad.float(); opt.step();
partner.copy_(master)``. These tests train small low-precision models with paired masters and
compare, bit for bit, with that composition written out: with ``torch.optim`` (``foreach=False``)
on the engines that claim torch's for-loop bit for bit (``reference``, ``fast:torch``,
``fast:numba``), with roundpipe itself unpaired on ``fast:numexpr`` (not bit for bit torch, but
bit for bit its own composition). Covered:

* training (AdamW, SGD with momentum; bfloat16 and float16), and a mixed model: an fp32
  parameter that is its own master, a master with its own gradient (its partner still
  written), a partner without a gradient on some steps (not stepped, partner left alone);
* validation: what ``pair`` can see is refused by ``pair`` (nothing paired); what it cannot see
  (tampering after pairing, overlaps, both gradients, bad partner gradients) by ``step``, with a
  message naming ``param_groups[0]['params'][i]`` and nothing modified;
* ``state_dict`` (equal to the composition's, interchangeable with torch.optim's both ways),
  ``add_param_group``, ``StepLR``, a closure, ``zero_grad`` (both ways), and the mutations
  between steps the step plan must see (``pair``, ``unpair``, a partner's ``.data`` swapped);
* every optimizer with its default hyperparameters on the numba engine, a smoke grid (the full
  option grid is ``conformance/test_partners.py``).

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
from roundpipe.optim.masters import fp32_masters, pair, partner_of, unpair
from tests._util import OPTIMIZER_NAMES, assert_bits_equal, assert_unchanged, bits_equal, roundtrip, snapshot

ENGINES = ["reference", "fast:numba", "fast:torch", "fast:numexpr"]
EXACT = ("reference", "fast:numba", "fast:torch")  # bit for bit torch.optim's for-loop
DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = ["bf16", "fp16"]
TRAINERS = {
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "SGD": dict(lr=1e-2, momentum=0.9),
}
STEPS = 5


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _optimizer(kind, name, params, engine, **kwargs):
    """``kind``: "paired"/"unpaired" (roundpipe on ``engine``) or "torch" (foreach=False)."""
    if kind == "torch":
        return getattr(torch.optim, name)(params, foreach=False, **kwargs)
    return getattr(roundpipe.optim, name)(params, backend=engine, **kwargs)


def _composition_kind(engine):
    """What the composition runs on: torch where the engine claims torch bit for bit, else
    roundpipe on the same engine, unpaired."""
    return "torch" if engine in EXACT else "unpaired"


# ---------------------------------------------------------------------------------------------
# models and the two training loops


class Net(nn.Module):
    """Two Linear layers and a LayerNorm in ``dtype``; with ``mixed``, also an fp32 ``scale``
    (its own master) and ``extra``, used on even steps only (no gradient on odd ones)."""

    def __init__(self, dtype, mixed=False, seed=0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.fc1 = nn.Linear(6, 8)
            self.norm = nn.LayerNorm(8)
            self.fc2 = nn.Linear(8, 3)
            with torch.no_grad():
                self.norm.weight.add_(0.1 * torch.randn(8))
                self.norm.bias.add_(0.1 * torch.randn(8))
        self.to(dtype)
        self.mixed = mixed
        if mixed:
            # in a submodule registered last: parameters() lists them after fc2's
            self.head = nn.Module()
            self.head.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
            self.head.extra = nn.Parameter(_randn((3,), 7, dtype))

    def forward(self, x, k):
        out = self.fc2(torch.tanh(self.norm(self.fc1(x)))).float()
        if self.mixed:
            out = out * self.head.scale
            if k % 2 == 0:
                out = out + self.head.extra.float()
        return out


N_PLAIN = 6  # parameters of a plain Net
OWN = 5  # in the mixed tests: fc2.bias's master gets its own gradient
SCALE, EXTRA = 6, 7  # the mixed Net's fp32 parameter and its sometimes-unused one


def _loss(model, k):
    dtype = model.fc1.weight.dtype
    x = _randn((4, 6), 1000 + k, dtype)
    y = _randn((4, 3), 2000 + k)
    return (model(x, k) - y).pow(2).mean()


class Paired:
    """The run under test: ``fp32_masters(model)`` and one roundpipe optimizer."""

    def __init__(self, dtype, name, engine, kwargs, mixed=False, masters=None):
        self.model = Net(dtype, mixed)
        self.partners = list(self.model.parameters())
        self.masters = fp32_masters(self.model)
        self.opt = _optimizer(
            "paired", name, self.masters if masters is None else masters(self), engine, **kwargs
        )

    def backward(self, k, set_to_none=True):
        self.opt.zero_grad(set_to_none)
        _loss(self.model, k).backward()
        if self.model.mixed:
            m, q = self.masters[OWN], self.partners[OWN]
            m.grad = q.grad.float() * 0.5  # the caller's own gradient (e.g. clipped)
            q.grad = None

    def step(self, k, set_to_none=True):
        self.backward(k, set_to_none)
        self.opt.step()


class Composed:
    """The composition written out: plain fp32 masters, explicit casts."""

    def __init__(self, dtype, name, engine, kwargs, mixed=False, kind=None, masters=None):
        self.model = Net(dtype, mixed)
        self.partners = list(self.model.parameters())
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.partners]
        kind = kind or _composition_kind(engine)
        self.opt = _optimizer(
            kind, name, self.masters if masters is None else masters(self), engine, **kwargs
        )

    def backward(self, k, set_to_none=True):
        self.model.zero_grad(set_to_none)
        self.opt.zero_grad()
        _loss(self.model, k).backward()
        for i, (m, q) in enumerate(zip(self.masters, self.partners, strict=True)):
            if m is q:
                continue
            if self.model.mixed and i == OWN:
                m.grad = q.grad.float() * 0.5
            else:
                m.grad = None if q.grad is None else q.grad.float()

    def write_partners(self):
        with torch.no_grad():
            for m, q in zip(self.masters, self.partners, strict=True):
                if m is not q and m.grad is not None and m in self.stepped():
                    q.copy_(m)

    def stepped(self):
        return {m for group in self.opt.param_groups for m in group["params"]}

    def step(self, k, set_to_none=True):
        self.backward(k, set_to_none)
        self.opt.step()
        self.write_partners()


def _assert_state_dicts_bits(sa, sb, ignore=()):
    """Equal structure, bit-equal tensors, equal other values (``ignore``: group keys)."""
    assert set(sa) == set(sb) == {"state", "param_groups"}
    assert len(sa["param_groups"]) == len(sb["param_groups"])
    for ga, gb in zip(sa["param_groups"], sb["param_groups"], strict=True):
        ga = {k: v for k, v in ga.items() if k not in ignore}
        gb = {k: v for k, v in gb.items() if k not in ignore}
        assert ga == gb
    assert sorted(sa["state"]) == sorted(sb["state"])
    for pid, st in sa["state"].items():
        other = sb["state"][pid]
        assert sorted(st) == sorted(other), (pid, sorted(st), sorted(other))
        for key, v in st.items():
            w = other[key]
            assert type(v) is type(w), (pid, key)
            if isinstance(v, torch.Tensor):
                assert_bits_equal(v, w, f"state[{pid}][{key!r}]")
            else:
                assert v == w, (pid, key, v, w)


def _assert_same(run, ref):
    """Partners (int16 bits), masters (int32 bits) and optimizer state, bit for bit."""
    assert len(run.partners) == len(ref.partners)
    for i, (a, b) in enumerate(zip(run.partners, ref.partners, strict=True)):
        assert a.dtype == b.dtype
        assert_bits_equal(a.detach(), b.detach(), f"partner {i}")
    for i, (a, b) in enumerate(zip(run.masters, ref.masters, strict=True)):
        assert a.dtype == torch.float32
        assert_bits_equal(a.detach(), b.detach(), f"master {i}")
    # torch's groups say foreach=False, roundpipe's foreach=None (ignored, the contract)
    _assert_state_dicts_bits(run.opt.state_dict(), ref.opt.state_dict(), ignore=("foreach",))


def _assert_partners_rounded(run, indices=None):
    for i in range(len(run.partners)) if indices is None else indices:
        m, q = run.masters[i], run.partners[i]
        if m is not q:
            assert_bits_equal(q.detach(), m.detach().to(q.dtype), f"partner {i} is its master rounded")


# ---------------------------------------------------------------------------------------------
# 1. training, bit for bit the composition


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(TRAINERS))
@pytest.mark.parametrize("engine", ENGINES)
def test_training_matches_composition(engine, name, dtype):
    run = Paired(dtype, name, engine, TRAINERS[name])
    ref = Composed(dtype, name, engine, TRAINERS[name])
    start = [q.detach().clone() for q in run.partners]
    assert all(partner_of(m) is q for m, q in zip(run.masters, run.partners, strict=True))
    assert all(
        bits_equal(m.detach(), q.detach().float()) for m, q in zip(run.masters, run.partners, strict=True)
    )
    for k in range(STEPS):
        run.step(k)
        ref.step(k)
        _assert_same(run, ref)
        _assert_partners_rounded(run)
    # the model really trained, in its own dtype, in place
    assert all(q.dtype == dtype for q in run.model.parameters())
    assert all(not bits_equal(q.detach(), s) for q, s in zip(run.partners, start, strict=True))
    assert all(m.grad is None for m in run.masters)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("engine", ["fast:numba", "fast:torch", "reference"])
def test_training_exact_engines_match_their_unpaired_selves(engine, dtype):
    """The composition on roundpipe itself (unpaired) too, for the exact engines."""
    run = Paired(dtype, "AdamW", engine, TRAINERS["AdamW"])
    ref = Composed(dtype, "AdamW", engine, TRAINERS["AdamW"], kind="unpaired")
    for k in range(3):
        run.step(k)
        ref.step(k)
    _assert_same(run, ref)


# ---------------------------------------------------------------------------------------------
# 2. mixed: an fp32 parameter, a master with its own gradient, a partner without one


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(TRAINERS))
@pytest.mark.parametrize("engine", ENGINES)
def test_mixed_model(engine, name, dtype):
    run = Paired(dtype, name, engine, TRAINERS[name], mixed=True)
    ref = Composed(dtype, name, engine, TRAINERS[name], mixed=True)
    assert run.masters[SCALE] is run.model.head.scale and partner_of(run.model.head.scale) is None
    assert len(run.masters) == len(run.partners) == 8
    extra_m, extra_q = run.masters[EXTRA], run.partners[EXTRA]
    for k in range(STEPS):
        run.backward(k)
        ref.backward(k)
        assert run.partners[OWN].grad is None and run.masters[OWN].grad is not None
        if k % 2:
            # no gradient for ``extra`` this step: put a value in its partner that the master
            # does not round to; the step must leave it there
            assert extra_q.grad is None and extra_m.grad is None
            with torch.no_grad():
                for q in (extra_q, ref.partners[EXTRA]):
                    q.add_(1.0)
            kept, kept_ptr = extra_q.detach().clone(), extra_q.data_ptr()
            master_before = extra_m.detach().clone()
            state_before = {key: v.clone() for key, v in run.opt.state[extra_m].items()}
        run.opt.step()
        ref.opt.step()
        ref.write_partners()
        _assert_same(run, ref)
        # the own-gradient master's partner is written all the same
        _assert_partners_rounded(run, [OWN])
        if k % 2:
            assert extra_q.data_ptr() == kept_ptr
            assert_bits_equal(extra_q.detach(), kept, "the partner of a master not stepped")
            assert_bits_equal(extra_m.detach(), master_before, "a master not stepped")
            for key, v in run.opt.state[extra_m].items():
                assert_bits_equal(v, state_before[key], f"state {key!r} of a master not stepped")
        else:
            _assert_partners_rounded(run, [EXTRA])
    if name == "AdamW":
        assert run.opt.state[extra_m]["step"].item() == 3  # steps 0, 2, 4
        assert run.opt.state[run.masters[0]]["step"].item() == STEPS


# ---------------------------------------------------------------------------------------------
# 3. validation


def _master(shape=(3, 4), seed=0):
    return nn.Parameter(_randn(shape, seed), requires_grad=False)


PAIR_REFUSES = {
    # id: (partner for a float32 master of shape (3, 4), exception, message)
    "other shape": (lambda m: torch.zeros(4, 3, dtype=torch.bfloat16), ValueError, "shape"),
    "fewer elements": (lambda m: torch.zeros(3, 3, dtype=torch.bfloat16), ValueError, "shape"),
    "float32": (lambda m: torch.zeros(3, 4), TypeError, "bfloat16 or torch.float16"),
    "float64": (lambda m: torch.zeros(3, 4, dtype=torch.float64), TypeError, "bfloat16 or torch.float16"),
    "int32": (lambda m: torch.zeros(3, 4, dtype=torch.int32), TypeError, "bfloat16 or torch.float16"),
    "not contiguous": (lambda m: torch.zeros(4, 3, dtype=torch.bfloat16).t(), ValueError, "not contiguous"),
    "overlaps its master": (
        lambda m: m.detach().view(-1).view(torch.bfloat16)[:12].view(3, 4),
        ValueError,
        "overlaps its master",
    ),
    "meta": (lambda m: torch.zeros(3, 4, dtype=torch.bfloat16, device="meta"), ValueError, "device"),
    "not a tensor": (lambda m: [[0.0] * 4] * 3, TypeError, "must be a tensor"),
}


@pytest.mark.parametrize("already_paired", [False, True], ids=["unpaired", "paired"])
@pytest.mark.parametrize("case", list(PAIR_REFUSES))
def test_pair_refuses(case, already_paired):
    make, exc, match = PAIR_REFUSES[case]
    m = _master()
    old = torch.zeros(3, 4, dtype=torch.bfloat16)
    if already_paired:
        assert pair(m, old) is m
    before = m.detach().clone()
    with pytest.raises(exc, match=match):
        pair(m, make(m))
    # pairs nothing: the old pairing (or none) stays
    assert partner_of(m) is (old if already_paired else None)
    assert_bits_equal(m.detach(), before)


@pytest.mark.parametrize(
    "dtype", [torch.complex64, torch.float64, torch.bfloat16], ids=["complex64", "float64", "bfloat16"]
)
def test_pair_refuses_master_dtype(dtype):
    m = nn.Parameter(torch.zeros(3, 4, dtype=dtype), requires_grad=False)
    with pytest.raises(TypeError, match="must be float32"):
        pair(m, torch.zeros(3, 4, dtype=torch.bfloat16))
    assert partner_of(m) is None


def test_pair_unpair_partner_of():
    m, q, q2 = _master(), torch.zeros(3, 4, dtype=torch.float16), torch.zeros(3, 4, dtype=torch.bfloat16)
    assert partner_of(m) is None and unpair(m) is None
    assert pair(m, q) is m and partner_of(m) is q
    pair(m, q2)  # re-pairing replaces the partner
    assert partner_of(m) is q2
    assert unpair(m) is q2 and partner_of(m) is None
    # an empty master pairs with an empty partner
    e = _master((0,))
    pair(e, torch.zeros(0, dtype=torch.bfloat16))
    assert partner_of(e) is not None


def test_fp32_masters():
    lin = nn.Linear(3, 2).to(torch.bfloat16)
    frozen = nn.Parameter(torch.zeros(2, dtype=torch.float16), requires_grad=False)
    fp32 = nn.Parameter(torch.ones(2))
    half = nn.Parameter(_randn((4,), 3, torch.float16))
    params = [lin.weight, lin.bias, frozen, fp32, half, lin.weight]  # tied: listed once
    masters = fp32_masters(params)
    assert len(masters) == 4
    assert masters[2] is fp32 and partner_of(fp32) is None
    for m, q in zip([masters[0], masters[1], masters[3]], [lin.weight, lin.bias, half], strict=True):
        assert type(m) is nn.Parameter and m.dtype == torch.float32 and not m.requires_grad
        assert partner_of(m) is q
        assert m.data_ptr() != q.data_ptr() and m.is_contiguous()
        assert_bits_equal(m.detach(), q.detach().float())
    assert [partner_of(m) for m in fp32_masters(lin)] == [lin.weight, lin.bias]
    with pytest.raises(TypeError, match="float64"):
        fp32_masters([nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    with pytest.raises(TypeError, match="expected tensors"):
        fp32_masters([1.0])


SHAPES = [(3, 4), (5,), (6,)]


def _setup(engine, dtype=torch.bfloat16):
    """Three masters paired with plain (no requires_grad) partners; AdamW."""
    masters, partners = [], []
    for i, s in enumerate(SHAPES):
        q = _randn(s, i, dtype)
        m = nn.Parameter(q.float(), requires_grad=False)
        masters.append(pair(m, q))
        partners.append(q)
    opt = roundpipe.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, backend=engine)
    return masters, partners, opt


def _partner_grads(partners, k):
    for i, q in enumerate(partners):
        q.grad = _randn(q.shape, 100 * k + i, q.dtype)


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
    assert opt._roundpipe_plan is not None and not opt._roundpipe_plan.one_shot


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
    qa, qb = _randn((n,), 1, torch.bfloat16), _randn((n,), 2, torch.bfloat16)
    qb.grad = _randn((n,), 3, torch.bfloat16)
    qa_on_grad = qb.grad.detach()  # the same memory as qb.grad
    qa_on_grad.copy_(qa)  # a's partner's value ... which is also b's partner's gradient now
    qa_on_grad.grad = _randn((n,), 4, torch.bfloat16)
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


# ---------------------------------------------------------------------------------------------
# 4. state_dict, param groups, a scheduler, a closure


@pytest.mark.parametrize("engine", ENGINES)
def test_state_dict_equals_composition_and_loads_both_ways(engine):
    kwargs = dict(lr=1e-2, weight_decay=0.1, amsgrad=True)
    run = Paired(torch.bfloat16, "AdamW", engine, kwargs)
    ref = Composed(torch.bfloat16, "AdamW", engine, kwargs, kind="unpaired")
    for k in range(3):
        run.step(k)
        ref.step(k)
    sd = run.opt.state_dict()
    _assert_state_dicts_bits(sd, ref.opt.state_dict())
    assert sorted(sd["state"]) == list(range(N_PLAIN))
    assert sd["param_groups"][0]["params"] == list(range(N_PLAIN))
    # the state is the masters' (float32), never the partners' dtype
    for st in sd["state"].values():
        assert all(v.dtype == torch.float32 for v in st.values())

    # into torch.optim.AdamW (over the composition's masters, equal to ours) and back
    theirs = torch.optim.AdamW(ref.masters, foreach=False, **kwargs)
    theirs.load_state_dict(roundtrip(sd))
    _assert_state_dicts_bits(theirs.state_dict(), sd, ignore=("foreach",))
    ours = roundpipe.optim.AdamW(run.masters, backend=engine, **kwargs)
    # (through a checkpoint: a loaded state_dict shares torch's state tensors, which it steps too)
    ours.load_state_dict(roundtrip(theirs.state_dict()))
    _assert_state_dicts_bits(ours.state_dict(), sd, ignore=("foreach",))
    run.opt = ours
    if engine in EXACT:
        ref.opt = theirs
    else:
        ref.opt = _loaded_unpaired(ref.masters, engine, kwargs, roundtrip(theirs.state_dict()))
    for k in range(3, 5):
        run.step(k)
        ref.step(k)
        _assert_same(run, ref)
        _assert_partners_rounded(run)


def _loaded_unpaired(masters, engine, kwargs, sd):
    opt = roundpipe.optim.AdamW(masters, backend=engine, **kwargs)
    opt.load_state_dict(sd)
    return opt


@pytest.mark.parametrize("engine", ENGINES)
def test_param_groups_add_param_group_and_scheduler(engine):
    """Two groups (fc1's masters; then fc2's, added at step 2 with their own lr) and a StepLR:
    the added group is stepped from then on, its partners written; before, left alone."""
    kwargs = dict(lr=2e-2, momentum=0.9)

    def first(run):
        return run.masters[:2]

    run = Paired(torch.bfloat16, "SGD", engine, kwargs, masters=first)
    ref = Composed(torch.bfloat16, "SGD", engine, kwargs, masters=first)
    start = [q.detach().clone() for q in run.partners]
    sched = [torch.optim.lr_scheduler.StepLR(r.opt, step_size=2, gamma=0.5) for r in (run, ref)]
    for k in range(6):
        if k == 2:
            for r in (run, ref):
                r.opt.add_param_group({"params": r.masters[2:], "lr": 1e-2, "nesterov": True})
        run.step(k)
        ref.step(k)
        for s in sched:
            s.step()
        _assert_same(run, ref)
        if k < 2:  # not in the optimizer yet: not stepped, not written, no state
            for i in range(2, N_PLAIN):
                assert_bits_equal(run.partners[i].detach(), start[i], f"partner {i} outside the optimizer")
                assert run.masters[i] not in run.opt.state
        else:
            _assert_partners_rounded(run)
            # stepped (the partners may not move yet: a bfloat16 ulp is large next to lr * grad)
            assert all(not bits_equal(run.masters[i].detach(), start[i].float()) for i in range(2, N_PLAIN))
        assert [g["lr"] for g in run.opt.param_groups] == [g["lr"] for g in ref.opt.param_groups]
    assert run.opt.param_groups[0]["lr"] == 2e-2 * 0.5**3
    assert len(run.opt.param_groups) == 2 and run.opt.param_groups[1]["nesterov"] is True


@pytest.mark.parametrize("engine", ENGINES)
def test_closure(engine):
    kwargs = TRAINERS["AdamW"]
    run = Paired(torch.bfloat16, "AdamW", engine, kwargs)
    ref = Composed(torch.bfloat16, "AdamW", engine, kwargs)
    for k in range(3):

        def closure_run(k=k):
            run.opt.zero_grad()
            loss = _loss(run.model, k)
            loss.backward()
            return loss

        def closure_ref(k=k):
            ref.model.zero_grad()
            ref.opt.zero_grad()
            loss = _loss(ref.model, k)
            loss.backward()
            for m, q in zip(ref.masters, ref.partners, strict=True):
                m.grad = q.grad.float()
            return loss

        with torch.no_grad():  # torch's step runs the closure with grad enabled
            loss_run = run.opt.step(closure_run)
        loss_ref = ref.opt.step(closure_ref)
        ref.write_partners()
        assert_bits_equal(loss_run.detach(), loss_ref.detach(), "the closure's loss")
        _assert_same(run, ref)


# ---------------------------------------------------------------------------------------------
# 5. zero_grad


@pytest.mark.parametrize("engine", ENGINES)
def test_zero_grad_clears_partner_grads(engine):
    run = Paired(torch.bfloat16, "AdamW", engine, TRAINERS["AdamW"], mixed=True)
    run.backward(0)
    assert all(q.grad is not None for i, q in enumerate(run.partners) if i != OWN)
    run.opt.zero_grad()  # set_to_none=True
    assert all(q.grad is None for q in run.partners)
    assert all(m.grad is None for m in run.masters)
    run.opt.step()  # nothing has a gradient: nothing stepped
    assert not run.opt.state

    run.backward(0)
    grads = [q.grad for q in run.partners]
    own = run.masters[OWN].grad
    run.opt.zero_grad(set_to_none=False)
    for i, (q, g) in enumerate(zip(run.partners, grads, strict=True)):
        assert q.grad is g, i
        if g is not None:
            assert not bool(g.any()) and not g.requires_grad, i
    assert run.masters[OWN].grad is own and not bool(own.any())
    # a partner's grad that is part of a graph (create_graph=True) is detached and zeroed, as
    # torch does for a parameter's
    q = run.partners[0]
    w = torch.ones_like(q, requires_grad=True)
    q.grad = w * 2
    assert q.grad.grad_fn is not None
    run.opt.zero_grad(set_to_none=False)
    assert q.grad.grad_fn is None and not q.grad.requires_grad and not bool(q.grad.any())


@pytest.mark.parametrize("engine", ENGINES)
def test_zero_grad_set_to_none_false_accumulates(engine):
    """zero_grad(set_to_none=False) zeroes the partners' grads in place; the next backward
    accumulates into them, and the step reads them: as the composition does."""
    kwargs = TRAINERS["AdamW"]
    run = Paired(torch.bfloat16, "AdamW", engine, kwargs)
    ref = Composed(torch.bfloat16, "AdamW", engine, kwargs)
    run.step(0, set_to_none=False)
    ref.step(0, set_to_none=False)
    grads = [q.grad for q in run.partners]
    for k in range(1, 4):
        run.step(k, set_to_none=False)
        ref.step(k, set_to_none=False)
        assert all(q.grad is g for q, g in zip(run.partners, grads, strict=True))  # accumulated in place
        _assert_same(run, ref)
    # two backwards without a zero_grad in between: the step reads the sum
    for r in (run, ref):
        r.opt.zero_grad(set_to_none=False)
        if r is ref:
            r.model.zero_grad(set_to_none=False)
        _loss(r.model, 10).backward()
        _loss(r.model, 11).backward()
    for m, q in zip(ref.masters, ref.partners, strict=True):
        m.grad = q.grad.float()
    run.opt.step()
    ref.opt.step()
    ref.write_partners()
    _assert_same(run, ref)


# ---------------------------------------------------------------------------------------------
# 6. mutations between steps


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
        qs = [_randn(s, 10 + i, dtype) for i, s in enumerate(shapes)]
        ms = [nn.Parameter(q.float(), requires_grad=False) for q in qs]
        return ms, qs, _optimizer(kind, "AdamW", ms, engine, **kwargs)

    ms, qs, opt = build("paired")
    cms, _, copt = build(_composition_kind(engine))
    qa2 = _randn((3, 4), 99, dtype)
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
            t.grad = _randn(t.shape, 1000 * k + j, dtype)
        before = [t.detach().clone() for t in tensors]
        for i, s in enumerate(shapes):
            ms[i].grad = _randn(s, 5000 * k + i) if i in own.get(k, ()) else None
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
        _assert_state_dicts_bits(opt.state_dict(), copt.state_dict(), ignore=("foreach",))
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


# ---------------------------------------------------------------------------------------------
# 7. every optimizer, default hyperparameters, on the numba engine


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_optimizer_numba(name, dtype):
    kwargs = dict(lr=1e-2)
    run = Paired(dtype, name, "fast:numba", kwargs)
    ref = Composed(dtype, name, "fast:numba", kwargs, kind="unpaired")
    for k in range(3):
        run.step(k)
        ref.step(k)
        _assert_same(run, ref)
        _assert_partners_rounded(run)
