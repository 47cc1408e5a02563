"""What the tests of paired masters (``roundpipe.optim.masters``) share: a small
low-precision model (``Net``), the run under test (``Paired``: ``fp32_masters(model)`` and one
roundpipe optimizer) and the composition it must equal, written out (``Composed``), and
bit-for-bit comparisons of the two.

A pairing's meaning is the composition ``master.grad = partner.grad.float(); opt.step();
partner.copy_(master)``: it runs on ``torch.optim`` (``foreach=False``) for the engines that
claim torch's for-loop bit for bit (``EXACT``), on roundpipe itself unpaired for the others.
"""

from __future__ import annotations

import torch
from torch import nn

import roundpipe.optim
from roundpipe.optim.masters import fp32_masters
from tests._util import assert_bits_equal

ENGINES = ["reference", "fast:numba", "fast:torch", "fast:numexpr"]
EXACT = ("reference", "fast:numba", "fast:torch")  # bit for bit torch.optim's for-loop
DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = ["bf16", "fp16"]
TRAINERS = {
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "SGD": dict(lr=1e-2, momentum=0.9),
}
STEPS = 5


def randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def make_optimizer(kind, name, params, engine, **kwargs):
    """``kind``: "paired"/"unpaired" (roundpipe on ``engine``) or "torch" (foreach=False)."""
    if kind == "torch":
        return getattr(torch.optim, name)(params, foreach=False, **kwargs)
    return getattr(roundpipe.optim, name)(params, backend=engine, **kwargs)


def composition_kind(engine):
    """What the composition runs on: torch where the engine claims torch bit for bit, else
    roundpipe on the same engine, unpaired."""
    return "torch" if engine in EXACT else "unpaired"


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
            self.head.extra = nn.Parameter(randn((3,), 7, dtype))

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


def loss_of(model, k):
    dtype = model.fc1.weight.dtype
    x = randn((4, 6), 1000 + k, dtype)
    y = randn((4, 3), 2000 + k)
    return (model(x, k) - y).pow(2).mean()


class Paired:
    """The run under test: ``fp32_masters(model)`` and one roundpipe optimizer."""

    def __init__(self, dtype, name, engine, kwargs, mixed=False, masters=None):
        self.model = Net(dtype, mixed)
        self.partners = list(self.model.parameters())
        self.masters = fp32_masters(self.model)
        self.opt = make_optimizer(
            "paired", name, self.masters if masters is None else masters(self), engine, **kwargs
        )

    def backward(self, k, set_to_none=True):
        self.opt.zero_grad(set_to_none)
        loss_of(self.model, k).backward()
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
        kind = kind or composition_kind(engine)
        self.opt = make_optimizer(
            kind, name, self.masters if masters is None else masters(self), engine, **kwargs
        )

    def backward(self, k, set_to_none=True):
        self.model.zero_grad(set_to_none)
        self.opt.zero_grad()
        loss_of(self.model, k).backward()
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


def assert_state_dicts_bits(sa, sb, ignore=()):
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


def assert_same(run, ref):
    """Partners (int16 bits), masters (int32 bits) and optimizer state, bit for bit."""
    assert len(run.partners) == len(ref.partners)
    for i, (a, b) in enumerate(zip(run.partners, ref.partners, strict=True)):
        assert a.dtype == b.dtype
        assert_bits_equal(a.detach(), b.detach(), f"partner {i}")
    for i, (a, b) in enumerate(zip(run.masters, ref.masters, strict=True)):
        assert a.dtype == torch.float32
        assert_bits_equal(a.detach(), b.detach(), f"master {i}")
    # torch's groups say foreach=False, roundpipe's foreach=None (ignored, the contract)
    assert_state_dicts_bits(run.opt.state_dict(), ref.opt.state_dict(), ignore=("foreach",))


def assert_partners_rounded(run, indices=None):
    for i in range(len(run.partners)) if indices is None else indices:
        m, q = run.masters[i], run.partners[i]
        if m is not q:
            assert_bits_equal(q.detach(), m.detach().to(q.dtype), f"partner {i} is its master rounded")
