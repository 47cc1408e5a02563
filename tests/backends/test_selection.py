"""Backend selection: ``backend=`` beats ``ROUNDPIPE_OPTIM_BACKEND`` beats the default
``"fast"``; unknown names are rejected; the backend is never stored in ``defaults``,
``param_groups`` or ``state_dict`` (which keeps torch.optim's layout)."""

import pytest
import torch

from roundpipe.optim import backends
from tests._util import (
    ENV_VAR,
    RICH_KWARGS,
    assert_state_dicts_close,
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


def _make(name, **kwargs):
    return rp_class(name)(groups(make_params()), **kwargs)


def test_default_is_fast(name):
    assert _make(name).backend == "fast"


@pytest.mark.parametrize("choice", ["fast", "reference"])
def test_argument(name, choice):
    opt = _make(name, backend=choice)
    assert opt.backend == choice


@pytest.mark.parametrize("choice", ["fast", "reference"])
def test_environment_variable(name, choice, monkeypatch):
    monkeypatch.setenv(ENV_VAR, choice)
    assert _make(name).backend == choice


@pytest.mark.parametrize("env, arg", [("reference", "fast"), ("fast", "reference")])
def test_argument_beats_environment(name, env, arg, monkeypatch):
    monkeypatch.setenv(ENV_VAR, env)
    assert _make(name, backend=arg).backend == arg


def test_environment_read_at_construction(name, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    opt = _make(name)
    monkeypatch.setenv(ENV_VAR, "fast")
    assert opt.backend == "reference"


# an empty string is not "not given": it is rejected too
@pytest.mark.parametrize("bad", ["numexpr", "FAST", "torch", ""])
def test_unknown_backend_argument(name, bad):
    with pytest.raises(ValueError) as info:
        _make(name, backend=bad)
    msg = str(info.value)
    assert "'fast'" in msg and "'reference'" in msg
    assert repr(bad) in msg


def test_unknown_backend_in_environment(name, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError) as info:
        _make(name)
    msg = str(info.value)
    assert "'fast'" in msg and "'reference'" in msg and "'cuda'" in msg and ENV_VAR in msg


def test_backend_is_keyword_only(name):
    import inspect

    param = inspect.signature(rp_class(name)).parameters["backend"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None


def test_backend_not_stored(name, backend):
    params = make_params()
    opt = rp_class(name)(groups(params), backend=backend, **RICH_KWARGS[name])
    assert "backend" not in opt.defaults
    run_steps(opt, params, range(2))
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    for g in opt.param_groups:
        assert "backend" not in g
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        assert "backend" not in g
    assert backend not in repr(sd)


def test_repr_names_backend(name, backend):
    assert f"backend='{backend}'" in repr(_make(name, backend=backend))


def test_state_dict_layout_is_torchs(name, backend):
    """Same group entries and values, same state keys, types, dtypes, shapes and close values
    as torch.optim after the same steps."""
    params = make_params()
    tparams = clone_params(params)
    opt = rp_class(name)(groups(params), backend=backend, **RICH_KWARGS[name])
    ref = torch_class(name)(groups(tparams), **RICH_KWARGS[name])
    assert_state_dicts_close(opt.state_dict(), ref.state_dict())  # before any step
    run_steps(opt, params, range(3))
    run_steps(ref, tparams, range(3))
    assert_state_dicts_close(opt.state_dict(), ref.state_dict())


def test_load_state_dict_keeps_backend(name):
    params = make_params()
    src = rp_class(name)(groups(params), backend="fast", **RICH_KWARGS[name])
    run_steps(src, params, range(2))
    dst = rp_class(name)(groups(clone_params(params)), backend="reference", **RICH_KWARGS[name])
    dst.load_state_dict(src.state_dict())
    assert dst.backend == "reference"


def test_backend_objects():
    assert backends.resolve(None) == "fast"
    assert backends.resolve("reference") == "reference"
    assert backends.get("fast") is backends.get("fast")
    assert backends.get("fast").name == "fast" and backends.get("reference").name == "reference"


@pytest.mark.parametrize(
    "var, value",
    [("ROUNDPIPE_OPTIM_ENGINE", "bogus"), ("ROUNDPIPE_OPTIM_NUM_THREADS", "zero")],
)
def test_bad_fast_backend_setting_raises_before_modifying_anything(name, var, value, monkeypatch):
    """A bad engine or thread setting is a ValueError that leaves the optimizer untouched
    (no state created, no step counted), like every other rejected step."""
    params = make_params()
    opt = rp_class(name)(groups(params), backend="fast", **RICH_KWARGS[name])
    run_steps(opt, params, range(2))
    set_grads(params, 2)
    monkeypatch.setenv(var, value)
    snap = snapshot(opt)
    with pytest.raises(ValueError, match=var):
        opt.step()
    assert_unchanged(opt, snap)
    monkeypatch.delenv(var)
    opt.step()
