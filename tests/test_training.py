"""Training-loop integration: state_dict round trips (roundpipe <-> torch.optim, fast <->
reference), LR schedulers, closures, add_param_group, zero_grad, step hooks, pickling and
deepcopy, and parameters without a gradient."""

import copy
import pickle

import pytest
import torch

from tests._util import (
    ENV_VAR,
    RICH_KWARGS,
    assert_params_close,
    assert_state_dicts_close,
    clone_params,
    groups,
    make_params,
    roundtrip,
    rp_class,
    run_steps,
    set_grads,
    torch_class,
)

# step indices of the three legs of an interrupted run (8 steps: RAdam rectifies from step 6,
# ASGD averages from step 3 with RICH_KWARGS' t0)
LEG1, LEG2, LEG3 = range(0, 3), range(3, 5), range(5, 8)


def _rp(name, params, backend="fast", **extra):
    return rp_class(name)(groups(params), backend=backend, **{**RICH_KWARGS[name], **extra})


def _torch(name, params, **extra):
    return torch_class(name)(groups(params), **{**RICH_KWARGS[name], **extra})


def _handover(src, dst_factory, params):
    """Save ``src`` (through torch.save/load) and load it into a new optimizer over fresh
    copies of ``params``; returns (optimizer, its params)."""
    new_params = clone_params(params)
    dst = dst_factory(new_params)
    dst.load_state_dict(roundtrip(src.state_dict()))
    return dst, new_params


def test_roundtrip_roundpipe_torch_roundpipe(name, backend):
    """roundpipe -> torch.optim -> roundpipe continues like an uninterrupted roundpipe run."""
    params = make_params()
    straight = clone_params(params)
    whole = _rp(name, straight, backend)
    run_steps(whole, straight, [*LEG1, *LEG2, *LEG3])

    opt = _rp(name, params, backend)
    run_steps(opt, params, LEG1)
    opt, params = _handover(opt, lambda ps: _torch(name, ps), params)
    assert type(opt) is torch_class(name)
    run_steps(opt, params, LEG2)
    opt, params = _handover(opt, lambda ps: _rp(name, ps, backend), params)
    backend_after_load = opt.backend
    run_steps(opt, params, LEG3)

    assert_params_close(params, straight)
    assert_state_dicts_close(opt.state_dict(), whole.state_dict())
    assert backend_after_load == backend, "load_state_dict changed the backend"


@pytest.mark.parametrize("first, second", [("fast", "reference"), ("reference", "fast")])
def test_roundtrip_between_backends(name, first, second):
    """first -> second -> first continues like an uninterrupted run on ``first``."""
    params = make_params()
    straight = clone_params(params)
    whole = _rp(name, straight, first)
    run_steps(whole, straight, [*LEG1, *LEG2, *LEG3])

    opt = _rp(name, params, first)
    run_steps(opt, params, LEG1)
    opt, params = _handover(opt, lambda ps: _rp(name, ps, second), params)
    backends_after_load = [opt.backend]
    run_steps(opt, params, LEG2)
    opt, params = _handover(opt, lambda ps: _rp(name, ps, first), params)
    backends_after_load.append(opt.backend)
    run_steps(opt, params, LEG3)

    assert_params_close(params, straight)
    assert_state_dicts_close(opt.state_dict(), whole.state_dict())
    assert backends_after_load == [second, first], "load_state_dict changed the backend"


def test_torch_state_dict_continues_like_torch(name, backend):
    """A torch.optim checkpoint loaded into roundpipe mid-training continues as torch does."""
    params = make_params()
    ref = _torch(name, params)
    run_steps(ref, params, LEG1)
    ours, our_params = _handover(ref, lambda ps: _rp(name, ps, backend), params)
    run_steps(ref, params, [*LEG2, *LEG3])
    run_steps(ours, our_params, [*LEG2, *LEG3])
    assert_params_close(our_params, params)
    assert_state_dicts_close(ours.state_dict(), ref.state_dict())


def test_state_dict_without_serialization(name, backend):
    """load_state_dict straight from another live optimizer (no copy) works as well."""
    params = make_params()
    src = _rp(name, params, backend)
    run_steps(src, params, LEG1)
    sd = copy.deepcopy(src.state_dict())
    dst_params = clone_params(params)
    dst = _rp(name, dst_params, backend)
    dst.load_state_dict(sd)
    run_steps(src, params, LEG2)
    run_steps(dst, dst_params, LEG2)
    assert_params_close(dst_params, params)


# ---------------------------------------------------------------------------------------------
# LR schedulers


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
# closures, add_param_group, zero_grad, hooks


def _closure_for(params, calls):
    target = [torch.full_like(p, 0.5) for p in params]

    def closure():
        calls.append(torch.is_grad_enabled())
        for p in params:
            p.grad = None
        loss = sum(((p - t).abs() ** 2).sum() for p, t in zip(params, target, strict=True))
        loss.backward()
        return loss

    return closure


def test_closure(name, backend):
    params = make_params()
    tparams = clone_params(params)
    opt, ref = _rp(name, params, backend), _torch(name, tparams)
    for _ in range(4):
        calls, tcalls = [], []
        loss = opt.step(_closure_for(params, calls))
        tloss = ref.step(_closure_for(tparams, tcalls))
        assert calls == [True], "the closure must run once, with grad enabled"
        assert isinstance(loss, torch.Tensor)
        torch.testing.assert_close(loss, tloss)
    assert_params_close(params, tparams)


def test_step_without_closure_returns_none(name, backend):
    params = make_params()
    opt = _rp(name, params, backend)
    set_grads(params, 0)
    assert opt.step() is None


def test_add_param_group_mid_training(name, backend):
    params = make_params()
    tparams = clone_params(params)
    opt, ref = _rp(name, params, backend), _torch(name, tparams)
    run_steps(opt, params, range(2))
    run_steps(ref, tparams, range(2))
    extra = [torch.nn.Parameter(torch.linspace(-1, 1, 7)), torch.nn.Parameter(torch.ones(2, 2))]
    textra = clone_params(extra)
    opt.add_param_group({"params": extra, "lr": 0.02})
    ref.add_param_group({"params": textra, "lr": 0.02})
    run_steps(opt, params + extra, range(2, 6))
    run_steps(ref, tparams + textra, range(2, 6))
    assert_params_close(params + extra, tparams + textra)
    assert_state_dicts_close(opt.state_dict(), ref.state_dict())


def test_zero_grad(name, backend):
    params = make_params()
    opt = _rp(name, params, backend)
    set_grads(params, 0)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    set_grads(params, 1)
    grads = [p.grad for p in params]
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)


def test_step_hooks_fire_once_per_step(name, backend):
    params = make_params()
    # a torch instance of the same algorithm first: torch patches step() per class
    torch_class(name)([torch.nn.Parameter(torch.zeros(1))])
    opt = _rp(name, params, backend)
    events = []

    def pre(o, args, kwargs):
        assert o is opt
        events.append(("pre", params[0].detach().clone()))

    def post(o, args, kwargs):
        assert o is opt
        events.append(("post", params[0].detach().clone()))

    h1 = opt.register_step_pre_hook(pre)
    h2 = opt.register_step_post_hook(post)
    run_steps(opt, params, range(3))
    assert [e[0] for e in events] == ["pre", "post"] * 3
    for k in range(3):
        assert not torch.equal(events[2 * k][1], events[2 * k + 1][1]), "pre hook ran after the update"
    h1.remove()
    h2.remove()
    run_steps(opt, params, range(3, 4))
    assert len(events) == 6


def test_global_step_hooks_fire_once_per_step(name, backend):
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    params = make_params()
    opt = _rp(name, params, backend)
    events = []
    h1 = register_optimizer_step_pre_hook(lambda o, a, k: events.append("pre") if o is opt else None)
    h2 = register_optimizer_step_post_hook(lambda o, a, k: events.append("post") if o is opt else None)
    try:
        run_steps(opt, params, range(2))
    finally:
        h1.remove()
        h2.remove()
    assert events == ["pre", "post"] * 2


def test_state_dict_hooks(name):
    params = make_params()
    opt = _rp(name, params)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("sd"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load"))
    opt.load_state_dict(opt.state_dict())
    assert seen == ["sd", "load"]


# ---------------------------------------------------------------------------------------------
# pickling and deepcopy


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_copies_keep_backend_and_continue_alike(name, backend, how, monkeypatch):
    params = make_params()
    opt = _rp(name, params, backend)
    run_steps(opt, params, range(2))
    # the other backend in the environment must not leak into the copy
    monkeypatch.setenv(ENV_VAR, "reference" if backend == "fast" else "fast")
    if how == "pickle":
        twin = pickle.loads(pickle.dumps(opt))
    elif how == "deepcopy":
        twin = copy.deepcopy(opt)
    else:
        twin = roundtrip(opt)
    assert type(twin) is type(opt)
    assert twin.backend == backend
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert all(a is not b for a, b in zip(twin_params, params, strict=True))
    assert_params_close(twin_params, params, rtol=0, atol=0)
    run_steps(opt, params, range(2, 5))
    run_steps(twin, twin_params, range(2, 5))
    assert_params_close(twin_params, params, rtol=0, atol=0)
    assert_state_dicts_close(twin.state_dict(), opt.state_dict(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# parameters without a gradient


def test_param_without_grad_is_skipped(name, backend):
    params = make_params()
    tparams = clone_params(params)
    opt, ref = _rp(name, params, backend), _torch(name, tparams)
    idle, tidle = params[1], tparams[1]
    before = idle.detach().clone()
    state_before = copy.deepcopy(opt.state[idle]) if idle in opt.state else {}
    for k in range(3):
        for ps in (params, tparams):
            set_grads(ps, k)
        idle.grad = tidle.grad = None
        opt.step()
        ref.step()
    assert torch.equal(idle.detach(), before)
    # no state created, nothing advanced (Adagrad's state from __init__ stays as it was)
    assert sorted(opt.state.get(idle, {})) == sorted(ref.state.get(tidle, {}))
    assert sorted(opt.state.get(idle, {})) == sorted(state_before)
    for k, v in state_before.items():
        assert torch.equal(opt.state[idle][k], v), k
    others = [p for p in params if p is not idle]
    assert all("step" not in opt.state[p] or opt.state[p]["step"].item() == 3 for p in others)
    # it joins later, one step behind... three behind the others, as in torch
    for k in range(3, 6):
        set_grads(params, k)
        set_grads(tparams, k)
        opt.step()
        ref.step()
    assert_params_close(params, tparams)
    assert_state_dicts_close(opt.state_dict(), ref.state_dict())


def test_no_grads_at_all(name, backend):
    params = make_params()
    opt = _rp(name, params, backend)
    state_before = {p: copy.deepcopy(s) for p, s in opt.state.items()}
    values = [p.detach().clone() for p in params]
    opt.step()
    assert_params_close(params, values, rtol=0, atol=0)
    assert set(opt.state) == set(state_before)


def test_large_and_small_parameters_match_torch(name, backend):
    """Parameters above the fast backend's batching threshold (stepped in place) and below it
    (batched through flat buffers), real and complex, in one group: all match torch."""
    from roundpipe.optim.backends.fast import SMALL_NUMEL

    g = torch.Generator().manual_seed(3)
    shapes = [
        ((SMALL_NUMEL + 5,), torch.float32),
        ((3, 4), torch.float32),
        ((SMALL_NUMEL // 2 + 1,), torch.complex64),
    ]
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=d)) for s, d in shapes]
    tparams = clone_params(params)
    opt = rp_class(name)(params, backend=backend, **RICH_KWARGS[name])
    ref = torch_class(name)(tparams, **RICH_KWARGS[name])
    run_steps(opt, params, range(3))
    run_steps(ref, tparams, range(3))
    assert_params_close(params, tparams)
    assert_state_dicts_close(opt.state_dict(), ref.state_dict())


@pytest.mark.parametrize("option", ["foreach", "fused"])
def test_torch_foreach_fused_checkpoint_continues_like_torch(name, backend, option):
    """A checkpoint of torch's foreach/fused implementations (the placeholders land in the
    loaded param_groups) loads and continues as torch does."""
    import inspect

    if option not in inspect.signature(torch_class(name)).parameters:
        option = "foreach"
    params = make_params()
    if option == "fused":
        params = [p for p in params if not p.is_complex()]  # torch's fused kernels are real only
    ref = torch_class(name)(params, **{**RICH_KWARGS[name], option: True})
    run_steps(ref, params, LEG1)
    our_params = clone_params(params)
    ours = rp_class(name)(our_params, backend=backend, **RICH_KWARGS[name])
    ours.load_state_dict(roundtrip(ref.state_dict()))
    run_steps(ref, params, LEG2)
    run_steps(ours, our_params, LEG2)
    assert_params_close(our_params, params)
