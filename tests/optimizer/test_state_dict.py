"""``state_dict`` and checkpoints: round trips roundpipe <-> torch.optim and between backends,
a torch.optim state dict (foreach or fused) continued by roundpipe, ``torch.load(weights_only=
True)`` checkpoints handed over in every direction, pickling and deepcopy (the backend kept).
"""

from __future__ import annotations

import copy
import pickle

import pytest

from tests._against_torch import rp_opt, save_load, torch_opt
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
    torch_class,
)

# ---------------------------------------------------------------------------------------------
# round trips between roundpipe, torch.optim and backends; pickling and deepcopy


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


# ---------------------------------------------------------------------------------------------
# checkpoints through torch.load(weights_only=True)


# (saved by, loaded into): "torch" is torch.optim (foreach=False)
HANDOVERS = [
    ("torch", "fast"),
    ("torch", "reference"),
    ("fast", "torch"),
    ("reference", "torch"),
    ("fast", "reference"),
    ("reference", "fast"),
]


def _make(kind, name, params):
    return torch_opt(name, groups(params)) if kind == "torch" else rp_opt(name, groups(params), kind)


@pytest.mark.parametrize("src, dst", HANDOVERS, ids=[f"{s}-to-{d}" for s, d in HANDOVERS])
def test_weights_only_checkpoint_continues_like_torch(name, src, dst):
    """Three steps on ``src``, torch.save of its state_dict, torch.load(weights_only=True)
    into ``dst`` over a copy of the parameters; the next five steps equal those of an
    uninterrupted torch.optim run, compared after every step."""
    straight = make_params()
    ref = torch_opt(name, groups(straight))
    params = clone_params(straight)
    first = _make(src, name, params)
    run_steps(first, params, range(3))
    run_steps(ref, straight, range(3))
    loaded = save_load(first.state_dict())
    params = clone_params(params)
    second = _make(dst, name, params)
    second.load_state_dict(loaded)
    if dst != "torch":
        assert second.backend == dst
    for k in range(3, 8):
        run_steps(second, params, [k])
        run_steps(ref, straight, [k])
        assert_params_close(params, straight)
    assert_state_dicts_close(second.state_dict(), ref.state_dict())
