"""The 8-bit family's step on an unchanged plan replays its launches (``plan/staged.py``'s
``_Replay``, the numba engine's ``BlockwiseRecord``): the same bits as a step prepared anew,
and every change that needs another launch sends the step down the full path."""

from __future__ import annotations

import numba
import pytest
import torch

import roundpipe.optim as ro
from roundpipe.optim import backends
from roundpipe.optim.backends import numba_engine
from tests._util import assert_bits_equal, count_calls

# an 8-bit parameter two threads share, a small 8-bit one with a partial last block, and two
# under min_8bit_size (32-bit state)
SIZES = (3 * numba_engine.PARALLEL_MIN_NUMEL, 5003, 700, 1)


@pytest.fixture
def counted(monkeypatch):
    """Counts of the fast backend's staged prepares and rebinds."""
    monkeypatch.setattr(ro.threads, "_num_threads", None)
    yield count_calls(monkeypatch, backends.get("fast"), "prepare_staged", "rebind")
    ro.set_num_threads(None)


def _pair(cls=ro.AdamW8bit, **kwargs):
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(n, generator=g) for n in SIZES]
    ours = [torch.nn.Parameter(b.clone()) for b in base]
    ref = [torch.nn.Parameter(b.clone()) for b in base]
    return ours, ref, cls(ours, backend="fast", **kwargs), cls(ref, backend="reference", **kwargs), g


def _same(opt, ref_opt, ours, ref, what):
    for k, (p, q) in enumerate(zip(ours, ref, strict=True)):
        assert_bits_equal(p, q, f"{what}: param {k}")
        a, b = opt.state[p], ref_opt.state[q]
        assert a.keys() == b.keys(), what
        for name in a:
            if torch.is_tensor(a[name]):
                assert_bits_equal(a[name], b[name], f"{what}: param {k} {name}")
            else:
                assert a[name] == b[name], f"{what}: param {k} {name}"


@pytest.mark.parametrize("cls", [ro.AdamW8bit, ro.Lion8bit, ro.SGD8bit])
def test_an_unchanged_plan_replays_and_sees_every_change(counted, cls):
    """From the third step on (the first builds the plan, the second rebuilds it: ``first`` is
    an option), a step replays: new gradient tensors every step, a new learning rate, another
    thread count, a codebook changed in place are all seen, bit for bit the reference backend
    at every step. (Gradient factors: the masters' test below.)"""
    kwargs = {"lr": 0.01, "momentum": 0.9} if cls is ro.SGD8bit else {}
    ours, ref, opt, ref_opt, g = _pair(cls, **kwargs)
    # two passes a step (the 8-bit and the 32-bit program): a replay rebinds both (the 32-bit
    # program of an update without roots runs on the staged kernels, which do not rebind: that
    # pass is prepared again), or stops at the first whose record declines; the full path
    # prepares both
    again = 0 if cls is ro.AdamW8bit else 1

    def step(prepared, rebound):
        for p, q in zip(ours, ref, strict=True):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()  # new tensors, new addresses
        before = dict(counted)
        opt.step()
        ref_opt.step()
        _same(opt, ref_opt, ours, ref, f"after {counted}")
        replayed = rebound == 2
        assert counted["prepare_staged"] - before["prepare_staged"] == prepared + again * replayed, counted
        assert counted["rebind"] - before["rebind"] == rebound - again * replayed, counted

    ro.set_num_threads(1)
    step(2, 0)  # builds the plan and the state
    step(2, 0)  # rebuilt: no longer the first step
    step(0, 2)  # replayed
    for o in (opt, ref_opt):
        o.param_groups[0]["lr"] *= 0.5
    step(0, 2)  # a new learning rate is a new scalar
    if numba.config.NUMBA_NUM_THREADS >= 2:
        ro.set_num_threads(2)
        step(2, 1)  # another thread count: the first record declines, both prepared anew
        step(0, 2)
    # (every parameter's state shares one codebook tensor: give this one its own first)
    opt.state[ours[0]]["qmap1"] = opt.state[ours[0]]["qmap1"].clone()
    ref_opt.state[ref[0]]["qmap1"] = ref_opt.state[ref[0]]["qmap1"].clone()
    step(2, 0)  # another state tensor: the plan is rebuilt
    step(0, 2)
    codebook = opt.state[ours[0]]["qmap1"]
    codebook.copy_(codebook.flip(0).neg())  # another codebook, in place (its table is rebuilt)
    ref_opt.state[ref[0]]["qmap1"].copy_(codebook)
    step(2, 1)  # (the 8-bit pass comes first)
    step(0, 2)


def test_fp32_masters_replay_with_and_without_loss_scaling(counted):
    """A replayed step of fp32 masters still reads the partners' gradients and writes them; a
    loss scale's unscaling factor (folded into the step) selects other programs, replayed too."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.Linear(96, 8)).to(torch.bfloat16)
    masters = ro.fp32_masters(model)
    twin = [m.detach().clone().requires_grad_() for m in masters]
    opt = ro.AdamW8bit(masters, min_8bit_size=1024, backend="fast")
    ref = ro.AdamW8bit(twin, min_8bit_size=1024, backend="reference")
    scaler = ro.GradScaler("cpu", init_scale=2.0**6)
    for scaled in (False, False, False, True, True, True, False, False):
        before = dict(counted)
        loss = model(torch.randn(8, 128, dtype=torch.bfloat16)).float().pow(2).mean()
        (scaler.scale(loss) if scaled else loss).backward()
        inv = 1.0 / scaler.get_scale() if scaled else 1.0
        for t, q in zip(twin, model.parameters(), strict=True):
            t.grad = q.grad.float() * inv  # (a power of two: exact)
        if scaled:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        ref.step()
        opt.zero_grad(), ref.zero_grad()
        for m, t, q in zip(masters, twin, model.parameters(), strict=True):
            assert_bits_equal(m, t, "master")
            assert_bits_equal(q, t.detach().to(torch.bfloat16), "partner")
        if counted["rebind"] > before["rebind"]:
            assert counted["prepare_staged"] == before["prepare_staged"], counted
    assert counted["rebind"] >= 3 * 2, counted  # steps 3, 5 and 8 replayed (two passes each)
