"""Code generation (``numba_engine/codegen.py``, ``lowering.py``): the generated kernels' shape
(one parallel region; every input read once and every target written once per pass; no float
literal), fused multiply-adds exactly where torch fuses, and, compiled without them, the
numexpr engine's formulas bit for bit (numba contracts nothing on its own).
"""

import io
import token
import tokenize

import numpy as np
import pytest
import torch

from roundpipe.optim.backends import numba_engine, numexpr_engine
from roundpipe.optim.spec.ir import Call, ProgramBuilder, add, walk

from ._helpers import INPUTS, LARGE, SCALARS, every_function_program, inputs


@pytest.mark.parametrize("w", [0.1, 0.9], ids=["lerp-small", "lerp-large"])
def test_without_fma_and_vml_the_kernel_is_the_numexpr_engine_bit_for_bit(w):
    """Compiled with no fused multiply-add and run with the correctly rounded sqrt
    (``sqrt_routine=0``), the kernel computes numexpr_engine's formulas in float32 with the same
    rounding: numba neither contracts nor widens anything by itself."""
    prog = every_function_program()
    sc = dict(SCALARS, w=w, tiny=1e-3)
    weights = numexpr_engine.lerp_weights(prog)
    variant = numexpr_engine.lerp_variant(sc, weights)
    env = numexpr_engine.scalar_env(sc, weights)
    kernel = numba_engine.compile_kernel(prog, variant, fused=frozenset(), sqrt="routine")
    assert "fma(" not in kernel.source.source
    base = inputs(LARGE)
    t_numexpr = {k: v.clone() for k, v in base.items()}
    numexpr_engine.compile_program(prog, variant).run(t_numexpr, env)
    for nthreads in (1, 2):
        t_native = {k: v.clone() for k, v in base.items()}
        kernel.run(t_native, env, nthreads=nthreads, sqrt_routine=0)
        for k in INPUTS:
            torch.testing.assert_close(
                t_native[k], t_numexpr[k], rtol=0, atol=0, equal_nan=True, msg=f"{k} nthreads={nthreads}"
            )


def test_fma_is_used_where_torch_fuses():
    """This torch (vectorized CPU kernels) rounds add-with-alpha, addcmul and lerp once; the
    probe finds that, and the kernels call fma exactly there."""
    fused, exact = numba_engine.torch_fusion()
    assert exact
    assert fused <= {"add", "addcmul", "lerp"}
    src = numba_engine.kernel_source(
        every_function_program(), (True,), fused=frozenset({"add", "addcmul", "lerp"})
    )
    # pass 0 of each of the two loops: add(alpha=wd), lerp, addcmul(value=...) (acc's final
    # value, stored there); the last pass: add(alpha=wd), lerp (buf and g are recomputed, acc is
    # read back) and addcmul(value=1)
    assert sum(_final_pass(src, k).count("fma(") for k in ("kernel_parallel", "kernel_serial")) == 2 * 3
    # two loops, each with one chunk body (a partial chunk runs it on padded copies)
    assert src.count("fma(") == 2 * (3 + 3)
    assert "from roundpipe.optim.backends.numba_engine.intrinsics import f32ptr, fma, call_sqrt_at" in src


def _kernel_lines(src, name):
    body = src.split(f"def {name}(", 1)[1]
    return body.split("\ndef ", 1)[0].splitlines()


def _passes(src, name):
    """The element loops of a kernel, as lists of stripped lines (one per pass): those over a
    slice (``range(count)``) or over a chunk of a program with a sqrt (``range(SQRT_CHUNK)``)."""
    passes, current, depth = [], None, 0
    for line in _kernel_lines(src, name):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped in ("for i in range(count):", f"for i in range({numba_engine.SQRT_CHUNK}):"):
            current, depth = [], indent
            passes.append(current)
        elif current is not None and stripped and indent > depth:
            current.append(stripped)
        else:
            current = None
    return passes


def _final_pass(src, name):
    return "\n".join(_passes(src, name)[-1])


def test_generated_source_reads_once_writes_once_and_has_no_literals():
    """One parallel region; every target is written once per chunk, stores last in their pass:
    pass 0 (the sqrt's argument) stores the targets whose final value it computes (here acc),
    the last pass the others; each pass reads each array at most once."""
    prog = every_function_program()
    ks = numba_engine.generate(prog, (False,), fused=frozenset({"add"}))
    par, ser = ks.source.split("def kernel_parallel(", 1)[1].split("def kernel_serial(")
    assert par.splitlines()[1].strip() == "for thread in prange(nthreads):"  # one parallel region
    # the loops' function asks for 512-bit vectors (where the target has AVX-512)
    assert par.splitlines()[2].strip() == ser.splitlines()[2].strip() == "wide_vectors()"
    assert ser.splitlines()[1].strip() == "for thread in range(nthreads):"
    assert par.splitlines()[2:] == ser.splitlines()[2:] + ["", ""]  # the same loop body
    passes = _passes(ks.source, "kernel_serial")
    n_sqrt = sum(
        isinstance(node, Call) and node.fn == "sqrt" for st in prog.statements for node in walk(st.expr)
    )
    assert n_sqrt == 1 and len(passes) == 1 + n_sqrt + 1  # argument pass, sqrt (fallback loop), last
    first, last = passes[0], passes[-1]
    chunk = numba_engine.SQRT_CHUNK
    for i, name in enumerate(prog.tensors):
        array, address = f"view{i}_{name}", f"addr{i}_{name}"
        writes = 0
        for lines in (first, last):
            reads = [ln for ln in lines if ln.endswith(f"= {array}[i]") or f"= {array}[i]" in ln]
            w = [ln for ln in lines if ln.startswith(f"{array}[i] =")]
            assert len(reads) <= 1 and sum(array in ln for ln in lines) == len(reads) + len(w), name
            writes += len(w)
        assert writes == (1 if name in prog.targets else 0), name
        # the chunk's own view (from index 0: no wraparound code, so LLVM vectorizes) of the
        # constant SQRT_CHUNK elements (no run-time trip count) at the slice, or for a partial
        # chunk at a zero-padded copy, which is copied back if written
        binds = [ln.strip() for ln in ser.splitlines() if ln.strip().startswith(f"{array} = carray(")]
        assert binds == [f"{array} = carray(f32ptr({address}), {chunk})"], name
        lines = [ln.strip() for ln in ser.splitlines()]
        assert f"{address} = addresses[{i}, param_index] + 4 * (start + chunk_start)" in lines, name
        # every line of the chunk PREFETCH_CHUNKS ahead is prefetched
        assert f"prefetch4({address} + {4 * chunk * numba_engine.PREFETCH_CHUNKS})" in lines, name
        padded = f"pad{i}_{name}"
        pad = [
            ln
            for ln in lines
            if ln == f"{address} = pad_copy({padded}, {address}, 4 * chunk_count, {4 * chunk})"
        ]
        back = [
            ln
            for ln in lines
            if ln.startswith(f"pad_copy(addresses[{i}, param_index] + 4 * (start + chunk_start), ")
        ]
        assert len(pad) == 1 and len(back) == (name in prog.targets), name
    assert any(ln.startswith("view3_acc[i] =") for ln in first)  # acc's final value: stored in pass 0
    for lines in (first, last):
        stores = [ln for ln in lines if ln.startswith(("view", "args0[i]")) and "[i] =" in ln]
        assert lines[-len(stores) :] == stores  # stores last
    # numba types a Python float literal as float64: every float is a float32 read from scalar_rows; the
    # only literals are integers (indices, the chunk size)
    numbers = [
        t.string for t in tokenize.generate_tokens(io.StringIO(ks.source).readline) if t.type == token.NUMBER
    ]
    assert all(n.isdigit() for n in numbers), numbers
    assert ks.consts and all(type(c) is np.float32 for c in ks.consts)


def test_a_program_without_sqrt_is_one_pass():
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), add(b.tensor("param"), b.tensor("grad"), alpha=b.s.neg_lr))
    src = numba_engine.generate(b.build(), (), fused=frozenset()).source
    (only,) = _passes(src, "kernel_serial")
    assert "view0_param[i] = val0_param_1" in only and "call_sqrt" not in src
