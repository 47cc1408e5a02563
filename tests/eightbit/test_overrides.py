"""roundpipe's ``GlobalOptimManager`` without bitsandbytes (``conformance/test_eightbit_overrides.py``
holds both managers against bitsandbytes' step): its API, and what a config means, checked
against what it must equal here: a parameter in 32-bit state by its size, or in a param group
of its own with the overridden hyperparameters."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import roundpipe.optim as ro
from roundpipe.optim.overrides import managers


@pytest.fixture(autouse=True)
def _empty_managers():
    for manager in managers():
        manager.initialize()
    yield
    for manager in managers():
        manager.initialize()


def _manager():
    return ro.GlobalOptimManager.get_instance()


def _twins(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=gen) for s in shapes]
    return [t.clone().requires_grad_() for t in start], [t.clone().requires_grad_() for t in start]


def _lockstep(pairs, steps, seed=1, between=None):
    """Step each ``(optimizer, params)`` with the same gradients; ``between(step)`` before each."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if between is not None:
            between(step)
        grads = [torch.randn(p.shape, generator=gen) for p in pairs[0][1]]
        for opt, params in pairs:
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()


def _assert_same(opt_a, params_a, opt_b, params_b):
    for p, q in zip(params_a, params_b, strict=True):
        assert torch.equal(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key, value in opt_b.state[q].items():
            mine = opt_a.state[p][key]
            assert torch.equal(mine, value) if torch.is_tensor(value) else mine == value, key


def test_the_manager_is_one_per_process():
    with pytest.raises(RuntimeError, match="Call get_instance"):
        ro.GlobalOptimManager()
    assert ro.GlobalOptimManager.get_instance() is ro.GlobalOptimManager.get_instance()


def test_a_module_override_keeps_an_embedding_in_32_bits():
    """``optim_bits=32`` for an embedding's weight (HF Trainer's override): its state is what a
    parameter too small for 8 bits keeps, bit for bit; the other weights stay 8-bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(300, 32), nn.Linear(32, 200))
    twin = copy.deepcopy(model)
    _manager().register_module_override(model[0], "weight", {"optim_bits": 32})
    ours = ro.AdamW8bit(model.parameters())
    by_size = ro.AdamW8bit(
        [{"params": [twin[0].weight], "min_8bit_size": 10**9}, {"params": list(twin[1].parameters())}]
    )
    params, twin_params = list(model.parameters()), list(twin.parameters())
    _lockstep([(ours, params), (by_size, twin_params)], 4)
    _assert_same(ours, params, by_size, twin_params)
    assert ours.state[model[0].weight]["state1"].dtype == torch.float32
    assert ours.state[model[1].weight]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit", "SGD8bit", "AdEMAMix8bit"])
def test_a_hyperparameter_override_is_a_param_group_of_its_own(name):
    """A parameter's overridden hyperparameters step it as a param group with those values would,
    changed between steps too; keys the step does not apply (``skip_zeros``, unknown ones)
    change nothing."""
    spec = getattr(ro, name).spec
    kwargs = dict(spec.rich_kwargs)
    betas = dict(AdEMAMix8bit=(0.8, 0.95, 0.99), SGD8bit=(0.5, 0.0)).get(name, (0.8, 0.95))
    config = {"lr": 3e-3, "betas": betas, "weight_decay": 0.2, "skip_zeros": True, "not_a_key": 1}
    ours_params, group_params = _twins([(5000,), (300,), (40, 130)])
    _manager().override_config(ours_params[0], key_value_dict=dict(config))
    _manager().override_config(ours_params[1], "eps", 1e-3)
    ours = getattr(ro, name)(ours_params, **kwargs)
    own = {k: v for k, v in config.items() if k in ("lr", "betas", "weight_decay")}
    groups = [dict(params=group_params[:1], **own), dict(params=group_params[1:2], eps=1e-3)]
    as_groups = getattr(ro, name)([*groups, dict(params=group_params[2:])], **kwargs)

    def later(step):
        if step == 2:
            _manager().override_config(ours_params[0], "lr", 1e-4)
            as_groups.param_groups[0]["lr"] = 1e-4

    _lockstep([(ours, ours_params), (as_groups, group_params)], 5, between=later)
    _assert_same(ours, ours_params, as_groups, group_params)


def test_bits_are_read_where_the_state_is_created_only():
    """``optim_bits=32`` registered after a parameter's state exists leaves it 8-bit (as
    bitsandbytes: its config's bits are read by ``init_state``)."""
    p = torch.randn(5000, requires_grad=True)
    opt = ro.AdamW8bit([p])
    p.grad = torch.randn(5000)
    opt.step()
    _manager().override_config(p, "optim_bits", 32)
    opt.step()
    assert opt.state[p]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_reads_the_config(how):
    model = nn.Embedding(300, 32)
    opt = ro.AdamW8bit(model.parameters())
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    (p,) = twin.param_groups[0]["params"]
    _manager().override_config(p, "optim_bits", 32)
    p.grad = torch.randn_like(p)
    twin.step()
    assert twin.state[p]["state1"].dtype == torch.float32
    assert twin.param_groups[0]["min_8bit_size"] == 4096 and twin.min_8bit_size == 4096


def test_an_unsupported_config_raises_before_anything_moves():
    p = torch.randn(5000, requires_grad=True)
    _manager().override_config(p, "optim_bits", 4)
    opt = ro.AdamW8bit([p])
    p.grad = torch.randn(5000)
    before = p.detach().clone()
    with pytest.raises(NotImplementedError, match="Amount of optimizer bits not supported: 4"):
        opt.step()
    assert not opt.state and torch.equal(p.detach(), before)
