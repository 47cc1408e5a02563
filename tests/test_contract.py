"""The tensor contract: only dense, contiguous float32/complex64 CPU parameters, gradients and
state. Anything else raises TypeError/ValueError/RuntimeError naming the parameter
(``param_groups[g]['params'][i]``) before *anything* is modified: no parameter, gradient or
state tensor changes, and no state is created or advanced (``step``), in any group.

Each case corrupts a parameter that is not the first of its group, after two good steps (so
state exists), while another group holds a parameter about to take its first step.
"""

import re

import pytest
import torch

from tests._util import (
    RICH_KWARGS,
    TOL,
    assert_params_close,
    assert_unchanged,
    rp_class,
    set_grads,
    snapshot,
    torch_class,
)

ERRORS = (TypeError, ValueError, RuntimeError)


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _setup(name, backend):
    """group 0: [fresh, a]; group 1: [b, target, c (complex64)]; two steps without a grad
    for ``fresh``, so that it has no state yet (Adagrad creates it in __init__)."""
    fresh = torch.nn.Parameter(_randn(4, seed=1))
    a = torch.nn.Parameter(_randn(3, 4, seed=2))
    b = torch.nn.Parameter(_randn(5, seed=3))
    target = torch.nn.Parameter(_randn(3, 4, seed=4))
    c = torch.nn.Parameter(_randn(2, 3, dtype=torch.complex64, seed=5))
    opt = rp_class(name)(
        [{"params": [fresh, a]}, {"params": [b, target, c], "lr": 0.003}],
        backend=backend,
        **RICH_KWARGS[name],
    )
    stepped = [a, b, target, c]
    for k in range(2):
        set_grads(stepped, k)
        opt.step()
    set_grads([fresh, a, b, target, c], 2)
    return opt, target


def _set_data(p, t):
    p.data = t


def _state_key(opt, p):
    keys = [k for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert keys, "no parameter-shaped state to corrupt"
    return keys[0]


def _corrupt_state(opt, p, make):
    k = _state_key(opt, p)
    opt.state[p][k] = make(opt.state[p][k])


CASES = {
    # parameter dtype (with a grad of the same dtype, so the parameter itself is the problem)
    "float64": lambda opt, p: (_set_data(p, p.data.double()), setattr(p.grad, "data", p.grad.data.double())),
    "float16": lambda opt, p: (_set_data(p, p.data.half()), setattr(p.grad, "data", p.grad.data.half())),
    "bfloat16": lambda opt, p: (
        _set_data(p, p.data.bfloat16()),
        setattr(p.grad, "data", p.grad.data.bfloat16()),
    ),
    "complex128": lambda opt, p: (
        _set_data(p, _randn(3, 4, dtype=torch.complex128)),
        setattr(p.grad, "data", _randn(3, 4, dtype=torch.complex128)),
    ),
    # layout of the parameter
    "param non-contiguous": lambda opt, p: _set_data(p, _randn(4, 3, seed=9).t()),
    # the gradient
    "grad non-contiguous": lambda opt, p: setattr(p, "grad", _randn(4, 3, seed=9).t()),
    "grad expanded": lambda opt, p: setattr(p, "grad", _randn(1, 4, seed=9).expand(3, 4)),
    "grad sparse": lambda opt, p: setattr(p, "grad", _randn(3, 4, seed=9).to_sparse()),
    "grad float64": lambda opt, p: setattr(p.grad, "data", _randn(3, 4, dtype=torch.float64)),
    "grad float16": lambda opt, p: setattr(p.grad, "data", _randn(3, 4).half()),
    "grad shape (12,)": lambda opt, p: setattr(p.grad, "data", _randn(12)),
    "grad shape (4, 3)": lambda opt, p: setattr(p.grad, "data", _randn(4, 3)),
    "grad shape (5,)": lambda opt, p: setattr(p.grad, "data", _randn(5)),
    # state tensors (e.g. from a hand-edited or foreign state_dict)
    "state non-contiguous": lambda opt, p: _corrupt_state(opt, p, lambda t: t.t().contiguous().t()),
    "state float64": lambda opt, p: _corrupt_state(opt, p, lambda t: t.double()),
    "state wrong shape": lambda opt, p: _corrupt_state(opt, p, lambda t: t.reshape(-1).clone()),
}


def _location(g, i):
    return re.escape(f"param_groups[{g}]['params'][{i}]")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_tensor_raises_before_modifying_anything(name, backend, case):
    opt, target = _setup(name, backend)
    CASES[case](opt, target)
    snap = snapshot(opt)
    with pytest.raises(ERRORS, match=_location(1, 1)):
        opt.step()
    assert_unchanged(opt, snap)


def test_meta_parameter_raises_before_modifying_anything(name, backend):
    opt, target = _setup(name, backend)
    good = torch.nn.Parameter(_randn(3, seed=11))
    meta = torch.nn.Parameter(torch.empty(3, 4, device="meta"))
    good.grad = _randn(3, seed=12)
    meta.grad = torch.empty(3, 4, device="meta")
    opt.add_param_group({"params": [good, meta]})
    snap = snapshot(opt)
    with pytest.raises(ERRORS, match=_location(2, 1)):
        opt.step()
    assert_unchanged(opt, snap)


def test_optimizer_still_works_after_an_error(name, backend):
    """After a rejected step and a fix, stepping continues as if the bad step never happened."""
    opt, target = _setup(name, backend)
    twin_opt, twin_target = _setup(name, backend)
    good_grad = target.grad
    target.grad = _randn(4, 3, seed=9).t()
    with pytest.raises(ERRORS):
        opt.step()
    target.grad = good_grad
    opt.step()
    twin_opt.step()
    flat = [p for g in opt.param_groups for p in g["params"]]
    twin = [p for g in twin_opt.param_groups for p in g["params"]]
    assert_params_close(flat, twin, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(3,), (2, 5), (0,)])
def test_complex64_matches_torch(name, backend, shape):
    params = [torch.nn.Parameter(_randn(*shape, dtype=torch.complex64, seed=s)) for s in (1, 2)]
    tparams = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = rp_class(name)(params, backend=backend, **RICH_KWARGS[name])
    ref = torch_class(name)(tparams, **RICH_KWARGS[name])
    for k in range(7):
        set_grads(params, k)
        set_grads(tparams, k)
        opt.step()
        ref.step()
    assert_params_close(params, tparams, **TOL)
    for p, q in zip(params, tparams, strict=True):
        for key, v in ref.state[q].items():
            if isinstance(v, torch.Tensor):
                assert opt.state[p][key].dtype == v.dtype, key
                torch.testing.assert_close(opt.state[p][key], v, **TOL)


def test_empty_parameter(name, backend):
    """A zero-element parameter steps (its step count advances) as in torch."""
    p, q = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(0))
    opt = rp_class(name)([p], backend=backend, **RICH_KWARGS[name])
    ref = torch_class(name)([q], **RICH_KWARGS[name])
    for _ in range(2):
        p.grad, q.grad = torch.zeros(0), torch.zeros(0)
        opt.step()
        ref.step()
    assert sorted(opt.state[p]) == sorted(ref.state[q])
    for k, v in ref.state[q].items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(opt.state[p][k], v)
