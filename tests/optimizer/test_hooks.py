"""Optimizer hooks (``_hooked_step`` in ``roundpipe/optim/optimizer.py``): step pre- and post-hooks,
per optimizer and global, fire once per step, in torch's order, and may modify the arguments
and the parameters as they can with torch (also around a failing step); ``state_dict`` and
``load_state_dict`` hooks run and may modify what they see as with torch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests._against_torch import ERRORS, rp_opt, save_load, torch_opt
from tests._util import (
    RICH_KWARGS,
    assert_params_close,
    assert_state_dicts_close,
    clone_params,
    groups,
    make_params,
    rp_class,
    run_steps,
    set_grads,
    torch_class,
)


def _rp(name, params, backend="fast", **extra):
    return rp_class(name)(groups(params), backend=backend, **{**RICH_KWARGS[name], **extra})


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
# hooks that modify, as torch's do


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


HOOK_NAMES = ["Adam", "SGD", "ASGD"]


def _hooked_run(opt, params):
    """Step hooks that modify: the pre hook halves every grad, lowers lr in the second group
    and passes a closure the caller did not; the post hook clamps the parameters."""
    events = []
    losses = []

    def closure():
        events.append("closure")
        return torch.tensor(float(len(events)))

    def pre(o, args, kwargs):
        events.append("pre")
        for p in params:
            p.grad.mul_(0.5)
        o.param_groups[1]["lr"] = o.param_groups[1]["lr"] * 0.9
        return args, {"closure": closure}

    def post(o, args, kwargs):
        events.append("post")
        assert kwargs == {"closure": closure}, kwargs
        for p in params:
            if not p.is_complex():
                p.detach().clamp_(-0.4, 0.4)

    h_pre = opt.register_step_pre_hook(pre)
    h_post = opt.register_step_post_hook(post)
    for k in range(3):
        set_grads(params, k)
        losses.append(opt.step())
    h_pre.remove()
    h_post.remove()
    set_grads(params, 3)
    losses.append(opt.step())
    return events, losses


@pytest.mark.parametrize("opt_name", HOOK_NAMES)
def test_step_hooks_can_modify_like_torch(opt_name, backend):
    params, tparams = make_params(), make_params()
    ours = _hooked_run(rp_opt(opt_name, groups(params), backend), params)
    theirs = _hooked_run(torch_opt(opt_name, groups(tparams)), tparams)
    assert ours == theirs
    assert ours[0] == ["pre", "closure", "post"] * 3
    assert_params_close(params, tparams)


@pytest.mark.parametrize("opt_name", HOOK_NAMES)
def test_step_hooks_on_a_failing_step_like_torch(opt_name, backend):
    """A step that raises (a gradient of the wrong shape, which torch rejects too): the pre
    hook has fired, the post hook does not, as in torch."""
    results = []
    for make in (lambda g: rp_opt(opt_name, g, backend), lambda g: torch_opt(opt_name, g)):
        params = make_params()
        opt = make(groups(params))
        events = []
        opt.register_step_pre_hook(lambda o, a, k, events=events: events.append("pre"))
        opt.register_step_post_hook(lambda o, a, k, events=events: events.append("post"))
        set_grads(params, 0)
        params[0].grad.data = _randn(5)  # past autograd's shape check
        with pytest.raises(ERRORS):
            opt.step()
        results.append(events)
    assert results[0] == results[1] == ["pre"]


def _state_dict_hook_run(opt, params, other):
    """state_dict and load_state_dict hooks that modify, with prepend; returns what they saw
    and produced."""
    events = []

    def sd_pre(o):
        events.append("sd_pre")
        o.param_groups[0]["lr"] = 0.004  # a pre hook may change the optimizer itself

    def sd_post(o, sd):
        events.append("sd_post")
        sd = dict(sd)
        sd["extra"] = torch.tensor([1.0, 2.0])
        return sd

    def sd_post_first(o, sd):
        events.append("sd_post_first")

    def load_pre(o, sd):
        events.append("load_pre")
        assert "extra" in sd
        sd = copy.deepcopy(sd)
        del sd["extra"]
        sd["param_groups"][1]["lr"] = 0.0123
        return sd

    def load_post(o):
        events.append("load_post")
        o.param_groups[0]["lr"] = o.param_groups[0]["lr"] * 2

    opt.register_state_dict_pre_hook(sd_pre)
    opt.register_state_dict_post_hook(sd_post)
    opt.register_state_dict_post_hook(sd_post_first, prepend=True)
    other.register_load_state_dict_pre_hook(load_pre)
    other.register_load_state_dict_post_hook(load_post)
    run_steps(opt, params, range(2))
    sd = save_load(opt.state_dict())
    other.load_state_dict(sd)
    return events, sd, other


@pytest.mark.parametrize("opt_name", HOOK_NAMES)
def test_state_dict_hooks_can_modify_like_torch(opt_name, backend):
    out = {}
    for kind in ("ours", "theirs"):
        params = make_params()
        other_params = clone_params(params)
        if kind == "ours":
            opt, other = (
                rp_opt(opt_name, groups(params), backend),
                rp_opt(opt_name, groups(other_params), backend),
            )
        else:
            opt, other = torch_opt(opt_name, groups(params)), torch_opt(opt_name, groups(other_params))
        events, sd, other = _state_dict_hook_run(opt, params, other)
        other_params = [p for g in other.param_groups for p in g["params"]]
        for p, q in zip(other_params, params, strict=True):
            p.data.copy_(q.data)
        run_steps(other, other_params, range(2, 4))
        out[kind] = (events, sd, other, other_params)
    ours, theirs = out["ours"], out["theirs"]
    assert ours[0] == theirs[0] == ["sd_pre", "sd_post_first", "sd_post", "load_pre", "load_post"]
    torch.testing.assert_close(ours[1]["extra"], theirs[1]["extra"])
    assert (
        [g["lr"] for g in ours[2].param_groups]
        == [g["lr"] for g in theirs[2].param_groups]
        == [0.008, 0.0123]
    )
    assert ours[2].backend == backend
    assert_params_close(ours[3], theirs[3])
    assert_state_dicts_close(ours[2].state_dict(), theirs[2].state_dict())
