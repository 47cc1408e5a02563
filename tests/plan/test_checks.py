"""The contract the step plan checks (``roundpipe/optim/plan/checks.py``): only dense, contiguous
float32/complex64 CPU parameters, gradients and state, parameters that do not overlap in
memory, and state (loaded or corrupted) of the parameter's shape and dtype. Anything else
raises TypeError/ValueError/RuntimeError (KeyError for a missing state entry) naming the
parameter (``param_groups[g]['params'][i]``) before *anything* is modified: no parameter,
gradient or state tensor changes, and no state is created or advanced (``step``), in any group.

* the tensor contract: each case corrupts a parameter that is not the first of its group, after
  two good steps (so state exists), while another group holds a parameter about to take its
  first step; complex64 and empty parameters are stepped as torch steps them;
* channels-last (non-contiguous) 4-d parameters are refused;
* parameters that are views of one tensor: disjoint views step as torch steps them, overlapping
  ones (where torch's for-loop and foreach paths disagree) are refused;
* a state dict from another optimizer class, or a corrupted one, loaded with
  ``load_state_dict`` (through ``torch.load(weights_only=True)``): the same outcome as torch's
  (a result close to torch's, or an error with nothing modified).

Reference runs use ``torch.optim`` with its CPU default, the for-loop (``foreach=False``).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from roundpipe.optim.spec import SPECS
from tests._against_torch import ERRORS, outcome, rp_opt, save_load, torch_opt
from tests._util import (
    OPTIMIZER_NAMES,
    RICH_KWARGS,
    TOL,
    assert_params_close,
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

CONTRACT_ERRORS = (TypeError, ValueError, RuntimeError)


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
    # (a bfloat16 or float16 parameter is stepped as it is; beside its float32 state it is not)
    "float16 beside float32 state": lambda opt, p: (
        _set_data(p, p.data.half()),
        setattr(p.grad, "data", p.grad.data.half()),
    ),
    "bfloat16 beside float32 state": lambda opt, p: (
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
    with pytest.raises(CONTRACT_ERRORS, match=_location(1, 1)):
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
    with pytest.raises(CONTRACT_ERRORS, match=_location(2, 1)):
        opt.step()
    assert_unchanged(opt, snap)


def test_optimizer_still_works_after_an_error(name, backend):
    """After a rejected step and a fix, stepping continues as if the bad step never happened."""
    opt, target = _setup(name, backend)
    twin_opt, twin_target = _setup(name, backend)
    good_grad = target.grad
    target.grad = _randn(4, 3, seed=9).t()
    with pytest.raises(CONTRACT_ERRORS):
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


# ---------------------------------------------------------------------------------------------
# channels-last parameters


def _setup_4d(name, backend):
    """group 0: [a]; group 1: [b, target (4-d), c (complex64)]; two good steps, then grads."""
    a = torch.nn.Parameter(_randn(3, 4, seed=1))
    b = torch.nn.Parameter(_randn(5, seed=2))
    target = torch.nn.Parameter(_randn(2, 3, 4, 5, seed=3))
    c = torch.nn.Parameter(_randn(2, 3, dtype=torch.complex64, seed=4))
    params = [a, b, target, c]
    opt = rp_opt(name, [{"params": [a]}, {"params": [b, target, c], "lr": 0.003}], backend)
    run_steps(opt, params, range(2))
    set_grads(params, 2)
    return opt, target


def _channels_last(t):
    out = t.detach().to(memory_format=torch.channels_last)
    assert not out.is_contiguous()
    return out


CHANNELS_LAST = {
    "param": lambda p: setattr(p, "data", _channels_last(p.data)),
    "grad": lambda p: setattr(p, "grad", _channels_last(p.grad)),
    # what autograd produces for a channels_last weight
    "param and grad": lambda p: (
        setattr(p, "data", _channels_last(p.data)),
        setattr(p, "grad", _channels_last(p.grad)),
    ),
}


@pytest.mark.parametrize("case", list(CHANNELS_LAST))
def test_channels_last_is_refused_before_modifying_anything(name, backend, case):
    """channels_last tensors are dense but not contiguous: outside the contract, so the step
    raises naming the parameter and leaves everything as it was."""
    opt, target = _setup_4d(name, backend)
    CHANNELS_LAST[case](target)
    snap = snapshot(opt)
    with pytest.raises(ERRORS, match=_location(1, 1)):
        opt.step()
    assert_unchanged(opt, snap)


# ---------------------------------------------------------------------------------------------
# parameters that share memory
#
# torch.optim steps parameters one after the other, each in place, so parameters that are views
# of one tensor see each other's updates. For disjoint views that changes nothing: the result
# is well defined and roundpipe must match it. For views that overlap it depends on the
# implementation: torch's for-loop and foreach=True give different results as soon as weight
# decay reads a parameter another one has already updated. roundpipe must refuse those with an
# error naming a parameter, before anything is modified.


def _shared_memory_params(case):
    base = torch.linspace(-1, 1, 24)
    if case == "disjoint views":
        views = [base[:12].view(3, 4), base[12:].view(2, 6)]
    elif case == "overlapping views":
        views = [base[:16].view(4, 4), base[8:]]
    elif case == "the same memory twice":
        views = [base.view(4, 6), base]
    elif case == "one grad tensor for two parameters":
        views = [base[:12].clone().view(3, 4), base[12:].clone().view(3, 4)]
    else:
        raise ValueError(case)
    params = [torch.nn.Parameter(v) for v in views]
    if case != "one grad tensor for two parameters":
        assert all(p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for p in params)
    other = torch.nn.Parameter(_randn(5, seed=7))
    return base, other, params


def _shared_memory_grads(case, other, params, k):
    set_grads([other, *params], k)
    if case == "one grad tensor for two parameters":
        params[1].grad = params[0].grad


def _shared_memory_run(case, make_opt, steps):
    base, other, params = _shared_memory_params(case)
    opt = make_opt([{"params": [other]}, {"params": params, "lr": 0.02}])
    for k in range(steps):
        _shared_memory_grads(case, other, params, k)
        opt.step()
    return opt, base, other, params


@pytest.mark.parametrize("case", ["disjoint views", "one grad tensor for two parameters"])
def test_shared_memory_that_is_well_defined_matches_torch(name, backend, case):
    ours = _shared_memory_run(case, lambda g: rp_opt(name, g, backend), 4)
    theirs = _shared_memory_run(case, lambda g: torch_opt(name, g), 4)
    torch.testing.assert_close(ours[1], theirs[1], **TOL)
    assert_params_close([ours[2], *ours[3]], [theirs[2], *theirs[3]])
    assert_state_dicts_close(ours[0].state_dict(), theirs[0].state_dict())


OVERLAP_NAMES = ["Adam", "Adagrad", "SGD"]  # the check is not per optimizer: three will do


@pytest.mark.parametrize("case", ["overlapping views", "the same memory twice"])
@pytest.mark.parametrize("name", OVERLAP_NAMES)
def test_overlapping_parameters_give_different_results_in_torch(name, case):
    """The premise of the next test: torch's own implementations disagree on overlapping
    parameters (here through weight decay, which reads a parameter that another one has
    updated), so there is no single torch result to match. (Updates that do not read the
    parameter, e.g. Rprop's, add up the same either way; roundpipe need not tell them apart.)"""
    results = []
    for foreach in (False, True):
        _, base, _, _ = _shared_memory_run(case, lambda g, f=foreach: torch_opt(name, g, foreach=f), 2)
        results.append(base)
    assert not torch.equal(*results)


@pytest.mark.parametrize("case", ["overlapping views", "the same memory twice"])
@pytest.mark.parametrize("name", OVERLAP_NAMES)
def test_overlapping_parameters_are_refused(name, backend, case):
    base, other, params = _shared_memory_params(case)
    opt = rp_opt(name, [{"params": [other]}, {"params": params, "lr": 0.02}], backend)
    _shared_memory_grads(case, other, params, 0)
    snap = snapshot(opt)
    base_before = base.clone()
    with pytest.raises(ERRORS, match=r"param_groups\[1\]\['params'\]\[[01]\]"):
        opt.step()
    assert_unchanged(opt, snap)
    assert torch.equal(base, base_before)


# ---------------------------------------------------------------------------------------------
# state dicts from another optimizer class

FOREIGN = [
    ("SGD", "Adam"),
    ("Adam", "SGD"),
    ("Adam", "RMSprop"),
    ("RMSprop", "Adam"),
    ("Adagrad", "Adam"),
    ("Rprop", "Adam"),
    ("Adam", "NAdam"),
    ("Adam", "ASGD"),
    ("Adam", "AdamW"),
    ("AdamW", "Adam"),
    ("NAdam", "Adam"),
    ("Adam", "RAdam"),
    ("Adamax", "Adam"),
]


def _load_foreign(make_dst, src_sd):
    params = make_params()
    opt = make_dst(groups(params))
    load = outcome(lambda: opt.load_state_dict(copy.deepcopy(src_sd)))
    return opt, params, load


@pytest.mark.parametrize("src, dst", FOREIGN, ids=[f"{s}-into-{d}" for s, d in FOREIGN])
def test_state_dict_of_another_optimizer(src, dst, backend):
    """Whatever torch does with a foreign state dict: where torch steps on, roundpipe steps on
    alike; where torch's step fails, roundpipe's fails too, with an error naming the
    parameter or the missing key, and modifies nothing."""
    src_params = make_params()
    src_opt = torch_opt(src, groups(src_params))
    run_steps(src_opt, src_params, range(2))
    sd = save_load(src_opt.state_dict())

    ours, our_params, our_load = _load_foreign(lambda g: rp_opt(dst, g, backend), sd)
    theirs, their_params, their_load = _load_foreign(lambda g: torch_opt(dst, g), sd)
    assert our_load[0] == their_load[0], (our_load, their_load)
    if our_load[0] == "error":
        assert type(our_load[1]) is type(their_load[1]) and str(our_load[1]) == str(their_load[1])

    for k in range(2, 5):
        set_grads(our_params, k)
        set_grads(their_params, k)
        snap = snapshot(ours)
        theirs_step = outcome(theirs.step)
        ours_step = outcome(ours.step)
        if theirs_step[0] == "ok":
            assert ours_step[0] == "ok", f"step {k}: torch steps on, roundpipe raised {ours_step[1]!r}"
            assert_params_close(our_params, their_params)
            continue
        assert ours_step[0] == "error", f"step {k}: torch raised {theirs_step[1]!r}, roundpipe stepped"
        err = ours_step[1]
        assert isinstance(err, ERRORS), repr(err)
        # a group hyperparameter the foreign groups lack (KeyError naming it, as torch's), or
        # an error naming the parameter whose state does not fit
        missing = set(ours.defaults) - set(sd["param_groups"][0])
        names_key = isinstance(err, KeyError) and err.args and err.args[0] in missing
        names_param = re.search(r"param_groups\[\d\]\['params'\]\[\d\]", str(err))
        assert names_key or names_param, f"unclear error {err!r} (torch: {theirs_step[1]!r})"
        assert_unchanged(ours, snap)
        break


# ---------------------------------------------------------------------------------------------
# corrupted or old-format state dicts

# target: param_groups[1]['params'][0] of make_params() (shape (2, 3), float32)
TARGET = 2


def _tensor_key(state):
    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert keys
    return keys[0]


def _corrupt(sd, what):
    st = sd["state"][TARGET]
    if what == "missing state tensor":
        del st[_tensor_key(st)]
    elif what == "state tensor flattened":
        k = _tensor_key(st)
        st[k] = st[k].reshape(-1).clone()
    elif what == "state tensor broadcastable (1, 3)":
        k = _tensor_key(st)
        st[k] = st[k][:1].clone()
    elif what == "missing step":
        del st["step"]
    elif what == "state tensors float64":
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                st[k] = v.double()
    elif what == "step a python float (old checkpoints)":
        st["step"] = float(st["step"])
    elif what == "step a float64 tensor":
        st["step"] = st["step"].double()
    else:
        raise ValueError(what)
    return sd


# (corruption, expected): "error" -> roundpipe raises naming the target and modifies nothing;
# "like torch" -> roundpipe does what torch does (steps on alike, or fails and modifies nothing)
CORRUPTIONS = {
    "missing state tensor": "like torch",  # SGD re-creates a missing momentum_buffer
    "state tensor flattened": "error",
    "state tensor broadcastable (1, 3)": "error",
    "missing step": "like torch",
    "state tensors float64": "like torch",
    "step a python float (old checkpoints)": "like torch",
    "step a float64 tensor": "like torch",
}


# the corruptions of ``step`` only where the optimizer keeps one (SGD does not)
CORRUPTION_CASES = [
    (n, c)
    for n in OPTIMIZER_NAMES
    for c in CORRUPTIONS
    if "step" in SPECS[n].scalar_state or "step" not in c.split()
]


@pytest.mark.parametrize("opt_name, corruption", CORRUPTION_CASES)
def test_corrupted_state_dict(opt_name, corruption, backend):
    ref_params = make_params()
    ref = torch_opt(opt_name, groups(ref_params))
    run_steps(ref, ref_params, range(2))
    sd = _corrupt(save_load(ref.state_dict()), corruption)

    runs = {}
    for kind, make in (
        ("ours", lambda g: rp_opt(opt_name, g, backend)),
        ("theirs", lambda g: torch_opt(opt_name, g)),
    ):
        params = clone_params(ref_params)
        opt = make(groups(params))
        load = outcome(lambda opt=opt: opt.load_state_dict(copy.deepcopy(sd)))
        runs[kind] = (opt, params, load)
    (ours, our_params, our_load), (theirs, their_params, their_load) = runs["ours"], runs["theirs"]
    assert our_load[0] == their_load[0], (our_load, their_load)

    for k in range(2, 5):
        set_grads(our_params, k)
        set_grads(their_params, k)
        snap = snapshot(ours)
        ours_step = outcome(ours.step)
        theirs_step = outcome(theirs.step)
        if CORRUPTIONS[corruption] == "like torch" and theirs_step[0] == "ok":
            assert ours_step[0] == "ok", f"step {k}: torch steps on, roundpipe raised {ours_step[1]!r}"
            assert_params_close(our_params, their_params)
            continue
        assert ours_step[0] == "error", f"step {k}: roundpipe stepped on a corrupted state"
        assert isinstance(ours_step[1], ERRORS), repr(ours_step[1])
        assert re.search(_location(1, 0), str(ours_step[1])), (
            f"error does not name the parameter: {ours_step[1]!r}"
        )
        assert_unchanged(ours, snap)
        break
