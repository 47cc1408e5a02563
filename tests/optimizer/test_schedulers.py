"""LR schedulers and hyperparameters changed between steps: StepLR, OneCycleLR (its default
schedule and its momentum error), a tensor lr, every scheduler torch ships driving a roundpipe
optimizer as it drives torch's, and ``lr`` changed in the groups after construction (the same
outcome as torch's).
"""

from __future__ import annotations

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from tests._against_torch import ERRORS, nonfinite_mismatch, outcome, rp_opt, torch_opt
from tests._util import (
    BACKENDS,
    RICH_KWARGS,
    assert_params_close,
    assert_unchanged,
    clone_params,
    groups,
    make_params,
    rp_class,
    run_steps,
    set_grads,
    snapshot,
    torch_class,
)


def _rp(name, params, backend="fast", **extra):
    return rp_class(name)(groups(params), backend=backend, **{**RICH_KWARGS[name], **extra})


def _torch(name, params, **extra):
    return torch_class(name)(groups(params), **{**RICH_KWARGS[name], **extra})


def _has_momentum(name):
    d = torch_class(name)([torch.nn.Parameter(torch.zeros(1))]).defaults
    return "momentum" in d or "betas" in d


def _group_values(opt):
    return [(g["lr"], g.get("betas"), g.get("momentum")) for g in opt.param_groups]


def _run_with_scheduler(opt, params, make_scheduler, steps):
    sched = make_scheduler(opt)
    trace = []
    for k in range(steps):
        set_grads(params, k)
        opt.step()
        sched.step()
        trace.append(_group_values(opt))
    return trace


def test_step_lr(name, backend):
    params = make_params()
    tparams = clone_params(params)

    def make(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    ours = _run_with_scheduler(_rp(name, params, backend), params, make, 6)
    theirs = _run_with_scheduler(_torch(name, tparams), tparams, make, 6)
    assert ours == theirs
    assert ours[-1][0][0] == pytest.approx(RICH_KWARGS[name]["lr"] * 0.125)
    assert_params_close(params, tparams)


def test_one_cycle_lr(name, backend):
    """OneCycleLR cycles lr, and momentum or beta1 where the optimizer has them."""
    params = make_params()
    tparams = clone_params(params)
    cycle = _has_momentum(name)

    def make(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8, cycle_momentum=cycle)

    ours = _run_with_scheduler(_rp(name, params, backend), params, make, 7)
    theirs = _run_with_scheduler(_torch(name, tparams), tparams, make, 7)
    assert ours == theirs
    lrs = [t[0][0] for t in ours]
    assert len(set(lrs)) == len(lrs), "lr did not change every step"
    if cycle:
        moms = [t[0][1][0] if t[0][1] is not None else t[0][2] for t in ours]
        assert len(set(moms)) > 3, "momentum/beta1 was not cycled"
    assert_params_close(params, tparams)


@pytest.mark.parametrize("name", ["Adadelta", "Adagrad", "ASGD", "Rprop"])
def test_one_cycle_lr_momentum_error_matches_torch(name):
    """Without momentum or betas, cycle_momentum=True fails as it does with torch."""
    assert not _has_momentum(name)
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError) as theirs:
        torch.optim.lr_scheduler.OneCycleLR(torch_class(name)([p]), max_lr=0.1, total_steps=4)
    with pytest.raises(ValueError) as ours:
        torch.optim.lr_scheduler.OneCycleLR(rp_class(name)([p]), max_lr=0.1, total_steps=4)
    assert str(ours.value) == str(theirs.value)


def test_tensor_lr_with_scheduler(name, backend):
    params = make_params()
    tparams = clone_params(params)
    ours = rp_class(name)(groups(params, torch.tensor(0.003)), backend=backend, lr=torch.tensor(0.01))
    theirs = torch_class(name)(groups(tparams, torch.tensor(0.003)), lr=torch.tensor(0.01))
    for opt, ps in ((ours, params), (theirs, tparams)):
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)
        for k in range(4):
            set_grads(ps, k)
            opt.step()
            sched.step()
    assert_params_close(params, tparams)


# ---------------------------------------------------------------------------------------------
# hyperparameters changed after construction


GROUP_LRS = {
    "2-element tensor": lambda: torch.tensor([0.01, 0.02]),
    "1-element 1-d tensor": lambda: torch.tensor([0.01]),
    "negative 0-d tensor": lambda: torch.tensor(-0.01),
    "float64 0-d tensor": lambda: torch.tensor(0.02, dtype=torch.float64),
    "nan": lambda: float("nan"),
}


@pytest.mark.parametrize("case", list(GROUP_LRS))
def test_lr_changed_after_construction(name, backend, case):
    """An lr put into a group after construction (by hand or by a scheduler), in the second of
    two groups: where torch steps, roundpipe steps alike (NaN where torch has NaN); where torch
    fails, roundpipe fails too, and modifies nothing (torch has stepped the first group by
    then; roundpipe promises to check everything first)."""
    if case == "1-element 1-d tensor" and not hasattr(torch_optimizer, "_to_scalar"):
        pytest.skip(
            "torch < 2.8 does not squeeze a one-element lr: most of its for-loops raise on it, where "
            "roundpipe steps as newer torch does (declared in docs/torch-versions.md)"
        )
    params, tparams = make_params(), make_params()
    ours, theirs = rp_opt(name, groups(params), backend), torch_opt(name, groups(tparams))
    run_steps(ours, params, range(2))
    run_steps(theirs, tparams, range(2))
    ours.param_groups[1]["lr"] = GROUP_LRS[case]()
    theirs.param_groups[1]["lr"] = GROUP_LRS[case]()
    for k in range(2, 4):
        set_grads(params, k)
        set_grads(tparams, k)
        snap = snapshot(ours)
        theirs_step, ours_step = outcome(theirs.step), outcome(ours.step)
        if theirs_step[0] == "ok":
            assert ours_step[0] == "ok", f"torch steps, roundpipe raised {ours_step[1]!r}"
            for i, (p, q) in enumerate(zip(params, tparams, strict=True)):
                assert nonfinite_mismatch(p, q) is None, (i, nonfinite_mismatch(p, q))
            continue
        assert ours_step[0] == "error", f"torch raised {theirs_step[1]!r}, roundpipe stepped"
        assert isinstance(ours_step[1], ERRORS)
        assert_unchanged(ours, snap)
        break


# ---------------------------------------------------------------------------------------------
# every scheduler


def _momentum_key(opt):
    d = opt.defaults
    return "betas" if "betas" in d else "momentum" if "momentum" in d else None


def _cyclic(opt):
    key = _momentum_key(opt)
    return torch.optim.lr_scheduler.CyclicLR(
        opt,
        base_lr=0.001,
        max_lr=0.02,
        step_size_up=2,
        mode="triangular2",
        cycle_momentum=key is not None,
        base_momentum=0.8,
        max_momentum=0.95,
    )


def _one_cycle(opt):
    key = _momentum_key(opt)
    return torch.optim.lr_scheduler.OneCycleLR(
        opt,
        max_lr=[0.05, 0.01],
        total_steps=10,
        three_phase=True,
        anneal_strategy="linear",
        cycle_momentum=key is not None,
        base_momentum=0.8,
        max_momentum=0.95,
    )


SCHEDULERS = {
    "ReduceLROnPlateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt, mode="min", factor=0.5, patience=1, threshold=0.01, cooldown=1
    ),
    "CosineAnnealingWarmRestarts": lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        opt, T_0=2, T_mult=2, eta_min=1e-4
    ),
    "SequentialLR": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8),
        ],
        milestones=[3],
    ),
    "ChainedScheduler": lambda opt: torch.optim.lr_scheduler.ChainedScheduler(
        [
            torch.optim.lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=4),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
            torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 5], gamma=0.5),
        ]
    ),
    "CyclicLR": _cyclic,
    "OneCycleLR three-phase": _one_cycle,
}


# a metric for ReduceLROnPlateau that does not depend on rounding
PLATEAU_METRIC = [1.0, 0.9, 0.9, 0.9, 0.85, 0.85, 0.85, 0.85, 0.5, 0.5]


def _hyper(opt):
    return [(g["lr"], g.get("betas"), g.get("momentum")) for g in opt.param_groups]


def _scheduled_run(opt, params, scheduler_name, steps):
    sched = SCHEDULERS[scheduler_name](opt)
    trace = []
    for k in range(steps):
        set_grads(params, k)
        opt.step()
        if scheduler_name == "ReduceLROnPlateau":
            sched.step(PLATEAU_METRIC[k])
        else:
            sched.step()
        trace.append((_hyper(opt), [p.detach().clone() for p in params]))
    return trace


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("rp_backend", BACKENDS)
def test_scheduler_drives_roundpipe_like_torch(name, rp_backend, scheduler):
    """lr (and momentum/betas where the scheduler cycles them) equal after every step, and
    the parameters close after every step."""
    params = make_params()
    tparams = clone_params(params)
    ours = _scheduled_run(rp_opt(name, groups(params), rp_backend), params, scheduler, 9)
    theirs = _scheduled_run(torch_opt(name, groups(tparams)), tparams, scheduler, 9)
    for k, ((h_ours, p_ours), (h_theirs, p_theirs)) in enumerate(zip(ours, theirs, strict=True)):
        assert h_ours == h_theirs, (k, h_ours, h_theirs)
        assert_params_close(p_ours, p_theirs)
    lrs = {h[0][0] for h, _ in ours}
    assert len(lrs) > 2, "the scheduler did not change lr"
    if scheduler in ("CyclicLR", "OneCycleLR three-phase") and _momentum_key(
        torch_class(name)(make_params())
    ):
        moms = {h[0][1][0] if h[0][1] is not None else h[0][2] for h, _ in ours}
        assert len(moms) > 2, "momentum/beta1 was not cycled"
