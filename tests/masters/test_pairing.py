"""Pairing fp32 masters with bfloat16/float16 partners (``roundpipe/optim/masters.py``): ``pair``
refuses what it can see (nothing paired), ``unpair`` and ``partner_of``, and
``fp32_masters(model)``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe.optim import SGD, AdamW
from roundpipe.optim.masters import fp32_masters, pair, partner_of, unpair
from tests._util import assert_bits_equal, assert_unchanged, snapshot
from tests.masters._runs import randn


def _master(shape=(3, 4), seed=0):
    return nn.Parameter(randn(shape, seed), requires_grad=False)


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
    half = nn.Parameter(randn((4,), 3, torch.float16))
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


def _mixed_model():
    """The issue's model: a float16 Linear beside an fp32 LayerNorm."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8).half(), nn.LayerNorm(8))


def _backward(model, seed=0):
    x = randn((4, 8), seed, torch.float16)
    model[1](model[0](x).float()).pow(2).sum().backward()


def test_pairing_a_partner_again_supersedes_its_old_master():
    """``fp32_masters(model)`` run twice (a notebook cell run again): the newest masters write the
    partners; an optimizer over the old ones refuses to step (nothing moves) instead of writing
    the partners from stale masters, naming what to do; ``pair`` takes a partner back."""
    model = _mixed_model()
    old = fp32_masters(model)
    old_opt = AdamW(old, lr=0.1)
    new = fp32_masters(model)
    new_opt = AdamW(new, lr=0.1)
    weight = model[0].weight
    assert partner_of(new[0]) is weight and partner_of(old[0]) is weight  # the old one still names it
    _backward(model)
    before, partner = snapshot(old_opt), weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"fp32_masters or pair called again.*over the new masters"):
        old_opt.step()
    assert_unchanged(old_opt, before)
    assert_bits_equal(weight.detach(), partner)
    # the new masters step and write the partners: the composition
    expected = [m.detach().clone() for m in new]
    for m, g in zip(expected, new, strict=True):
        m.grad = (partner_of(g) if partner_of(g) is not None else g).grad.float()
    torch.optim.AdamW(expected, lr=0.1, foreach=False).step()
    new_opt.step()
    for m, e in zip(new, expected, strict=True):
        assert_bits_equal(m.detach(), e.detach())
    assert_bits_equal(weight.detach(), expected[0].detach().half())
    # pairing the old master again makes it the writer, and the newer one is refused in turn
    pair(old[0], weight)
    pair(old[1], model[0].bias)
    before = snapshot(new_opt)
    with pytest.raises(RuntimeError, match="paired with another master"):
        new_opt.step()
    assert_unchanged(new_opt, before)
    old_opt.step()  # (every old master paired again: it steps)
    # unpair ends a superseded pairing too: the master is a plain parameter again
    assert unpair(new[0]) is weight and partner_of(new[0]) is None


def _composed(masters, opt_cls, **kwargs):
    """The composition over copies of ``masters``: widen, step with torch's for-loop, round back."""
    copies = [m.detach().clone() for m in masters]
    for c, m in zip(copies, masters, strict=True):
        q = partner_of(m)
        c.grad = q.grad.float() if q is not None else m.grad
    opt_cls(copies, foreach=False, **kwargs).step()
    return copies


def test_one_master_in_two_optimizers_is_the_composition_run_twice():
    """As torch steps a parameter placed in two optimizers twice: each step of a master writes
    its partner from it (one writer, twice), bit for bit the composition run twice."""
    model = _mixed_model()
    masters = fp32_masters(model)
    _backward(model)
    first = _composed(masters, torch.optim.SGD, lr=0.1)
    SGD(masters, lr=0.1, backend="fast:numba").step()
    for m, c in zip(masters, first, strict=True):
        assert_bits_equal(m.detach(), c)
    second = _composed(masters[:2], torch.optim.AdamW, lr=0.01)
    AdamW(masters[:2], lr=0.01, backend="fast:numba").step()
    for m, c in zip(masters[:2], second, strict=True):
        assert_bits_equal(m.detach(), c)
        assert_bits_equal(partner_of(m).detach(), c.half())


def test_partner_resized_or_replaced_after_pairing():
    """A partner resized in place of its data is refused by the step, nothing moved; a module's
    parameter replaced by a new one leaves the master with the old tensor (no gradient: not
    stepped), as torch.optim keeps the parameter it was given; ``fp32_masters(model)`` again
    pairs the new one, and the old optimizer is refused for the superseded masters."""
    model = _mixed_model()
    masters = fp32_masters(model)
    opt = AdamW(masters, lr=0.1)
    _backward(model)
    weight = model[0].weight
    weight.data = torch.zeros(4, 8, dtype=torch.float16)  # the layer's data resized
    before = snapshot(opt)
    with pytest.raises(
        ValueError, match=r"params'\]\[0\].*the partner has shape \(4, 8\), its master \(8, 8\)"
    ):
        opt.step()
    assert_unchanged(opt, before)
    assert not weight.detach().any()

    model = _mixed_model()
    masters = fp32_masters(model)
    opt = AdamW(masters, lr=0.1)
    old = model[0].weight
    model[0].weight = nn.Parameter(torch.ones(8, 8, dtype=torch.float16))  # replaced
    _backward(model)
    assert old.grad is None and model[0].weight.grad is not None
    kept = masters[0].detach().clone()
    opt.step()
    assert_bits_equal(masters[0].detach(), kept)  # not stepped: its partner has no gradient
    assert_bits_equal(model[0].weight.detach(), torch.ones(8, 8, dtype=torch.float16))
    new_opt = AdamW(fp32_masters(model), lr=0.1)
    with pytest.raises(RuntimeError, match="paired with another master"):
        opt.step()
    new_opt.step()
    assert not torch.equal(model[0].weight.detach(), torch.ones(8, 8, dtype=torch.float16))
