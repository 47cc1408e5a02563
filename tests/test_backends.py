"""Each backend on its own: both run a program to the same result (the fast backend with each of
its engines), and the numexpr engine's compiler substitutes or materialises lets correctly and
computes in float32."""

import numpy as np
import pytest
import torch

from roundpipe.optim import backends
from roundpipe.optim.backends import fast, numexpr_engine, torch_engine
from roundpipe.optim.spec import SPECS
from roundpipe.optim.spec.ir import (
    FUNCTIONS,
    Call,
    ProgramBuilder,
    abs_,
    add,
    addcdiv,
    addcmul,
    clamp,
    lerp,
    maximum,
    sign,
    sqrt,
    walk,
    where,
)
from tests._util import OPTIMIZER_NAMES, all_programs

INPUTS = ("param", "grad", "buf", "acc")


def _every_function_program():
    """A program that uses every IR function and operator."""
    b = ProgramBuilder(INPUTS)
    s = b.s
    param, grad, buf, acc = (b.tensor(n) for n in INPUTS)
    g = b.let("g", add(grad, param, alpha=s.wd))
    g = b.let("g", where(g > 0.5, -g, where(g <= -2.0, g * 0.5, g)))
    b.assign(buf, lerp(buf, g, s.w))
    b.assign(acc, maximum(addcmul(acc * s.beta, g, g, value=s.one_minus_beta), abs_(buf) / 4.0))
    d = b.let("d", sqrt(acc) + s.eps)
    u = b.let("u", clamp(addcdiv(buf - buf, g, d, value=s.one), s.lo, s.hi))
    b.assign(param, addcdiv(param, buf, d, value=s.neg_lr) - u * s.lr + sign(grad) * s.tiny + 0.5 / (d + 1.0))
    b.assign(param, where(param >= 3.0, 3.0 - param, 1.0 + (param - 1.0)))
    return b.build()


def _inputs(seed, n=257, nan=True):
    g = torch.Generator().manual_seed(seed)
    t = {k: torch.randn(n, generator=g) for k in INPUTS}
    t["acc"] = t["acc"].abs()
    if nan:
        t["grad"][3] = float("nan")
        t["buf"][5] = float("nan")
        t["acc"][7] = float("nan")
        t["grad"][11] = 0.0
        t["grad"][12] = -0.0
    return t


SCALARS = dict(
    wd=0.1, beta=0.9, one_minus_beta=0.1, eps=1e-8, one=1.0, lo=-0.3, hi=0.3, neg_lr=-0.01, lr=0.01
)


def _by_hand(t, sc):
    """The same math in torch ops, written out."""
    param, grad, buf, acc = (t[k].clone() for k in INPUTS)
    g = torch.add(grad, param, alpha=sc["wd"])
    g = torch.where(g > 0.5, -g, torch.where(g <= -2.0, g * 0.5, g))
    buf = torch.lerp(buf, g, sc["w"])
    acc = torch.maximum(torch.addcmul(acc * sc["beta"], g, g, value=sc["one_minus_beta"]), buf.abs() / 4.0)
    d = acc.sqrt() + sc["eps"]
    u = torch.clamp(torch.addcdiv(buf - buf, g, d, value=sc["one"]), sc["lo"], sc["hi"])
    param = torch.addcdiv(param, buf, d, value=sc["neg_lr"]) - u * sc["lr"] + torch.sign(grad) * sc["tiny"]
    param = param + 0.5 / (d + 1.0)
    param = torch.where(param >= 3.0, 3.0 - param, 1.0 + (param - 1.0))
    return dict(param=param, grad=grad, buf=buf, acc=acc)


# (label, backend, fast engine)
ALL_BACKENDS = (
    ("reference", "reference", None),
    ("numba", "fast", "numba"),
    ("numexpr", "fast", "numexpr"),
    ("torch", "fast", "torch"),
)


def _run(backend_name, prog, tensors, scalars):
    """Run ``prog`` through a backend on one set of tensors (name -> tensor)."""
    backends.get(backend_name).run(prog, scalars, {k: [v] for k, v in tensors.items()})


def test_program_uses_every_function():
    prog = _every_function_program()
    used = {n.fn for st in prog.statements for n in walk(st.expr) if isinstance(n, Call)}
    assert used == set(FUNCTIONS), "add the missing functions to _every_function_program"


def _assert_matches(got, expected, msg=""):
    for k in INPUTS:
        torch.testing.assert_close(
            got[k], expected[k], equal_nan=True, rtol=1e-6, atol=1e-7, msg=f"{msg} {k}"
        )
        # NaN positions are exactly torch's (maximum, clamp and where propagate; sign(NaN) = 0)
        assert torch.equal(got[k].isnan(), expected[k].isnan()), f"{msg} {k}"


@pytest.mark.parametrize("w", [0.1, 0.9], ids=["lerp-small", "lerp-large"])
def test_backend_agrees_with_torch(backend, w):
    prog = _every_function_program()
    sc = dict(SCALARS, w=w, tiny=1e-3)
    t = _inputs(0)
    expected = _by_hand(t, sc)
    grad_before = t["grad"].clone()
    _run(backend, prog, t, sc)
    _assert_matches(t, expected)
    torch.testing.assert_close(t["grad"], grad_before, rtol=0, atol=0, equal_nan=True, msg="grad written")


@pytest.mark.parametrize("w", [0.1, 0.9], ids=["lerp-small", "lerp-large"])
def test_numexpr_engine_directly(w):
    prog = _every_function_program()
    sc = dict(SCALARS, w=w, tiny=1e-3)
    weights = numexpr_engine.lerp_weights(prog)
    assert weights == ("w",)
    variant = numexpr_engine.lerp_variant(sc, weights)
    assert variant == (w < 0.5,)
    cp = numexpr_engine.compile_program(prog, variant)
    t = _inputs(0)
    expected = _by_hand(t, sc)
    cp.run(t, numexpr_engine.scalar_env(sc, weights))
    _assert_matches(t, expected)


@pytest.mark.parametrize("chunk", [1, 7, 256, 1 << 18])
def test_torch_engine_directly_in_chunks(chunk):
    prog = _every_function_program()
    sc = dict(SCALARS, w=0.3, tiny=1e-3)
    tp = torch_engine.compile_program(prog)
    t = _inputs(0)
    expected = _by_hand(t, sc)
    tp.run(t, sc, chunk=chunk)
    _assert_matches(t, expected, f"chunk={chunk}")


def test_torch_engine_chunk_follows_the_working_set():
    """Short programs (few operands) get larger chunks, long ones smaller; always within bounds."""
    lo, hi = torch_engine.MIN_CHUNK, torch_engine.MAX_CHUNK
    sizes = [torch_engine.chunk_size(n) for n in range(1, 40)]
    assert sizes == sorted(sizes, reverse=True)
    assert all(lo <= c <= hi and c & (c - 1) == 0 for c in sizes)
    assert sizes[0] == hi and sizes[-1] == lo
    # every chunk of a program's operands fits the working set, unless already at the minimum
    assert all(c * 4 * n <= torch_engine.WORKING_SET or c == lo for n, c in enumerate(sizes, 1))
    # SGD with momentum touches param, grad, momentum_buffer and one scratch slot
    g = dict(lr=0.1, momentum=0.9, dampening=0, weight_decay=0, nesterov=False, maximize=False)
    sgd = SPECS["SGD"].program({**SPECS["SGD"].options(g), "first": False})
    assert torch_engine.compile_program(sgd).chunk == torch_engine.chunk_size(4)


def test_fast_backend_many_tensors_in_one_run(engine):
    """A run over many parameters of mixed sizes (small ones are batched into flat buffers)
    gives each the result it gets alone, written into its own tensor."""
    prog = _every_function_program()
    sc = dict(SCALARS, w=0.2, tiny=1e-3)
    sizes = [1, 33, 0, 5000, fast.SMALL_NUMEL + 3, 2, (4, 5)]
    cols = {k: [] for k in INPUTS}
    expected = []
    for i, n in enumerate(sizes):
        shape = n if isinstance(n, tuple) else (n,)
        numel = int(torch.tensor(shape).prod())
        t = {k: v.reshape(shape) for k, v in _inputs(100 + i, n=numel, nan=numel > 20).items()}
        expected.append({k: v.clone() for k, v in t.items()})
        for k in INPUTS:
            cols[k].append(t[k])
    ptrs = {k: [t.data_ptr() for t in v] for k, v in cols.items()}
    objs = {k: list(v) for k, v in cols.items()}
    cache = {}
    for _ in range(2):  # the second run reuses the cached workspace
        backends.get("fast").run(prog, sc, cols, cache)
        for e in expected:
            _run("reference", prog, e, sc)
    assert cache, "small tensors were not batched through a cached workspace"
    for i, e in enumerate(expected):
        got = {k: cols[k][i] for k in INPUTS}
        for k in INPUTS:
            torch.testing.assert_close(
                got[k], e[k], equal_nan=True, rtol=1e-5, atol=1e-6, msg=f"item {i} {k}"
            )
    for k in INPUTS:
        assert [t.data_ptr() for t in cols[k]] == ptrs[k]
        assert all(a is b for a, b in zip(cols[k], objs[k], strict=True))


def test_empty_tensors(backend):
    prog = _every_function_program()
    t = {k: torch.empty(0) for k in INPUTS}
    _run(backend, prog, t, dict(SCALARS, w=0.1, tiny=0.0))
    assert all(v.numel() == 0 for v in t.values())


@pytest.mark.parametrize("spec_name", OPTIMIZER_NAMES)
def test_every_spec_program_runs_alike_on_all_backends(spec_name, monkeypatch):
    """Every program of every spec compiles for both engines (both lerp branches) and the
    engines agree with the reference backend, with state values in a benign range."""
    spec = SPECS[spec_name]
    gen = torch.Generator().manual_seed(7)
    for _opts, prog in all_programs(spec):
        weights = numexpr_engine.lerp_weights(prog)
        for lerp_value in (0.2, 0.8) if weights else (None,):
            sc = {k: 0.1 + 0.8 * torch.rand((), generator=gen).item() for k in prog.scalars}
            if lerp_value is not None:
                sc.update({w: lerp_value for w in weights})
            base = {n: 0.5 + torch.rand(40, generator=gen) for n in prog.tensors}
            base["grad"] = torch.randn(40, generator=gen)
            out = {}
            for label, name, engine in ALL_BACKENDS:
                if engine:
                    monkeypatch.setenv(fast.ENGINE_ENV_VAR, engine)
                t = {k: v.clone() for k, v in base.items()}
                _run(name, prog, t, sc)
                out[label] = t
            for label in ("numexpr", "torch"):
                for k in prog.tensors:
                    torch.testing.assert_close(
                        out[label][k],
                        out["reference"][k],
                        rtol=1e-5,
                        atol=1e-6,
                        equal_nan=True,
                        msg=lambda m, k=k, label=label, prog=prog: f"{label} {k}\n{prog}\n{m}",
                    )
                assert torch.equal(out[label]["grad"], base["grad"])


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
        t = _inputs(seed, n=64, nan=False)
        _run(name, prog, t, sc)
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
    t0 = _inputs(5, n=64, nan=False)
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
    t0 = _inputs(5, n=64, nan=False)
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
    t0 = _inputs(5, n=64, nan=False)
    _check_all(_run_all(prog, {}, monkeypatch), {"buf": t0["param"] + t0["grad"], "param": t0["param"] * 2.0})


def test_let_of_a_let_is_a_snapshot(monkeypatch):
    b, s, param, grad, buf, acc = _builder()
    a = b.let("a", param * 3.0)
    c = b.let("c", a)
    b.assign(param, param + grad)
    b.assign(buf, c + a)
    prog = b.build()
    t0 = _inputs(5, n=64, nan=False)
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
    t0 = _inputs(5, n=64, nan=False)
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
    t0 = _inputs(5, n=64, nan=False)
    _check_all(
        _run_all(prog, {}, monkeypatch),
        {"buf": (t0["param"] + 0.0) * 2.0 + t0["grad"], "param": t0["param"] * 3.0 * 5.0},
    )


# ---------------------------------------------------------------------------------------------
# float32 throughout


def test_compiled_expressions_are_float32():
    prog = _every_function_program()
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
    prog = _every_function_program()
    cp = numexpr_engine.compile_program(prog, (True,))
    for ev in cp.evals:
        for n in ev.args:
            assert n.startswith(("t_", "s_", "c_", "l_")), (n, ev.source)
        stripped = ev.source
        for n in sorted(ev.args, key=len, reverse=True):
            stripped = stripped.replace(n, "")
        assert not any(ch.isdigit() for ch in stripped), ev.source


def test_scalars_are_applied_as_float32(backend):
    """``param * x`` rounds x to float32 first, as torch does with a Python number."""
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), b.tensor("param") * b.s.x + b.tensor("grad") * 0.1)
    prog = b.build()
    x = 1.0 / 3.0
    p0 = torch.linspace(0.5, 4.0, 1001)
    g0 = torch.linspace(-3.0, 3.0, 1001)
    as_f32 = (p0.numpy() * np.float32(x)) + (g0.numpy() * np.float32(0.1))
    as_f64 = (p0.numpy().astype(np.float64) * x + g0.numpy().astype(np.float64) * 0.1).astype(np.float32)
    assert (as_f32 != as_f64).any(), "test data does not tell float32 from float64 scalars"
    torch.testing.assert_close(p0 * x + g0 * 0.1, torch.from_numpy(as_f32), rtol=0, atol=0)
    t = {"param": p0.clone(), "grad": g0.clone()}
    _run(backend, prog, t, {"x": x})
    assert t["param"].dtype == torch.float32
    np.testing.assert_array_equal(t["param"].numpy(), as_f32)


def test_default_engine_is_numba(monkeypatch):
    """Without ROUNDPIPE_OPTIM_ENGINE the fast backend runs the numba engine; a named engine
    is that engine; a bad setting is rejected before anything runs."""
    monkeypatch.delenv(fast.ENGINE_ENV_VAR, raising=False)
    prog = _every_function_program()
    assert fast.FastBackend().engine(prog) == "numba"
    assert backends.get("fast:numexpr").engine(prog) == "numexpr"
    assert backends.get("fast:torch").engine(prog) == "torch"
    monkeypatch.setenv(fast.ENGINE_ENV_VAR, "torch")
    assert fast.FastBackend().engine(prog) == "torch"
    monkeypatch.setenv(fast.ENGINE_ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="gpu"):
        fast.FastBackend().check_settings()
