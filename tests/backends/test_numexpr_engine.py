"""The numexpr engine (``backends/numexpr_engine.py``): run directly, its compiler's lets
(substituted or materialised), and float32 throughout."""

import numpy as np
import pytest
import torch

from roundpipe.optim.backends import fast, numexpr_engine
from roundpipe.optim.spec.ir import ProgramBuilder

from ._common import INPUTS, SCALARS, assert_matches, by_hand, every_function_program, inputs, run


@pytest.mark.parametrize("w", [0.1, 0.9], ids=["lerp-small", "lerp-large"])
def test_numexpr_engine_directly(w):
    prog = every_function_program()
    sc = dict(SCALARS, w=w, tiny=1e-3)
    weights = numexpr_engine.lerp_weights(prog)
    assert weights == ("w",)
    variant = numexpr_engine.lerp_variant(sc, weights)
    assert variant == (w < 0.5,)
    cp = numexpr_engine.compile_program(prog, variant)
    t = inputs(0)
    expected = by_hand(t, sc)
    cp.run(t, numexpr_engine.scalar_env(sc, weights))
    assert_matches(t, expected)


# ---------------------------------------------------------------------------------------------
# the numexpr engine's compiler: lets


def _builder():
    b = ProgramBuilder(INPUTS)
    return b, b.s, *(b.tensor(n) for n in INPUTS)


def _run_all(prog, sc, monkeypatch, seed=5):
    """Results of the reference backend and of both fast engines."""
    out = {}
    for label, name, engine in (
        ("reference", "reference", None),
        ("numexpr", "fast", "numexpr"),
        ("torch", "fast", "torch"),
    ):
        if engine:
            monkeypatch.setenv(fast.ENGINE_ENV_VAR, engine)
        t = inputs(seed, n=64, nan=False)
        run(name, prog, t, sc)
        out[label] = t
    return out


def _check_all(out, expected):
    for label, t in out.items():
        for k, v in expected.items():
            torch.testing.assert_close(t[k], v, rtol=1e-6, atol=1e-7, msg=f"{label} {k}")


def test_let_substituted_when_inputs_unchanged(monkeypatch):
    b, s, param, grad, buf, acc = _builder()
    g = b.let("g", grad * s.a + param)
    b.assign(buf, buf + g)
    b.assign(param, param - g * s.lr)
    prog = b.build()
    # "g" reads param, which the second assign writes, but that assign *uses* g: it reads the
    # old values before writing, so substitution is still right
    assert numexpr_engine.plan_lets(prog) == set()
    cp = numexpr_engine.compile_program(prog, ())
    assert cp.scratch == ()
    assert [ev.out for ev in cp.evals] == [
        numexpr_engine.tensor_var("buf"),
        numexpr_engine.tensor_var("param"),
    ]
    assert all(numexpr_engine.tensor_var("grad") in ev.args for ev in cp.evals)
    t0 = inputs(5, n=64, nan=False)
    g_ref = t0["grad"] * 0.5 + t0["param"]
    _check_all(
        _run_all(prog, dict(a=0.5, lr=0.1), monkeypatch),
        {"buf": t0["buf"] + g_ref, "param": t0["param"] - g_ref * 0.1},
    )


def test_let_materialised_when_input_overwritten_before_use(monkeypatch):
    b, s, param, grad, buf, acc = _builder()
    old = b.let("old", buf * 2.0)
    b.assign(buf, buf + grad)
    b.assign(param, param + old * s.lr)
    prog = b.build()
    assert numexpr_engine.plan_lets(prog) == {"old"}
    cp = numexpr_engine.compile_program(prog, ())
    assert cp.scratch == ("old",)
    assert cp.evals[0].out == "l_old"
    assert "l_old" in cp.evals[-1].args
    t0 = inputs(5, n=64, nan=False)
    _check_all(
        _run_all(prog, dict(lr=0.25), monkeypatch),
        {"param": t0["param"] + (t0["buf"] * 2.0) * 0.25, "buf": t0["buf"] + t0["grad"]},
    )


def test_let_of_a_bare_tensor_is_a_snapshot(monkeypatch):
    b, s, param, grad, buf, acc = _builder()
    old = b.let("old", param)
    b.assign(param, param * 2.0)
    b.assign(buf, old + grad)
    prog = b.build()
    assert numexpr_engine.plan_lets(prog) == {"old"}
    t0 = inputs(5, n=64, nan=False)
    _check_all(_run_all(prog, {}, monkeypatch), {"buf": t0["param"] + t0["grad"], "param": t0["param"] * 2.0})


def test_let_of_a_let_is_a_snapshot(monkeypatch):
    b, s, param, grad, buf, acc = _builder()
    a = b.let("a", param * 3.0)
    c = b.let("c", a)
    b.assign(param, param + grad)
    b.assign(buf, c + a)
    prog = b.build()
    t0 = inputs(5, n=64, nan=False)
    _check_all(
        _run_all(prog, {}, monkeypatch), {"buf": t0["param"] * 3.0 * 2.0, "param": t0["param"] + t0["grad"]}
    )


def test_let_reads_are_transitive(monkeypatch):
    """``c`` reads param through the substituted let ``a``: it must be materialised."""
    b, s, param, grad, buf, acc = _builder()
    a = b.let("a", param * 2.0)
    c = b.let("c", a + grad)
    b.assign(param, param + grad)
    b.assign(buf, buf + c)
    prog = b.build()
    assert numexpr_engine.plan_lets(prog) == {"c"}
    t0 = inputs(5, n=64, nan=False)
    _check_all(
        _run_all(prog, {}, monkeypatch),
        {"buf": t0["buf"] + (t0["param"] * 2.0 + t0["grad"]), "param": t0["param"] + t0["grad"]},
    )


def test_materialised_let_is_read_from_its_buffer(monkeypatch):
    """A let over a materialised let reads the snapshot, not the overwritten tensor."""
    b, s, param, grad, buf, acc = _builder()
    old = b.let("old", param + 0.0)
    b.assign(param, param * 3.0)
    later = b.let("later", old * 2.0)
    b.assign(param, param * 5.0)
    b.assign(buf, later + grad)
    prog = b.build()
    assert numexpr_engine.plan_lets(prog) == {"old"}
    t0 = inputs(5, n=64, nan=False)
    _check_all(
        _run_all(prog, {}, monkeypatch),
        {"buf": (t0["param"] + 0.0) * 2.0 + t0["grad"], "param": t0["param"] * 3.0 * 5.0},
    )


# ---------------------------------------------------------------------------------------------
# float32 throughout


def test_compiled_expressions_are_float32():
    prog = every_function_program()
    for variant in ((True,), (False,)):
        cp = numexpr_engine.compile_program(prog, variant)
        assert cp.evals
        for ev in cp.evals:
            sig = ev.func.signature
            sig = sig.decode() if isinstance(sig, bytes) else sig
            assert set(sig) == {"f"}, (ev.source, sig)
            assert len(sig) == len(ev.args)
            args = [np.ones(4, dtype=np.float32) for _ in ev.args]
            assert ev.func(*args).dtype == np.float32, ev.source
        assert cp.consts and all(type(v) is np.float32 for v in cp.consts.values())
    env = numexpr_engine.scalar_env(dict(SCALARS, w=0.3, tiny=1.0), ("w",))
    assert env and all(type(v) is np.float32 for v in env.values())


def test_compiled_source_has_no_number_literals():
    """numexpr upcasts literal numbers to float64: constants must be float32 variables."""
    prog = every_function_program()
    cp = numexpr_engine.compile_program(prog, (True,))
    for ev in cp.evals:
        for n in ev.args:
            assert n.startswith(("t_", "s_", "c_", "l_")), (n, ev.source)
        stripped = ev.source
        for n in sorted(ev.args, key=len, reverse=True):
            stripped = stripped.replace(n, "")
        assert not any(ch.isdigit() for ch in stripped), ev.source
