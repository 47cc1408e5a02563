"""Training with fp32 masters paired with bfloat16/float16 model parameters
(``roundpipe/optim/masters.py``), bit for bit the composition ``master.grad =
partner.grad.float(); opt.step(); partner.copy_(master)`` written out (``tests/masters/_runs.py``):
with ``torch.optim`` (``foreach=False``) on the engines that claim torch's for-loop bit for bit
(``reference``, ``fast:torch``, ``fast:numba``), with roundpipe itself unpaired on
``fast:numexpr`` (not bit for bit torch, but bit for bit its own composition). Covered:

* training (AdamW, SGD with momentum; bfloat16 and float16), and a mixed model: an fp32
  parameter that is its own master, a master with its own gradient (its partner still
  written), a partner without a gradient on some steps (not stepped, partner left alone);
* ``state_dict`` (equal to the composition's, interchangeable with torch.optim's both ways),
  ``add_param_group``, ``StepLR``, a closure, ``zero_grad`` (both ways);
* every optimizer with its default hyperparameters on the numba engine, a smoke grid (the full
  option grid is ``conformance/test_masters.py``).

What the step refuses, and the mutations between steps it must see:
``tests/plan/test_partner_checks.py``.
"""

from __future__ import annotations

import pytest
import torch

import roundpipe.optim
from roundpipe.optim.masters import partner_of
from tests._util import OPTIMIZER_NAMES, assert_bits_equal, bits_equal, roundtrip
from tests.masters._runs import (
    DTYPE_IDS,
    DTYPES,
    ENGINES,
    EXACT,
    EXTRA,
    N_PLAIN,
    OWN,
    SCALE,
    STEPS,
    TRAINERS,
    Composed,
    Paired,
    assert_partners_rounded,
    assert_same,
    assert_state_dicts_bits,
    loss_of,
)


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
        assert_same(run, ref)
        assert_partners_rounded(run)
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
    assert_same(run, ref)


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
        assert_same(run, ref)
        # the own-gradient master's partner is written all the same
        assert_partners_rounded(run, [OWN])
        if k % 2:
            assert extra_q.data_ptr() == kept_ptr
            assert_bits_equal(extra_q.detach(), kept, "the partner of a master not stepped")
            assert_bits_equal(extra_m.detach(), master_before, "a master not stepped")
            for key, v in run.opt.state[extra_m].items():
                assert_bits_equal(v, state_before[key], f"state {key!r} of a master not stepped")
        else:
            assert_partners_rounded(run, [EXTRA])
    if name == "AdamW":
        assert run.opt.state[extra_m]["step"].item() == 3  # steps 0, 2, 4
        assert run.opt.state[run.masters[0]]["step"].item() == STEPS


@pytest.mark.parametrize("engine", ENGINES)
def test_state_dict_equals_composition_and_loads_both_ways(engine):
    kwargs = dict(lr=1e-2, weight_decay=0.1, amsgrad=True)
    run = Paired(torch.bfloat16, "AdamW", engine, kwargs)
    ref = Composed(torch.bfloat16, "AdamW", engine, kwargs, kind="unpaired")
    for k in range(3):
        run.step(k)
        ref.step(k)
    sd = run.opt.state_dict()
    assert_state_dicts_bits(sd, ref.opt.state_dict())
    assert sorted(sd["state"]) == list(range(N_PLAIN))
    assert sd["param_groups"][0]["params"] == list(range(N_PLAIN))
    # the state is the masters' (float32), never the partners' dtype
    for st in sd["state"].values():
        assert all(v.dtype == torch.float32 for v in st.values())

    # into torch.optim.AdamW (over the composition's masters, equal to ours) and back
    theirs = torch.optim.AdamW(ref.masters, foreach=False, **kwargs)
    theirs.load_state_dict(roundtrip(sd))
    assert_state_dicts_bits(theirs.state_dict(), sd, ignore=("foreach",))
    ours = roundpipe.optim.AdamW(run.masters, backend=engine, **kwargs)
    # (through a checkpoint: a loaded state_dict shares torch's state tensors, which it steps too)
    ours.load_state_dict(roundtrip(theirs.state_dict()))
    assert_state_dicts_bits(ours.state_dict(), sd, ignore=("foreach",))
    run.opt = ours
    if engine in EXACT:
        ref.opt = theirs
    else:
        ref.opt = _loaded_unpaired(ref.masters, engine, kwargs, roundtrip(theirs.state_dict()))
    for k in range(3, 5):
        run.step(k)
        ref.step(k)
        assert_same(run, ref)
        assert_partners_rounded(run)


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
        assert_same(run, ref)
        if k < 2:  # not in the optimizer yet: not stepped, not written, no state
            for i in range(2, N_PLAIN):
                assert_bits_equal(run.partners[i].detach(), start[i], f"partner {i} outside the optimizer")
                assert run.masters[i] not in run.opt.state
        else:
            assert_partners_rounded(run)
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
            loss = loss_of(run.model, k)
            loss.backward()
            return loss

        def closure_ref(k=k):
            ref.model.zero_grad()
            ref.opt.zero_grad()
            loss = loss_of(ref.model, k)
            loss.backward()
            for m, q in zip(ref.masters, ref.partners, strict=True):
                m.grad = q.grad.float()
            return loss

        with torch.no_grad():  # torch's step runs the closure with grad enabled
            loss_run = run.opt.step(closure_run)
        loss_ref = ref.opt.step(closure_ref)
        ref.write_partners()
        assert_bits_equal(loss_run.detach(), loss_ref.detach(), "the closure's loss")
        assert_same(run, ref)


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
        assert_same(run, ref)
    # two backwards without a zero_grad in between: the step reads the sum
    for r in (run, ref):
        r.opt.zero_grad(set_to_none=False)
        if r is ref:
            r.model.zero_grad(set_to_none=False)
        loss_of(r.model, 10).backward()
        loss_of(r.model, 11).backward()
    for m, q in zip(ref.masters, ref.partners, strict=True):
        m.grad = q.grad.float()
    run.opt.step()
    ref.opt.step()
    ref.write_partners()
    assert_same(run, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_optimizer_numba(name, dtype):
    kwargs = dict(lr=1e-2)
    run = Paired(dtype, name, "fast:numba", kwargs)
    ref = Composed(dtype, name, "fast:numba", kwargs, kind="unpaired")
    for k in range(3):
        run.step(k)
        ref.step(k)
        assert_same(run, ref)
        assert_partners_rounded(run)
