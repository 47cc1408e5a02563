"""Pairing fp32 masters with bfloat16/float16 partners (``roundpipe/optim/masters.py``): ``pair``
refuses what it can see (nothing paired), ``unpair`` and ``partner_of``, and
``fp32_masters(model)``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe.optim.masters import fp32_masters, pair, partner_of, unpair
from tests._util import assert_bits_equal
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
