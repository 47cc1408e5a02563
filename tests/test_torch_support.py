"""The supported torch range and the self-check that guards a torch outside it
(``roundpipe/optim/torch_support.py``)."""

import dataclasses
import warnings

import pytest
import torch

import roundpipe.optim as ro
from roundpipe.optim import torch_support
from tests._util import OPTIMIZER_NAMES, rp_class


@pytest.fixture(autouse=True)
def _unchecked(monkeypatch):
    # every test starts with no (class, hyperparameters) checked in this process
    monkeypatch.setattr(torch_support, "_done", set())


def _param():
    return torch.nn.Parameter(torch.randn(3))


@pytest.mark.parametrize(
    "version, inside",
    [
        ("2.5.1", False),
        ("2.6.0", True),
        ("2.6.0+cu124", True),
        ("2.13.0+cpu", True),
        ("2.15.3", True),
        ("2.16.0", False),
        ("2.16.0.dev20270101", False),
        ("3.0.0", False),
        ("unknown", False),
    ],
)
def test_supported_range(version, inside):
    assert torch_support.supported(version) is inside


def test_installed_torch_is_supported():
    # the dependency range in pyproject.toml admits only these: a failure here is a torch
    # installed around it
    assert torch_support.supported(), torch.__version__


def test_spec_passes_the_self_check_on_this_torch(monkeypatch):
    monkeypatch.setenv(torch_support.ENV_VAR, "error")
    for name in OPTIMIZER_NAMES:
        rp_class(name)([_param()])
    # non-default options, tensor hyperparameters (Adam's betas included)
    ro.Adam(
        [_param()],
        lr=torch.tensor(0.01),
        betas=(torch.tensor(0.8), torch.tensor(0.99)),
        amsgrad=True,
        weight_decay=0.1,
    )
    ro.AdamW([_param()], weight_decay=0.1, maximize=True)
    ro.SGD([_param()], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    ro.RAdam([_param()], decoupled_weight_decay=True, weight_decay=0.1)
    ro.ASGD([_param()], t0=2.0)
    assert len(torch_support._done) == len(OPTIMIZER_NAMES) + 5


def _broken_sgd(monkeypatch):
    """SGD whose spec steps with a learning rate off by an ulp: what a torch release that
    changed its for-loop would look like to the self-check."""
    spec = ro.SGD.spec

    def scalars(group, state):
        out = spec.scalars(group, state)
        return {**out, "neg_lr": out["neg_lr"] * (1 + 2**-20)}

    monkeypatch.setattr(ro.SGD, "spec", dataclasses.replace(spec, scalars=scalars, _cache={}))
    return spec


def test_a_difference_warns_once_naming_the_optimizer(monkeypatch):
    _broken_sgd(monkeypatch)
    monkeypatch.setenv(torch_support.ENV_VAR, "always")
    with pytest.warns(
        RuntimeWarning, match=r"roundpipe\.optim\.SGD differs from torch\.optim\.SGD"
    ) as record:
        ro.SGD([_param()], lr=0.1)
    assert torch.__version__ in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ro.SGD([_param()], lr=0.1)  # the same hyperparameters: checked once per process


def test_error_mode_raises(monkeypatch):
    _broken_sgd(monkeypatch)
    monkeypatch.setenv(torch_support.ENV_VAR, "error")
    with pytest.raises(RuntimeError, match="differs from torch.optim.SGD's for-loop"):
        ro.SGD([_param()], lr=0.1)


def test_auto_checks_only_outside_the_range(monkeypatch):
    _broken_sgd(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ro.SGD([_param()], lr=0.1)  # auto, inside the range: no check
    assert not torch_support._done
    monkeypatch.setattr(torch_support, "SUPPORTED", ((1, 0), (1, 13)))
    with pytest.warns(RuntimeWarning, match="has not been checked against"):
        ro.SGD([_param()], lr=0.1)


def test_never_and_bad_mode(monkeypatch):
    _broken_sgd(monkeypatch)
    monkeypatch.setattr(torch_support, "SUPPORTED", ((1, 0), (1, 13)))
    monkeypatch.setenv(torch_support.ENV_VAR, "never")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ro.SGD([_param()], lr=0.1)
    monkeypatch.setenv(torch_support.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=torch_support.ENV_VAR):
        ro.SGD([_param()], lr=0.1)
