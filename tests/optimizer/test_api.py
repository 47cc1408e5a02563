"""API parity with torch.optim for every class: signature, defaults, subclassing,
hyperparameter errors (type and message), a tensor lr at construction (the same outcome as
torch's), and the compatibility placeholders (foreach/fused warn and are ignored, but for
fused on the optimizers whose fused kernel roundpipe models; capturable/differentiable=True
raise).
"""

import inspect
import warnings

import pytest
import torch

import roundpipe.optim
from roundpipe.optim import RoundpipeOptimizer
from tests._against_torch import outcome
from tests._util import (
    OPTIMIZER_NAMES,
    make_params,
    rp_class,
    torch_class,
)


def _param():
    return torch.nn.Parameter(torch.randn(2, 2))


def test_all_exported():
    for name in OPTIMIZER_NAMES:
        assert name in roundpipe.optim.__all__, name
        assert hasattr(roundpipe.optim, name), name


def test_subclasses(name):
    cls = rp_class(name)
    assert issubclass(cls, torch.optim.Optimizer)
    assert issubclass(cls, torch_class(name))
    assert issubclass(cls, RoundpipeOptimizer)
    assert cls.__name__ == name
    opt = cls([_param()])
    assert isinstance(opt, torch_class(name))


def test_signature(name):
    ours = list(inspect.signature(rp_class(name)).parameters.values())
    theirs = list(inspect.signature(torch_class(name)).parameters.values())
    assert ours[:-3] == theirs
    added = [(p.name, p.kind, p.default) for p in ours[-3:]]
    kw = inspect.Parameter.KEYWORD_ONLY
    assert added == [("backend", kw, None), ("state_dtype", kw, None), ("stochastic_rounding", kw, False)]


def test_docstring(name):
    assert rp_class(name).__init__.__doc__ == torch_class(name).__init__.__doc__
    assert rp_class(name).__doc__


def test_defaults(name):
    ours, theirs = rp_class(name)([_param()]), torch_class(name)([_param()])
    assert ours.defaults == theirs.defaults
    g_ours = {k: v for k, v in ours.param_groups[0].items() if k != "params"}
    g_theirs = {k: v for k, v in theirs.param_groups[0].items() if k != "params"}
    assert g_ours == g_theirs


def test_positional_arguments(name):
    """Positional hyperparameters bind as in torch (lr is always the second)."""
    ours, theirs = rp_class(name)([_param()], 0.123), torch_class(name)([_param()], 0.123)
    assert ours.defaults == theirs.defaults
    assert ours.defaults["lr"] == 0.123


def test_tensor_lr(name):
    ours = rp_class(name)([_param()], lr=torch.tensor(0.01))
    theirs = torch_class(name)([_param()], lr=torch.tensor(0.01))
    assert type(ours.defaults["lr"]) is type(theirs.defaults["lr"])


def _error_cases(name):
    """Bad constructor calls, from torch's optim_error_inputs_func_* and the checks in each
    torch.optim.X.__init__, as (params-factory, kwargs)."""
    sig = inspect.signature(torch_class(name)).parameters
    cases = [
        ("lr=-1", None, dict(lr=-1.0)),
        ("lr tensor 2 elements", None, dict(lr=torch.tensor([0.001, 0.001]))),
        ("params a tensor", "tensor", {}),
        ("param in two groups", "two_groups", {}),
        ("names mixed", "names_mixed", {}),
        ("group names mixed", "group_names_mixed", {}),
        ("unexpected kwarg", None, dict(not_an_option=1)),
    ]
    if "eps" in sig:
        cases.append(("eps=-1", None, dict(eps=-1.0)))
    if "weight_decay" in sig:
        cases.append(("weight_decay=-1", None, dict(weight_decay=-1.0)))
        cases.append(("weight_decay=-0.5", None, dict(weight_decay=-0.5)))
    if "betas" in sig:
        cases += [
            ("beta1=1.0", None, dict(lr=1e-2, betas=(1.0, 0.0))),
            ("beta2=1.0", None, dict(lr=1e-2, betas=(0.0, 1.0))),
            ("beta1<0", None, dict(betas=(-0.1, 0.9))),
        ]
    if name in ("Adam", "AdamW"):
        cases += [
            ("betas mixed 1", None, dict(lr=1e-2, betas=(0.9, torch.tensor(0.99)))),
            ("betas mixed 2", None, dict(lr=1e-2, betas=(torch.tensor(0.9), 0.99))),
        ]
    if "momentum" in sig:
        cases += [("momentum<0", None, dict(lr=1e-2, momentum=-0.5))]
    if name == "SGD":
        cases += [
            ("nesterov without momentum", None, dict(nesterov=True)),
            ("nesterov with dampening", None, dict(momentum=0.9, dampening=0.5, nesterov=True)),
        ]
    if name == "Adadelta":
        cases += [("rho=1.1", None, dict(lr=1e-2, rho=1.1)), ("rho<0", None, dict(rho=-0.1))]
    if name == "Adagrad":
        cases += [
            ("lr_decay<0", None, dict(lr=1e-2, lr_decay=-0.5)),
            ("initial_accumulator_value<0", None, dict(initial_accumulator_value=-1.0)),
        ]
    if name == "NAdam":
        cases += [("momentum_decay<0", None, dict(lr=1e-2, momentum_decay=-0.2))]
    if name == "RMSprop":
        cases += [("alpha<0", None, dict(alpha=-1.0))]
    if name == "Rprop":
        cases += [("etas", None, dict(lr=1e-2, etas=(1.0, 0.5)))]
    return cases


def _params_for(kind):
    p, q = _param(), _param()
    if kind is None:
        return [p]
    if kind == "tensor":
        return p
    if kind == "two_groups":
        return [{"params": p}, {"params": p}]
    if kind == "names_mixed":
        return [("weight", p), q]
    if kind == "group_names_mixed":
        return [{"params": [p], "lr": 1e-2}, {"params": [("weight", q)]}]
    raise ValueError(kind)


def _outcome(cls, kind, kwargs):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls(_params_for(kind), **kwargs)
    except Exception as e:  # any exception is an outcome to compare
        return type(e), str(e)
    return None


def test_hyperparameter_errors_match_torch(name):
    checked = 0
    for label, kind, kwargs in _error_cases(name):
        theirs = _outcome(torch_class(name), kind, kwargs)
        assert theirs is not None, f"{label}: torch accepts it; fix the case table"
        ours = _outcome(rp_class(name), kind, kwargs)
        assert ours is not None, f"{label}: roundpipe accepted what torch rejects: {theirs}"
        assert ours[0] is theirs[0], (label, ours, theirs)
        if label != "unexpected kwarg":  # the bound-signature message names a different function
            assert ours[1] == theirs[1], (label, ours, theirs)
        checked += 1
    assert checked >= 7


def test_duplicate_parameter_warns_like_torch(name):
    p = _param()
    with pytest.warns(UserWarning, match="duplicate parameters"):
        torch_class(name)([p, p])
    with pytest.warns(UserWarning, match="duplicate parameters"):
        rp_class(name)([p, p])


def _placeholder_values(name, option):
    if option not in inspect.signature(torch_class(name)).parameters:
        return []
    return [True, False]


@pytest.mark.parametrize("option", ["foreach", "fused"])
def test_foreach_fused_warn_once_and_are_ignored(name, option):
    values = _placeholder_values(name, option)
    if not values:
        # torch has no such argument: both reject it the same way
        with pytest.raises(TypeError):
            torch_class(name)([_param()], **{option: True})
        with pytest.raises(TypeError):
            rp_class(name)([_param()], **{option: True})
        return
    if option == "fused" and rp_class(name).spec.fused_kernel:
        # torch's fused kernel, modelled (conformance/test_fused.py): kept, as torch keeps it
        for value in values:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                opt = rp_class(name)([_param()], fused=value)
            assert opt.defaults["fused"] is value and opt.param_groups[0]["fused"] is value
        return
    for value in values:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = rp_class(name)([_param()], **{option: value})
        ours = [w for w in caught if issubclass(w.category, UserWarning) and option in str(w.message)]
        assert len(ours) == 1, [str(w.message) for w in caught]
        assert ours[0].filename == __file__, "the warning should point at the caller"
        assert opt.defaults[option] is None
        assert opt.param_groups[0][option] is None
    # not given (None): no warning at all
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rp_class(name)([_param()])
        rp_class(name)([_param()], **{option: None})


@pytest.mark.parametrize("option", ["capturable", "differentiable"])
def test_capturable_differentiable_true_raise(name, option):
    if option not in inspect.signature(torch_class(name)).parameters:
        with pytest.raises(TypeError):
            rp_class(name)([_param()], **{option: True})
        return
    with pytest.raises(ValueError, match=option):
        rp_class(name)([_param()], **{option: True})
    opt = rp_class(name)([_param()], **{option: False})
    assert opt.defaults[option] is False


def test_foreach_ignored_does_not_change_results(name):
    """foreach=True is ignored: the optimizer steps exactly like one built without it."""
    results = []
    for kwargs in ({}, {"foreach": True}):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = rp_class(name)([p], **kwargs)
        for k in range(2):
            p.grad = torch.linspace(-0.5, 0.7, 6) * (k + 1)
            opt.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])


def test_subclass_of_roundpipe_class(name):
    """A user subclass keeps working (torch patches step() for hooks on the first instance)."""

    class Mine(rp_class(name)):
        pass

    p = torch.nn.Parameter(torch.ones(3))
    opt = Mine([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(3))
    assert opt.backend == "fast"


CTOR_LRS = {
    "negative 0-d tensor": lambda: torch.tensor(-0.01),
    "negative float64 tensor": lambda: torch.tensor(-1.0, dtype=torch.float64),
    "nan 0-d tensor": lambda: torch.tensor(float("nan")),
    "2-element tensor, negative": lambda: torch.tensor([-0.1, 0.1]),
}


@pytest.mark.parametrize("case", list(CTOR_LRS))
def test_tensor_lr_at_construction_same_outcome_as_torch(name, case):
    """The same error (type and message) as torch, or none where torch has none (SGD's check
    ``lr < 0.0`` lets NaN through)."""
    theirs = outcome(lambda: torch_class(name)(make_params(), lr=CTOR_LRS[case]()))
    ours = outcome(lambda: rp_class(name)(make_params(), lr=CTOR_LRS[case]()))
    assert ours[0] == theirs[0], (ours, theirs)
    if theirs[0] == "error":
        assert type(ours[1]) is type(theirs[1]) and str(ours[1]) == str(theirs[1])
