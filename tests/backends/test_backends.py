"""Every backend (the fast one with each engine) runs a program to the same result as torch's
ops, and every spec program alike; scalars apply as float32."""

import itertools

import numpy as np
import pytest
import torch

from roundpipe.optim import backends
from roundpipe.optim.backends import fast, numexpr_engine
from roundpipe.optim.spec import SPECS, ir, variants
from roundpipe.optim.spec.ir import FUNCTIONS, Call, ProgramBuilder, walk
from tests._util import OPTIMIZER_NAMES, all_programs

from ._common import (
    ALL_BACKENDS,
    INPUTS,
    SCALARS,
    assert_matches,
    by_hand,
    every_function_program,
    inputs,
    run,
)


def test_program_uses_every_function():
    prog = every_function_program()
    used = {n.fn for st in prog.statements for n in walk(st.expr) if isinstance(n, Call)}
    # dequantize reads an 8-bit state, which only the 8-bit family's blockwise passes have
    # (tests/eightbit, conformance/test_eightbit.py); remainder depends on each element's
    # position in its tensor (test_remainder_takes_its_tail_in_each_tensors_last_elements)
    left = {"dequantize", "remainder"}
    assert used == set(FUNCTIONS) - left, "add the missing functions to every_function_program"


@pytest.mark.parametrize("engine_name", ["numba", "numexpr", "torch"])
def test_remainder_takes_its_tail_in_each_tensors_last_elements(monkeypatch, engine_name):
    """``in_remainder(body, tail)`` under ``with_remainder(program, 8)``: ``tail`` in each
    tensor's last ``numel % 8`` elements, ``body`` elsewhere, on every engine (a fused kernel's
    scalar remainder, ``fused_kernels``); without a step, ``body`` everywhere."""
    monkeypatch.setenv(fast.ENGINE_ENV_VAR, engine_name)
    b = ProgramBuilder(["param", "grad"])
    param, grad = b.tensor("param"), b.tensor("grad")
    b.assign(param, ir.in_remainder(param + grad, param - grad))
    program = b.build()
    sizes = (0, 1, 7, 8, 9, 17, 70001)
    for step, backend in itertools.product((0, 8), ("reference", "fast")):
        params = [torch.zeros(n) for n in sizes]
        grads = [torch.ones(n) for n in sizes]
        prog = variants.with_remainder(program, step) if step else program
        backends.get(backend).run(prog, {}, {"param": params, "grad": grads})
        for p in params:
            want = torch.ones(p.numel())
            if step:
                want[p.numel() - p.numel() % step :] = -1
            assert torch.equal(p, want), (backend, engine_name, step, p.numel())


@pytest.mark.parametrize("w", [0.1, 0.9], ids=["lerp-small", "lerp-large"])
def test_backend_agrees_with_torch(backend, w):
    prog = every_function_program()
    sc = dict(SCALARS, w=w, tiny=1e-3)
    t = inputs(0)
    expected = by_hand(t, sc)
    grad_before = t["grad"].clone()
    run(backend, prog, t, sc)
    assert_matches(t, expected)
    torch.testing.assert_close(t["grad"], grad_before, rtol=0, atol=0, equal_nan=True, msg="grad written")


def test_empty_tensors(backend):
    prog = every_function_program()
    t = {k: torch.empty(0) for k in INPUTS}
    run(backend, prog, t, dict(SCALARS, w=0.1, tiny=0.0))
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
                run(name, prog, t, sc)
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
    run(backend, prog, t, {"x": x})
    assert t["param"].dtype == torch.float32
    np.testing.assert_array_equal(t["param"].numpy(), as_f32)
