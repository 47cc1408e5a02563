"""``backend="fast"`` where its numba engine cannot run: the fallback to the torch engine.

Two failures are simulated on a fresh backend object (``conftest`` empties
``backends._instances`` for every test):

* numba cannot be imported (``import_numba``, as ``numba_engine/engine.py`` calls it, raises
  ImportError);
* a kernel cannot be compiled (``numba_engine.kernels._compile`` raises, with a fresh
  process-wide kernel cache ``numba_engine.kernels._kernels``, so the compilation really
  happens).

Plain ``fast`` then steps with the torch engine: one RuntimeWarning over several steps, naming
the cause and the fix; ``engine()`` says ``"torch"``; the results are torch.optim's for-loop
(``foreach=False``) bit for bit, parameters and every state tensor. ``fast:numba`` (an engine
chosen by name) raises instead, before the step modifies anything.
(``numba_engine/test_engine.py::test_without_numba_fast_numba_raises_import_error`` covers ``fast:numba``
and ``ROUNDPIPE_OPTIM_ENGINE=numba`` without numba on optimizers with no state yet.)
"""

import warnings

import pytest
import torch

import roundpipe.optim
from roundpipe.optim import backends
from roundpipe.optim.backends import CompileCache, numba_engine
from roundpipe.optim.backends.numba_engine import engine, kernels
from tests._util import (
    RICH_KWARGS,
    assert_bits_equal,
    assert_unchanged,
    groups,
    make_params,
    rp_class,
    set_grads,
    snapshot,
    torch_class,
)

STEPS = 4
OPTIMIZERS = ["Adam", "SGD"]  # SGD with momentum (and nesterov, weight decay): two programs
IMPORT_CAUSE = "simulated: No module named 'numba'"
COMPILE_CAUSE = "simulated: LLVM cannot lower this kernel"


def _no_numba(monkeypatch):
    def refuse():
        raise ImportError(IMPORT_CAUSE)

    monkeypatch.setattr(engine, "import_numba", refuse)


def _no_compile(monkeypatch):
    # the sqrt probe (once per process) compiles a kernel of its own, and would quietly pick the
    # slower sqrt for the whole process if its compilation failed: probe before breaking it
    numba_engine.sqrt_kind()
    monkeypatch.setattr(kernels, "_kernels", CompileCache())  # nothing compiled yet
    calls = []

    def fail(*args, **kwargs):
        calls.append(args)
        raise RuntimeError(COMPILE_CAUSE)

    monkeypatch.setattr(kernels, "_compile", fail)
    return calls


FAILURES = {"import": _no_numba, "compile": _no_compile}


def _runs(name):
    """A roundpipe optimizer on plain ``fast`` and torch's for-loop, on the same parameters."""
    kwargs = RICH_KWARGS[name]
    ours, theirs = make_params(), make_params()
    opt = rp_class(name)(groups(ours), **kwargs)
    assert opt.backend == "fast"
    ref = torch_class(name)(groups(theirs), foreach=False, **kwargs)
    return (opt, ours), (ref, theirs)


def _assert_same_bits(run, ref):
    (opt, ours), (ref_opt, theirs) = run, ref
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert_bits_equal(a.detach(), b.detach(), f"param {i}")
        sa, sb = opt.state[a], ref_opt.state[b]
        assert sorted(sa) == sorted(sb), (i, sorted(sa), sorted(sb))
        for k, vb in sb.items():
            assert_bits_equal(sa[k], vb, f"param {i} state[{k!r}]")


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("failure", list(FAILURES))
def test_fast_falls_back_to_the_torch_engine_with_one_warning(failure, name, monkeypatch):
    calls = FAILURES[failure](monkeypatch)
    run, ref = _runs(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            for opt, params in (run, ref):
                set_grads(params, step)
                opt.step()
            _assert_same_bits(run, ref)
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    msg = str(ours[0].message)
    assert msg.startswith("roundpipe.optim backend='fast': the numba engine ")
    assert "stepping with the torch engine instead" in msg
    backend = backends.get("fast")
    if failure == "import":
        assert f"cannot be imported (ImportError: {IMPORT_CAUSE})" in msg
        assert "Fix: to step at full speed, pip install numba" in msg
        assert backend.engine() == "torch"
        assert backend.exact  # the torch engine: bit for bit the for-loop
    else:
        assert f"cannot compile a kernel (RuntimeError: {COMPILE_CAUSE})" in msg
        assert "set backend='fast:torch' to silence this" in msg and "\nprogram:\n" in msg
        assert calls, "no kernel was compiled"
        # every program the steps ran failed once, and runs on the torch engine from then on
        failed = list(backend._failed)
        assert len(calls) == len(failed) >= 1
        assert all(backend.engine(p) == "torch" for p in failed)
        assert backend.engine() == "numba"  # numba itself imports; other programs may compile


def _with_state(name, backend):
    """A roundpipe optimizer on ``backend`` holding the state of one torch.optim step, and the
    gradients of its next step."""
    kwargs = RICH_KWARGS[name]
    theirs, ours = make_params(), make_params()
    ref = torch_class(name)(groups(theirs), foreach=False, **kwargs)
    set_grads(theirs, 0)
    ref.step()
    for p, q in zip(ours, theirs, strict=True):
        p.data.copy_(q.detach())
    opt = rp_class(name)(groups(ours), backend=backend, **kwargs)
    opt.load_state_dict(ref.state_dict())
    set_grads(ours, 1)
    return opt


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("failure", list(FAILURES))
def test_fast_numba_raises_before_modifying_anything(failure, name, monkeypatch):
    opt = _with_state(name, "fast:numba")  # made where numba works
    assert opt.state and all(opt.state[p] for p in opt.state)
    monkeypatch.setattr(backends, "_instances", {})  # a fresh backend object meets the failure
    FAILURES[failure](monkeypatch)
    before = snapshot(opt)
    error = ImportError if failure == "import" else numba_engine.KernelCompileError
    cause = IMPORT_CAUSE if failure == "import" else COMPILE_CAUSE
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, so no warning either
        for _ in range(2):  # and again: the failure is not remembered as a success
            with pytest.raises(error, match=cause):
                opt.step()
            assert_unchanged(opt, before)
    assert opt.backend == "fast:numba"


def test_fallback_warns_once_per_cause_not_per_optimizer(monkeypatch):
    _no_numba(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in OPTIMIZERS:
            (opt, params), _ = _runs(name)
            for step in range(2):
                set_grads(params, step)
                opt.step()
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    # fast:torch never tries numba: no warning
    p = torch.nn.Parameter(torch.ones(3))
    opt = roundpipe.optim.Adam([p], backend="fast:torch")
    p.grad = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
