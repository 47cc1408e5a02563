"""The harness checks what it says it checks: its shortcuts (bitwise-equal pairs skipped, the
errors measured only where elements differ, assert_close not called well inside its allowance)
decide exactly as assert_close does, and the structure check catches what torch would not have.
"""

import pytest
import torch

from . import harness
from .cases import Case
from .deviations import Deviation
from .harness import ATOL, RTOL, Context, Snapshot, compare_structure, compare_values, make_params


@pytest.fixture(autouse=True)
def _own_recorder(monkeypatch):
    monkeypatch.setattr(harness, "RECORDER", harness.Recorder())


def _snapshot(state=None):
    """The parameter set, with ``state`` (param index -> {key: value}) and one param group."""
    params = [p.detach() for p in make_params()]
    groups = [{"lr": 0.1, "maximize": False, "params": list(range(len(params)))}]
    return Snapshot(None, params, dict(state or {}), groups)


def _perturbed(snap, index, element, share):
    """A copy of ``snap`` whose parameter ``index`` is off at ``element`` by ``share`` of
    assert_close's float32 allowance there (real component for a complex parameter)."""
    out = Snapshot(snap.loss, [p.clone() for p in snap.params], snap.state, snap.param_groups)
    flat = out.params[index].view(-1)
    real = torch.view_as_real(flat)[:, 0] if flat.is_complex() else flat
    b = real[element].item()
    real[element] = b + share * (ATOL + RTOL * abs(b))
    return out


CTX = Context(Case("SGD", {}), "fast:numba")


@pytest.mark.parametrize("index", [7, 10])  # float32 70001, complex64 33000
@pytest.mark.parametrize("share", [0.3, 0.9])
def test_differences_inside_the_allowance_pass_and_are_measured(index, share):
    theirs = _snapshot()
    compare_values(_perturbed(theirs, index, 123, share), theirs, CTX, "fast:numba")
    st = harness.RECORDER.stats[("SGD", "fast:numba")]
    assert st.max_ratio == pytest.approx(share, rel=0.02)  # b + share * allowance, rounded to float32
    assert f"param[{index}]" in st.worst and "element 123" in st.worst


@pytest.mark.parametrize("index", [7, 10])
def test_a_difference_beyond_the_allowance_fails_and_names_the_tensor(index):
    theirs = _snapshot()
    with pytest.raises(AssertionError, match=rf"param\[{index}\] .* value vs torch"):
        compare_values(_perturbed(theirs, index, 123, 2.0), theirs, CTX, "fast:numba")


def test_a_declared_tolerance_replaces_the_defaults_and_is_recorded():
    theirs = _snapshot()
    ours = _perturbed(theirs, 7, 5, 3.0)  # 3x the default allowance: about 3e-5
    with pytest.raises(AssertionError):
        compare_values(ours, theirs, CTX, "fast:numba")
    dev = Deviation(("fast:numba",), "SGD", {}, "test", "test", tolerance={"rtol": RTOL, "atol": 4e-5})
    compare_values(ours, theirs, CTX, "fast:numba", dev)
    assert harness.RECORDER.deviations[(dev.name, "fast:numba")].max_ratio == pytest.approx(3.0, rel=0.02)


def test_state_values_are_compared():
    buf = torch.ones(3, 5)
    theirs, ours = _snapshot({0: {"momentum_buffer": buf}}), _snapshot({0: {"momentum_buffer": buf + 1e-4}})
    with pytest.raises(AssertionError, match=r"param\[0\] .* state\['momentum_buffer'\]"):
        compare_values(ours, theirs, CTX, "fast:numba")


def test_an_empty_state_entry_where_torch_has_none_is_a_difference():
    theirs, ours = _snapshot(), _snapshot({0: {}, 1: {}})
    with pytest.raises(AssertionError, match=r"ids \[0, 1\] \(empty: \[0, 1\]\), torch's for \[\]"):
        compare_structure(ours, theirs, CTX)


@pytest.mark.parametrize(
    "change",
    [
        {"lr": 0.2},
        {"lr": torch.tensor(0.1)},  # a tensor where torch has a float
        {"maximize": 0},  # equal, but not the same type
        {"foreach": None},  # an extra key
    ],
)
def test_param_groups_must_equal_torchs(change):
    theirs, ours = _snapshot(), _snapshot()
    ours.param_groups = [{**ours.param_groups[0], **change}]
    with pytest.raises(AssertionError, match=r"state_dict\(\)\['param_groups'\]\[0\]"):
        compare_structure(ours, theirs, CTX)
    compare_structure(theirs, _snapshot(), CTX)  # and an identical one passes


def test_declared_deviations_are_checked_and_an_xfail_is_strict(monkeypatch):
    from . import deviations, test_conformance
    from .cases import BACKENDS, CASES

    xfail = Deviation(("fast:numba",), "Rprop", {"maximize": True}, "a reason", "measured")
    monkeypatch.setattr(deviations, "DEVIATIONS", (xfail,))
    deviations.check(CASES, BACKENDS)
    marked = {p.id: p.marks for p in test_conformance._params() if p.marks}
    assert marked and all(
        i.startswith("Rprop-") and "maximize=True" in i and i.endswith("-fast:numba") for i in marked
    )
    assert all(
        m.name == "xfail" and m.kwargs["strict"] and m.kwargs["reason"] == "a reason"
        for ms in marked.values()
        for m in ms
    )

    for bad in (
        Deviation(("fast:numba",), "Rprop", {"maximize": "never"}, "r", "m"),  # covers no case
        Deviation(("fast:numba",), "Rprop", {"nesterov": True}, "r", "m"),  # not an Rprop option
        Deviation(("fast:numba",), "Rprop", {}, "r", "m", tolerance={"rtol": 0.0, "atol": 1e-5}),  # tighter
        Deviation(("fast",), "Rprop", {}, "r", "m"),  # not a backend of the grid
    ):
        monkeypatch.setattr(deviations, "DEVIATIONS", (bad,))
        with pytest.raises(AssertionError, match="declared deviation"):
            deviations.check(CASES, BACKENDS)
