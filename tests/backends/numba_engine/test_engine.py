"""The engine (``numba_engine/engine.py``, ``backend="fast"``'s default) on whole steps: every
optimizer, with a few option combinations, over 12 steps on float32 and complex64 parameters of
every size class (empty, one element, batched small ones, large ones stepped directly), bit for
bit ``torch.optim``'s for-loop and the ``reference`` backend where the engine's probes say it
models this torch exactly (``exact``); a program that uses every IR function, with NaN, inf and
signed zeros, bit for bit the reference backend; the engine's registration, and the
ImportError without numba.
"""

import inspect
import sys

import pytest
import torch

import roundpipe.optim
from roundpipe.optim import backends
from roundpipe.optim.backends import fast
from tests._util import OPTIMIZER_NAMES, RICH_KWARGS, rp_class, torch_class

from ._helpers import INPUTS, LARGE, SCALARS, assert_bits, every_function_program, inputs, opt_program

# ---------------------------------------------------------------------------------------------
# the optimizers against torch.optim and the reference backend

# (shape, dtype): empty, one element, small ones (batched into flat buffers), large ones
# (stepped directly); complex64 ones of both kinds
LAYOUT = [
    ((LARGE,), torch.float32),
    ((3, 4), torch.float32),
    ((0,), torch.float32),
    ((1,), torch.float32),
    ((7,), torch.float32),
    ((5,), torch.complex64),
    ((LARGE // 2 + 3,), torch.complex64),
]
STEPS = 12
TORCH_TOL = dict(rtol=2e-5, atol=1e-5)

# a few option combinations each: the defaults, every branch on (RICH_KWARGS), and maximize
COMBOS = {name: [{}, RICH_KWARGS[name], {**RICH_KWARGS[name], "maximize": True}] for name in OPTIMIZER_NAMES}
if "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters:  # torch >= 2.7
    COMBOS["Adam"].append(dict(lr=0.01, betas=(0.3, 0.5), weight_decay=0.1, decoupled_weight_decay=True))
COMBOS["SGD"].append(dict(lr=0.01, momentum=0.5, dampening=0.3))
COMBOS["RMSprop"].append(dict(lr=0.01, alpha=0.3, weight_decay=0.1))
CASES = [(name, i) for name in OPTIMIZER_NAMES for i in range(len(COMBOS[name]))]


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape, dtype in LAYOUT]


def _grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape, dtype in LAYOUT]


def _state_tensors(opt, params):
    return [(i, k, v) for i, p in enumerate(params) for k, v in opt.state[p].items()]


@pytest.mark.parametrize(("name", "combo"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_optimizer_matches_torch_and_reference(name, combo, monkeypatch):
    kwargs = COMBOS[name][combo]
    if combo == 1:  # every branch on: the parallel kernels, on 2 threads (else the serial ones)
        monkeypatch.setenv("ROUNDPIPE_OPTIM_NUM_THREADS", "2")
    base = _params(combo)
    runs = {}
    # the reference backend and torch.optim's for-loop: equal bit for bit
    for label in ("torch", "fast:numba", "reference"):
        params = [torch.nn.Parameter(p.clone()) for p in base]
        if label == "torch":
            opt = torch_class(name)(params, foreach=False, **kwargs)
        else:
            opt = rp_class(name)(params, backend=label, **kwargs)
        runs[label] = (opt, params)
    for step in range(STEPS):
        grads = _grads(step)
        for opt, params in runs.values():
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
        (o_n, p_n), (o_t, p_t), (o_r, p_r) = runs["fast:numba"], runs["torch"], runs["reference"]
        s_n, s_t, s_r = (_state_tensors(o, p) for o, p in ((o_n, p_n), (o_t, p_t), (o_r, p_r)))
        assert [(i, k) for i, k, _ in s_n] == [(i, k) for i, k, _ in s_t] == [(i, k) for i, k, _ in s_r]
        for i, (a, c) in enumerate(zip(p_n, p_r, strict=True)):
            assert_bits(a, c, f"step {step} param {i} vs reference")
        for (i, k, a), (_, _, c) in zip(s_n, s_r, strict=True):
            assert_bits(a, c, f"step {step} state[{i}][{k!r}] vs reference")
        for i, (a, b) in enumerate(zip(p_n, p_t, strict=True)):
            assert_bits(a, b, f"step {step} param {i} vs torch")
        for (i, k, a), (_, _, b) in zip(s_n, s_t, strict=True):
            assert_bits(a, b, f"step {step} state[{i}][{k!r}] vs torch")
    for p, g in zip(runs["fast:numba"][1], _grads(STEPS - 1), strict=True):
        assert torch.equal(p.grad, g), "grad written"


def test_one_element_and_empty_parameters_alone():
    """A single 1-element parameter (stepped directly, not batched) and a lone empty one."""
    for shape in ((1,), (0,), (1, 1)):
        p_n, p_t = torch.nn.Parameter(torch.full(shape, 0.5)), torch.nn.Parameter(torch.full(shape, 0.5))
        o_n = roundpipe.optim.Adam([p_n], lr=0.1, backend="fast:numba")
        o_t = torch.optim.Adam([p_t], lr=0.1, foreach=False)
        for step in range(3):
            g = torch.full(shape, 0.25 * (step + 1))
            p_n.grad, p_t.grad = g.clone(), g.clone()
            o_n.step()
            o_t.step()
        torch.testing.assert_close(p_n.detach(), p_t.detach(), **TORCH_TOL)
        if p_n.numel():
            assert p_n.item() != 0.5


def _run(backend_name, prog, t, sc):
    backends.get(backend_name).run(prog, sc, {k: [v] for k, v in t.items()})


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("w", [0.1, 0.9], ids=["lerp-small", "lerp-large"])
@pytest.mark.parametrize("n", [1, 3, 1000, LARGE])
def test_every_function_bit_for_bit(w, n, nthreads, monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_OPTIM_NUM_THREADS", str(nthreads))
    prog = every_function_program()
    sc = dict(SCALARS, w=w, tiny=1e-3)
    base = inputs(max(n, 40))
    base = {k: v[:n].clone() for k, v in base.items()}
    out = {}
    for label in ("fast:numba", "reference"):
        t = {k: v.clone() for k, v in base.items()}
        _run(label, prog, t, sc)
        out[label] = t
    for k in INPUTS:
        assert_bits(out["fast:numba"][k], out["reference"][k], k)
        assert torch.equal(out["fast:numba"][k].isnan(), out["reference"][k].isnan()), k
    assert torch.equal(out["fast:numba"]["grad"].view(torch.int32), base["grad"].view(torch.int32))


# ---------------------------------------------------------------------------------------------
# registration and numba missing


def test_registered_and_selectable(monkeypatch):
    assert {"fast", "fast:numba", "fast:torch", "fast:numexpr", "reference"} == set(backends.NAMES)
    p = torch.nn.Parameter(torch.zeros(3))
    assert roundpipe.optim.SGD([p], lr=0.1, backend="fast:numba").backend == "fast:numba"
    # roundpipe 0.1's name for it
    assert roundpipe.optim.SGD([p], lr=0.1, backend="native").backend == "fast:numba"
    monkeypatch.setenv("ROUNDPIPE_OPTIM_BACKEND", "native")
    assert roundpipe.optim.SGD([p], lr=0.1).backend == "fast:numba"
    monkeypatch.delenv("ROUNDPIPE_OPTIM_BACKEND")
    # the default runs the numba engine
    opt = roundpipe.optim.SGD([p], lr=0.1)
    assert opt.backend == "fast"
    p.grad = torch.ones(3)
    opt.step()
    assert torch.equal(p.detach(), torch.full((3,), -0.1))
    assert backends.get("fast").engine(opt_program(opt)) == "numba"
    # the engine setting does not apply to a named engine
    monkeypatch.setenv(fast.ENGINE_ENV_VAR, "numexpr")
    assert backends.get("fast:numba").engine() == "numba" and backends.get("fast").engine() == "numexpr"


def test_without_numba_fast_numba_raises_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # "import numba" raises ImportError
    monkeypatch.setattr(backends, "_instances", {})
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ImportError, match=r"pip install numba"):
        roundpipe.optim.Adam([p], backend="fast:numba")
    monkeypatch.setenv("ROUNDPIPE_OPTIM_ENGINE", "numba")  # chosen by name: no fallback
    opt = roundpipe.optim.Adam([p])
    p.grad = torch.ones(3)
    with pytest.raises(ImportError, match="numba"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(3)) and not opt.state  # nothing moved
    monkeypatch.delenv("ROUNDPIPE_OPTIM_ENGINE")
    # the other backends do not need it (fast falls back: test_fallback.py)
    assert roundpipe.optim.Adam([p], backend="fast:torch").backend == "fast:torch"
