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
    marked = {p.id: p.marks for p in test_conformance.case_params() if p.marks}
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


# ---------------------------------------------------------------------------------------------
# the bit-for-bit comparison (cases.BIT_EXACT)


def _with(snap, index, element, value):
    """A copy of ``snap`` whose parameter ``index`` holds ``value`` at flat ``element`` (the
    real component of a complex parameter)."""
    out = Snapshot(snap.loss, [p.clone() for p in snap.params], snap.state, snap.param_groups)
    flat = out.params[index].view(-1)
    real = torch.view_as_real(flat)[:, 0] if flat.is_complex() else flat
    real[element] = value
    return out


def _ulp_up(x):
    return torch.nextafter(torch.tensor(x), torch.tensor(float("inf"))).item()


@pytest.mark.parametrize("index", [3, 7, 10])  # 0-d, float32 70001, complex64 33000
def test_exact_comparison_fails_on_one_ulp(index):
    theirs = _snapshot()
    element = 0 if index == 3 else 123
    flat = theirs.params[index].view(-1)
    b = (torch.view_as_real(flat)[:, 0] if flat.is_complex() else flat)[element].item()
    ours = _with(theirs, index, element, _ulp_up(b))
    compare_values(ours, theirs, CTX, "fast:numba")  # well inside assert_close's allowance
    part = r" \(real part\)" if index == 10 else ""
    with pytest.raises(
        AssertionError,
        match=rf"param\[{index}\] .* value vs torch: not bit for bit .*: 1 of \d+ elements differ in "
        rf"their bits; the first at flat index {element}{part}: ",
    ):
        compare_values(ours, theirs, CTX, "fast:numba", exact=True)
    st = harness.RECORDER.stats[("SGD", "fast:numba")]
    assert 0 < st.max_abs < 1e-6  # the failing comparison is recorded too


def test_exact_comparison_tells_signed_zeros_apart():
    theirs = _with(_snapshot(), 7, 5, 0.0)
    ours = _with(theirs, 7, 5, -0.0)
    compare_values(ours, theirs, CTX, "fast:numba")  # assert_close: -0.0 == 0.0
    with pytest.raises(AssertionError, match=r"index 5: -0\.0 vs 0\.0 \(bits 0x80000000 vs 0x00000000\)"):
        compare_values(ours, theirs, CTX, "fast:numba", exact=True)


def test_exact_comparison_matches_nans_by_position():
    nan = float("nan")
    theirs = _with(_with(_snapshot(), 7, 5, nan), 10, 2, nan)
    ours = _with(_with(theirs, 7, 5, -nan), 10, 2, nan)  # another NaN (sign bit set) is a NaN
    assert not torch.equal(harness.bit_view(ours.params[7]), harness.bit_view(theirs.params[7]))
    compare_values(ours, theirs, CTX, "fast:numba", exact=True)
    for index, element in ((7, 5), (10, 2)):
        with pytest.raises(AssertionError, match=rf"param\[{index}\] .* index {element}\b"):
            compare_values(_with(theirs, index, element, 1.0), theirs, CTX, "fast:numba", exact=True)


def test_exact_comparison_counts_the_differing_elements_and_checks_state():
    buf = torch.zeros(3, 5)
    off = buf.clone()
    off.view(-1)[[4, 9, 10]] = torch.tensor([1e-30, -0.0, 1e-30])
    theirs, ours = _snapshot({0: {"momentum_buffer": buf}}), _snapshot({0: {"momentum_buffer": off}})
    with pytest.raises(
        AssertionError, match=r"state\['momentum_buffer'\] .*: 3 of 15 elements differ .* flat index 4: "
    ):
        compare_values(ours, theirs, CTX, "fast:numba", exact=True)
    # a declared deviation is a declared difference: its tolerance applies, not bit equality
    dev = Deviation(("fast:numba",), "SGD", {}, "test", "test", tolerance={"rtol": RTOL, "atol": 4e-5})
    compare_values(ours, theirs, CTX, "fast:numba", dev, exact=True)


def test_which_backends_are_compared_bit_for_bit(monkeypatch):
    from roundpipe.optim import backends

    assert harness.exact_backend("fast:numexpr") == (False, "")
    assert harness.exact_backend("reference") == (True, "")
    assert harness.exact_backend("fast:torch") == (True, "")
    engine = backends.get("fast:numba").numba_engine()
    assert harness.exact_backend("fast:numba") == (engine.exact, harness.exact_backend("fast:numba")[1])
    # where the engine's probes find this torch's rounding unmodelled: assert_close, and the
    # failure messages say why
    monkeypatch.setattr(engine, "exact", False)
    exact, note = harness.exact_backend("fast:numba")
    assert not exact and "not bit for bit" in note and "probes" in note
    theirs = _snapshot()
    with pytest.raises(AssertionError, match=r"value vs torch \[compared with assert_close, not bit"):
        compare_values(_perturbed(theirs, 7, 123, 2.0), theirs, CTX, "fast:numba", exact=exact, note=note)
