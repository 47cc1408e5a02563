"""The numba engine (``backends/numba_engine.py``, ``backend="fast"``'s default): spec programs
compiled by numba into one loop.

* every optimizer, with a few option combinations, over 12 steps on float32 and complex64
  parameters of every size class (empty, one element, batched small ones, large ones stepped
  directly): bit for bit ``torch.optim``'s for-loop and the ``reference`` backend (torch's
  rounding, fused multiply-adds and torch's own sqrt routine included), where the engine's
  probes say it models this torch exactly (``exact``);
* a program that uses every IR function, with NaN, inf and signed zeros: bit for bit equal to
  the reference backend, and, compiled without fused multiply-adds, to the numexpr engine (the
  same formulas; numba contracts nothing on its own);
* threads (the serial loop on one thread and on small tensors, the parallel one otherwise, with
  equal results; a forked child steps on one thread), the on-disk kernel cache (a second process
  compiles nothing and finds torch's thread count unchanged), the fallback to in-memory
  compilation when the cache cannot be written, and the ImportError without numba.

Kernels are cached in a temporary directory (``ROUNDPIPE_CACHE_DIR``) for this module.
"""

import functools
import io
import json
import os
import subprocess
import sys
import textwrap
import time
import token
import tokenize
import warnings

import numba  # noqa: E402  (a dependency of roundpipe)
import numpy as np
import pytest
import torch

import roundpipe.optim  # noqa: E402
from roundpipe.optim import backends  # noqa: E402
from roundpipe.optim.backends import fast, numba_engine, numexpr_engine  # noqa: E402
from roundpipe.optim.spec.ir import (  # noqa: E402
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
from tests._util import OPTIMIZER_NAMES, RICH_KWARGS, assert_bits_equal, rp_class, torch_class  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(numba_engine.CACHE_ENV_VAR, str(tmp_path_factory.mktemp("roundpipe-cache")))
        yield


def _engine():
    """The numba engine of backend="fast:numba"."""
    return backends.get("fast:numba").numba_engine()


def _exact():
    """Whether the engine models this torch's rounding exactly (it measures it: torch_fusion,
    torch_sqrt)."""
    return _engine().exact


def assert_bits(a, b, msg=""):
    """Equal bit for bit (a NaN equals any NaN: payloads are not specified)."""
    a, b = a.detach(), b.detach()
    if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b):
        return  # the common case, quickly (torch.equal is False where there are NaNs)
    if _exact():
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{msg}: {m}")
    else:  # a torch that rounds in a way the engine does not model: only close
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True, msg=lambda m: f"{msg}: {m}")


# ---------------------------------------------------------------------------------------------
# the optimizers against torch.optim and the reference backend

LARGE = fast.SMALL_NUMEL + 5
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


# ---------------------------------------------------------------------------------------------
# one program with every function, and edge values

INPUTS = ("param", "grad", "buf", "acc")


def _every_function_program():
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
    old = b.let("old", param)  # a snapshot: later writes to param do not change it
    b.assign(
        param, addcmul(param, grad, grad, value=1.0) + add(old, buf, alpha=-1.0) + add(old, buf, alpha=1.0)
    )
    b.assign(buf, old * 2.0)
    return b.build()


SCALARS = dict(
    wd=0.1, beta=0.9, one_minus_beta=0.1, eps=1e-8, one=1.0, lo=-0.3, hi=0.3, neg_lr=-0.01, lr=0.01
)


def _inputs(n=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {k: torch.randn(n, generator=g) for k in INPUTS}
    t["acc"] = t["acc"].abs()
    special = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-45, -3e38, 0.5, -2.0]
    for j, k in enumerate(INPUTS):
        for i, v in enumerate(special):
            t[k][10 * j + i] = v
    return t


def _run(backend_name, prog, t, sc):
    backends.get(backend_name).run(prog, sc, {k: [v] for k, v in t.items()})


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("w", [0.1, 0.9], ids=["lerp-small", "lerp-large"])
@pytest.mark.parametrize("n", [1, 3, 1000, LARGE])
def test_every_function_bit_for_bit(w, n, nthreads, monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_OPTIM_NUM_THREADS", str(nthreads))
    prog = _every_function_program()
    sc = dict(SCALARS, w=w, tiny=1e-3)
    base = _inputs(max(n, 40))
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


@pytest.mark.parametrize("w", [0.1, 0.9], ids=["lerp-small", "lerp-large"])
def test_without_fma_and_vml_the_kernel_is_the_numexpr_engine_bit_for_bit(w):
    """Compiled with no fused multiply-add and run with the correctly rounded sqrt
    (``sqrt_fn=0``), the kernel computes numexpr_engine's formulas in float32 with the same
    rounding: numba neither contracts nor widens anything by itself."""
    prog = _every_function_program()
    sc = dict(SCALARS, w=w, tiny=1e-3)
    weights = numexpr_engine.lerp_weights(prog)
    variant = numexpr_engine.lerp_variant(sc, weights)
    env = numexpr_engine.scalar_env(sc, weights)
    kernel = numba_engine.compile_kernel(prog, variant, fused=frozenset(), sqrt="routine")
    assert "fma(" not in kernel.source.source
    base = _inputs(LARGE)
    t_numexpr = {k: v.clone() for k, v in base.items()}
    numexpr_engine.compile_program(prog, variant).run(t_numexpr, env)
    for nthreads in (1, 2):
        t_native = {k: v.clone() for k, v in base.items()}
        kernel.run(t_native, env, nthreads=nthreads, sqrt_fn=0)
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
        _every_function_program(), (True,), fused=frozenset({"add", "addcmul", "lerp"})
    )
    # pass 0 of each of the two loops: add(alpha=wd), lerp, addcmul(value=...) (acc's final
    # value, stored there); the last pass: add(alpha=wd), lerp (buf and g are recomputed, acc is
    # read back) and addcmul(value=1)
    assert sum(_final_pass(src, k).count("fma(") for k in ("kernel_parallel", "kernel_serial")) == 2 * 3
    # two loops, each with one block body (a partial block runs it on padded copies)
    assert src.count("fma(") == 2 * (3 + 3)
    assert "from roundpipe.optim.backends.numba_engine import f32ptr, fma, call_sqrt_at" in src


def _kernel_lines(src, name):
    body = src.split(f"def {name}(", 1)[1]
    return body.split("\ndef ", 1)[0].splitlines()


def _passes(src, name):
    """The element loops of a kernel, as lists of stripped lines (one per pass): those over a
    slice (``range(m)``) or over a block of a program with a sqrt (``range(SQRT_BLOCK)``)."""
    passes, current, depth = [], None, 0
    for line in _kernel_lines(src, name):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped in ("for i in range(m):", f"for i in range({numba_engine.SQRT_BLOCK}):"):
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
    """One parallel region; every target is written once per block, stores last in their pass:
    pass 0 (the sqrt's argument) stores the targets whose final value it computes (here acc),
    the last pass the others; each pass reads each array at most once."""
    prog = _every_function_program()
    ks = numba_engine.generate(prog, (False,), fused=frozenset({"add"}))
    par, ser = ks.source.split("def kernel_parallel(", 1)[1].split("def kernel_serial(")
    assert par.splitlines()[1].strip() == "for w in prange(nthreads):"  # one parallel region
    # the loops' function asks for 512-bit vectors (where the target has AVX-512)
    assert par.splitlines()[2].strip() == ser.splitlines()[2].strip() == "wide_vectors()"
    assert ser.splitlines()[1].strip() == "for w in range(nthreads):"
    assert par.splitlines()[2:] == ser.splitlines()[2:] + ["", ""]  # the same loop body
    passes = _passes(ks.source, "kernel_serial")
    n_sqrt = sum(
        isinstance(node, Call) and node.fn == "sqrt" for st in prog.statements for node in walk(st.expr)
    )
    assert n_sqrt == 1 and len(passes) == 1 + n_sqrt + 1  # argument pass, sqrt (fallback loop), last
    first, last = passes[0], passes[-1]
    block = numba_engine.SQRT_BLOCK
    for i, name in enumerate(prog.tensors):
        array = f"t{i}_{name}"
        writes = 0
        for lines in (first, last):
            reads = [ln for ln in lines if ln.endswith(f"= {array}[i]") or f"= {array}[i]" in ln]
            w = [ln for ln in lines if ln.startswith(f"{array}[i] =")]
            assert len(reads) <= 1 and sum(array in ln for ln in lines) == len(reads) + len(w), name
            writes += len(w)
        assert writes == (1 if name in prog.targets else 0), name
        # the block's own view (from index 0: no wraparound code, so LLVM vectorizes) of the
        # constant SQRT_BLOCK elements (no run-time trip count) at the slice, or for a partial
        # block at a zero-padded copy, which is copied back if written
        binds = [ln.strip() for ln in ser.splitlines() if ln.strip().startswith(f"{array} = carray(")]
        assert binds == [f"{array} = carray(f32ptr(a{i}), {block})"], name
        lines = [ln.strip() for ln in ser.splitlines()]
        assert f"a{i} = ptrs[{i}, j] + 4 * (lo + b0)" in lines, name
        # every line of the block PREFETCH_BLOCKS ahead is prefetched
        assert f"prefetch4(a{i} + {4 * block * numba_engine.PREFETCH_BLOCKS})" in lines, name
        pad = [ln for ln in lines if ln == f"a{i} = pad_copy(x{i}, a{i}, 4 * mb, {4 * block})"]
        back = [ln for ln in lines if ln.startswith(f"pad_copy(ptrs[{i}, j] + 4 * (lo + b0), ")]
        assert len(pad) == 1 and len(back) == (name in prog.targets), name
    assert any(ln.startswith("t3_acc[i] =") for ln in first)  # acc's final value: stored in pass 0
    for lines in (first, last):
        stores = [ln for ln in lines if ln.startswith(("t", "q0[i]")) and "[i] =" in ln]
        assert lines[-len(stores) :] == stores  # stores last
    # numba types a Python float literal as float64: every float is a float32 read from sv; the
    # only literals are integers (indices, the block size)
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
    assert "t0_param[i] = v0_param_1" in only and "call_sqrt" not in src


def _random_floats(n, seed=0):
    """``n`` float32 of uniformly random bit patterns (every sign, exponent and class), plus
    the probe's values."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    return torch.cat([bits.to(torch.int32).view(torch.float32), numba_engine._probe_values()])


def _root_inputs(seed=0):
    """What a sqrt test takes: 768 Ki positive normal float32 from 2**-72 to 2**127 (exponents
    uniform: the emulations' own path, run sixteen lanes at a time), then 256 Ki random bit
    patterns and the probe's values (lanes handed on to the routine), with block remainders."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.empty(3 << 18).uniform_(-50.0, 88.0, generator=gen).exp()
    x = torch.cat([normal, _random_floats(1 << 18, seed)])
    return x[: x.numel() - x.numel() % numba_engine.SQRT_BLOCK - 7]


@pytest.mark.parametrize("kind", numba_engine.SQRT_KINDS)
def test_sqrt_is_torchs(kind):
    """The probe picks the routine torch's sqrt runs (on x86-64 MKL builds, vmsSqrt) and, where
    it finds one, an emulation of MKL's kernel for this CPU; the kernels' sqrt then equals
    torch.sqrt bit for bit (NaNs by position), blocks and remainders included, on a million
    floats (``_root_inputs``). (Checked once over all 2**32 float32 for the SSE emulation on an AMD
    EPYC: no difference.)"""
    address, what, exact = numba_engine.torch_sqrt()
    assert exact, what
    assert bool(address) == ("vmsSqrt" in what)
    chosen = numba_engine.sqrt_kind()
    assert chosen in numba_engine.SQRT_KINDS
    if kind != "routine" and kind != chosen:
        pytest.skip(f"torch.sqrt here is not the {kind} sequence (the probe chose {chosen})")
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), sqrt(b.tensor("grad")))
    kernel = numba_engine.compile_kernel(b.build(), (), sqrt=kind)
    x = _root_inputs()
    out = torch.zeros_like(x)
    kernel.run({"param": out, "grad": x}, {})
    assert_bits_equal(out, torch.sqrt(x), f"sqrt {kind}")


# MKL's float32 HA sqrt kernel that each emulation reproduces, by its symbol's ISA suffix
_MKL_KERNELS = {"emulated": "EX", "emulated-avx": "H8", "emulated-fma": "L9", "emulated-avx512": "Z0"}


def _mkl_kernel(suffix):
    """MKL's own ``mkl_vml_kernel_sSqrt_<suffix>HAynn`` in the loaded libtorch_cpu (a local
    symbol: its address is vmsSqrt's, exported, plus the distance ``nm`` reads between the two),
    as a ctypes function ``(n, src, dst)``; or None (no nm, no such symbol, not MKL)."""
    import ctypes
    import shutil

    vms = numba_engine._vml_sqrt_address()
    nm = shutil.which("nm")
    if not vms or nm is None:
        return None
    symbols = _sqrt_symbols(nm)
    base, kernel = symbols.get("vmsSqrt"), symbols.get(f"mkl_vml_kernel_sSqrt_{suffix}HAynn")
    if base is None or kernel is None:
        return None
    return ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p)(vms - base + kernel)


@functools.lru_cache(maxsize=1)
def _sqrt_symbols(nm) -> dict:
    """libtorch_cpu's sqrt symbols (name -> offset), read once (nm takes seconds on it)."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    out = subprocess.run([nm, lib], capture_output=True, text=True, check=False).stdout
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "Tt" and (parts[2] == "vmsSqrt" or "_sSqrt_" in parts[2]):
            found[parts[2]] = int(parts[0], 16)
    return found


@pytest.mark.parametrize("kind", sorted(_MKL_KERNELS))
def test_sqrt_emulation_is_mkls_kernel(kind):
    """Each emulation equals the MKL kernel it reads (called directly, whatever MKL would pick
    on this CPU) bit for bit on a million floats (``_root_inputs``), on every CPU that has the
    emulation's instructions: so a kind the probe does not pick here is still checked (the
    AVX-512 one was also checked over all 2**32 float32 on an AMD EPYC with AVX-512, and against
    torch.sqrt on an Intel Xeon that picks it: equal)."""
    if kind not in numba_engine._probe_order():
        pytest.skip(f"this CPU lacks {kind}'s instructions")
    mkl = _mkl_kernel(_MKL_KERNELS[kind])
    if mkl is None:
        pytest.skip("no MKL sqrt kernels found in libtorch_cpu (or no nm)")
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), sqrt(b.tensor("grad")))
    kernel = numba_engine.compile_kernel(b.build(), (), sqrt=kind)
    x = _root_inputs()
    out, want = torch.zeros_like(x), torch.zeros_like(x)
    mkl(x.numel(), x.data_ptr(), want.data_ptr())
    # the lanes an emulation hands on go to the same kernel
    kernel.run({"param": out, "grad": x}, {}, 1, _address(mkl))
    assert_bits_equal(out, want, f"sqrt {kind} vs MKL's {_MKL_KERNELS[kind]} kernel")


def _address(fn) -> int:
    import ctypes

    return ctypes.cast(fn, ctypes.c_void_p).value


def test_probe_order_follows_numba_target(monkeypatch):
    """The sqrt probe compiles only emulations whose instructions numba's target has (LLVM
    aborts the process on one it lacks): the host's, or those NUMBA_CPU_FEATURES lists when
    NUMBA_CPU_NAME names another target."""
    monkeypatch.setattr(numba.config, "CPU_NAME", "generic")
    monkeypatch.setattr(numba.config, "CPU_FEATURES", None)
    assert numba_engine._probe_order() == []
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+sse,+sse2,+avx,-avx512f")
    assert numba_engine._probe_order() == ["emulated-avx", "emulated"]
    monkeypatch.setattr(numba_engine, "_cpu_vendor", lambda: "GenuineIntel")
    # the AVX-512 emulation takes vrsqrt14ps on zmm registers: AVX512F
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+sse,+avx,+fma,-avx512f,+avx512vl")
    assert numba_engine._probe_order() == ["emulated-avx", "emulated", "emulated-fma"]
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+sse,+avx,+fma,+avx512f")
    assert numba_engine._probe_order() == ["emulated-avx512", "emulated-avx", "emulated", "emulated-fma"]


def test_kernel_types_are_float32():
    prog = _every_function_program()
    k = _engine().kernel(prog, (True,))
    t = _inputs(numba_engine.PARALLEL_MIN_NUMEL)
    sc = dict(SCALARS, w=0.1, tiny=1e-3)
    for nthreads in (1, 2):
        k.run(t, numexpr_engine.scalar_env(sc, numexpr_engine.lerp_weights(prog)), nthreads=nthreads)
    for dispatcher in k.dispatchers:
        for sig in dispatcher.signatures:
            sv = sig[3]
            assert sv.dtype == numba.float32 and sv.ndim == 2, sig
            assert sig[2].dtype == numba.int64, sig  # the addresses
            assert sig[1].dtype == numba.int64 and sig[1].ndim == 1, sig  # meta (pack_layout)


def test_work_is_split_evenly_and_small_steps_run_serially(monkeypatch):
    """Every element is in exactly one thread's share, shares differ by at most ALIGN elements
    (plus the last's remainder), and a step with under PARALLEL_MIN_NUMEL elements per thread
    runs fewer threads (the serial loop when that is one)."""
    sizes = [0, 1, 5, 1000, 70000, 33, 100000, 17]
    for nthreads in (1, 2, 3, 8):
        bounds, items = numba_engine.partition(sizes, nthreads)
        assert len(bounds) == nthreads + 1 and bounds[0] == 0 and bounds[-1] == len(items)
        covered = {}
        for j, lo, hi in items.tolist():
            assert 0 <= lo < hi <= sizes[j]
            covered.setdefault(j, []).append((lo, hi))
        for j, n in enumerate(sizes):
            spans = sorted(covered.get(j, []))
            assert sum(hi - lo for lo, hi in spans) == n and all(
                a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)
            )
        shares = [
            sum(items[it, 2] - items[it, 1] for it in range(bounds[w], bounds[w + 1]))
            for w in range(nthreads)
        ]
        assert max(shares[:-1] or [0]) - min(shares[:-1] or [0]) <= numba_engine.ALIGN, shares
    be = _engine()
    monkeypatch.setattr(roundpipe.optim.threads, "_num_threads", 2)
    assert be._threads(2 * numba_engine.PARALLEL_MIN_NUMEL - 1) == 1
    if numba.config.NUMBA_NUM_THREADS >= 2:
        assert be._threads(2 * numba_engine.PARALLEL_MIN_NUMEL) == 2


# ---------------------------------------------------------------------------------------------
# threads


def opt_program(opt):
    """The program an AdamW optimizer's (only) group steps with."""
    group = opt.param_groups[0]
    return opt.spec.program(opt.spec.options(group))


@pytest.mark.parametrize("order", [(1, 2), (2, 1)], ids=["1-then-2", "2-then-1"])
def test_threads_follow_roundpipe_setting_and_results_do_not_change(order, monkeypatch):
    """A one-thread run (the serial kernel) and a two-thread run (the parallel kernel, where
    numba has two threads) of the same steps give the same bits, whichever runs first."""
    monkeypatch.setattr(roundpipe.optim.threads, "_num_threads", None)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3 * LARGE, generator=g)
    grads = [torch.randn(3 * LARGE, generator=g) for _ in range(3)]
    out = {}
    for n in order:
        roundpipe.optim.set_num_threads(n)
        p = torch.nn.Parameter(base.clone())
        opt = roundpipe.optim.AdamW([p], lr=0.01, backend="fast:numba")
        for gr in grads:
            p.grad = gr.clone()
            opt.step()
            if n > 1:
                assert numba.get_num_threads() == min(n, numba.config.NUMBA_NUM_THREADS)
        out[n] = p.detach().clone()
    kernel = _engine().kernel(opt_program(opt), (True,))  # betas[0] = 0.9: a small lerp
    assert kernel.serial.signatures, "one thread: the serial kernel"
    if numba.config.NUMBA_NUM_THREADS > 1:
        assert kernel.parallel.signatures, "two threads: the parallel kernel"
    roundpipe.optim.set_num_threads(None)
    assert set(out) == {1, 2}
    assert_bits_equal(out[1], out[2], "1 thread vs 2 threads")


def test_a_step_on_an_unchanged_plan_repeats_the_launch_and_sees_every_change(monkeypatch):
    """From the third step on (the first builds the plan, the second rebuilds it once the state
    exists), a step whose plan still holds rebinds the last launch (new scalars and gradient
    addresses) instead of preparing it anew; a new learning rate, new gradient tensors, a
    parameter moved by ``.data =``, another thread count and another engine are all seen, and
    every step is bit for bit torch's for-loop."""
    monkeypatch.setattr(roundpipe.optim.threads, "_num_threads", None)
    be = backends.get("fast")
    calls = {"prepare": 0, "rebind": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(be, "prepare", counted("prepare", be.prepare))
    monkeypatch.setattr(be, "rebind", counted("rebind", be.rebind))
    g = torch.Generator().manual_seed(5)
    n = 3 * numba_engine.PARALLEL_MIN_NUMEL  # two threads where two are set
    base = torch.randn(n, generator=g)
    p, q = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    ours = roundpipe.optim.Adam([p], lr=0.01, backend="fast")
    theirs = torch.optim.Adam([q], lr=0.01, foreach=False)

    def step(expect_prepare, expect_rebind):
        grad = torch.randn(n, generator=g)
        p.grad, q.grad = grad.clone(), grad.clone()  # new tensors, new addresses, every step
        before = dict(calls)
        ours.step()
        theirs.step()
        assert_bits(p, q, f"after {calls}")
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert_bits(ours.state[p][k], theirs.state[q][k], k)
        assert calls["prepare"] - before["prepare"] == expect_prepare, calls
        assert calls["rebind"] - before["rebind"] == expect_rebind, calls

    roundpipe.optim.set_num_threads(1)
    step(1, 0)  # builds the plan (and the state)
    step(1, 0)  # rebuilds it: the state now exists
    step(0, 1)  # the launch repeated
    for opt in (ours, theirs):
        opt.param_groups[0]["lr"] = 0.003
    step(0, 1)  # a new learning rate is a new scalar
    p.data = p.data.clone()  # moved: the plan is checked again and rebuilt
    step(1, 0)
    step(0, 1)
    if numba.config.NUMBA_NUM_THREADS >= 2:
        roundpipe.optim.set_num_threads(2)  # another thread count: another kernel
        step(1, 1)
        step(0, 1)
    roundpipe.optim.set_num_threads(1)
    monkeypatch.setenv(fast.ENGINE_ENV_VAR, "torch")  # another engine: prepared anew, each step
    step(1, 1)
    step(1, 1)
    monkeypatch.delenv(fast.ENGINE_ENV_VAR)
    # (the numba engine's last launch is rebound if it ran on one thread, else prepared anew)
    step(0 if numba.config.NUMBA_NUM_THREADS < 2 else 1, 1)
    step(0, 1)
    roundpipe.optim.set_num_threads(None)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_steps_on_one_thread(tmp_path, monkeypatch):
    """After a parallel step, a forked child (one thread there) steps with the serial kernel;
    numba's OpenMP pool, used there, would abort the child."""
    monkeypatch.setattr(roundpipe.optim.threads, "_num_threads", None)
    roundpipe.optim.set_num_threads(2)
    g = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(torch.randn(LARGE, generator=g))
    opt = roundpipe.optim.Adam([p], lr=0.01, backend="fast:numba")
    grads = [torch.randn(LARGE, generator=g) for _ in range(2)]
    p.grad = grads[0]
    opt.step()
    roundpipe.optim.set_num_threads(None)
    out = tmp_path / "child.pt"
    pid = os.fork()
    if pid == 0:  # the child: step, save, exit without running pytest's teardown
        code = 1
        try:
            p.grad = grads[1]
            opt.step()
            torch.save((roundpipe.optim.get_num_threads(), p.detach().clone()), out)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    child_threads, child_param = torch.load(out)
    assert child_threads == 1
    p.grad = grads[1]
    opt.step()
    torch.testing.assert_close(child_param, p.detach(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# the on-disk cache

_LATENCY_SCRIPT = textwrap.dedent(
    """
    import json, os, time, torch
    import roundpipe.optim
    from roundpipe.optim import backends
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (100, 1000, 70000)]
    opt = roundpipe.optim.Adam(params, lr=0.01, weight_decay=0.1, backend="fast:numba")
    for p in params:
        p.grad = torch.randn(p.shape)
    t0 = time.perf_counter()
    opt.step()
    latency = time.perf_counter() - t0
    from roundpipe.optim.backends import numba_engine
    kernels = numba_engine._kernels.values()
    print(json.dumps({
        "latency": latency,
        "hits": sum(sum(d.stats.cache_hits.values()) for k in kernels for d in k.dispatchers),
        "misses": sum(sum(d.stats.cache_misses.values()) for k in kernels for d in k.dispatchers),
        "on_disk": [k.cached_on_disk for k in kernels],
        "param0": params[0].detach()[:4].tolist(),
        "torch_threads": torch.get_num_threads(),
    }))
    """
)


def _first_step(env):
    res = subprocess.run(
        [sys.executable, "-c", _LATENCY_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_")}
    env.update({numba_engine.CACHE_ENV_VAR: str(tmp_path), "ROUNDPIPE_OPTIM_NUM_THREADS": "1"})
    cold = _first_step(env)
    warm = _first_step(env)
    # the step's kernel, and the sqrt probe's (``sqrt_kind``)
    assert cold["on_disk"] == warm["on_disk"] and all(cold["on_disk"]), (cold, warm)
    assert cold["misses"] >= 1 and cold["hits"] == 0, cold
    assert warm["misses"] == 0 and warm["hits"] >= 1, warm
    assert warm["param0"] == cold["param0"]
    # numba's OpenMP pool sets the process's OpenMP thread count when it starts: the step puts
    # torch's back
    assert cold["torch_threads"] == warm["torch_threads"] == 1
    # (no timing assertion: warm < cold held here, but wall time on a shared machine is noise;
    # the cache hits and misses above say that nothing was compiled)
    sources = list((tmp_path / "numba").glob("roundpipe_numba_*.py"))
    assert len(sources) == len(cold["on_disk"])  # one module per kernel, written once
    cached = {p.suffix for p in (tmp_path / "numba" / "__pycache__").iterdir()}
    assert {".nbi", ".nbc"} <= cached


# One problem for the subprocess tests below, run by the children on roundpipe and by the
# parent on torch.optim's for-loop: ``train`` returns a digest of the parameters' and every
# state tensor's bytes after three steps.
_PROBLEM = textwrap.dedent(
    """
    import hashlib
    import torch

    def problem(n_large):
        g = torch.Generator().manual_seed(7)
        shapes = [(100,), (33, 31), (n_large,)]
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
        return params, grads

    def train(opt, params, grads):
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.clone()
            opt.step()
        h = hashlib.sha256()
        for p in params:
            h.update(p.detach().numpy().tobytes())
            for k in sorted(opt.state[p]):
                h.update(k.encode())
                h.update(opt.state[p][k].detach().reshape(-1).numpy().tobytes())
        return h.hexdigest()
    """
)

# argv: optimizer, backend, size of the large parameter, and a directory: when given, the child
# announces itself there (ready-<pid>) and waits for the file "go" before it steps.
_CHILD_SCRIPT = _PROBLEM + textwrap.dedent(
    """
    import json, os, sys, time
    import numba
    import roundpipe.optim
    from roundpipe.optim import backends
    from roundpipe.optim.backends import numba_engine

    name, backend, n_large, meet = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if meet:
        open(os.path.join(meet, f"ready-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(meet, "go")):
            if time.monotonic() > deadline:
                sys.exit("the barrier never opened")
            time.sleep(0.002)
    params, grads = problem(n_large)
    opt = getattr(roundpipe.optim, name)(params, lr=0.01, weight_decay=0.1, backend=backend)
    digest = train(opt, params, grads)
    kernels = numba_engine._kernels.values()
    # read before numba.get_num_threads(), which starts numba's OpenMP pool if no step did:
    # that sets the OpenMP thread count, torch's too
    roundpipe_threads, torch_threads = roundpipe.optim.get_num_threads(), torch.get_num_threads()
    print(json.dumps({
        "digest": digest,
        "hits": sum(sum(d.stats.cache_hits.values()) for k in kernels for d in k.dispatchers),
        "misses": sum(sum(d.stats.cache_misses.values()) for k in kernels for d in k.dispatchers),
        "on_disk": [k.cached_on_disk for k in kernels],
        "parallel": any(k.parallel.signatures for k in kernels),
        "numba_threads": numba.get_num_threads(),
        "numba_max": numba.config.NUMBA_NUM_THREADS,
        "roundpipe_threads": roundpipe_threads,
        "torch_threads": torch_threads,
        "engine": backends.get(opt.backend).engine(),
    }))
    """
)
# a hang detector, not a timing assertion
CHILD_TIMEOUT = 300


def _torch_digest(name, n_large):
    ns = {}
    exec(_PROBLEM, ns)
    params, grads = ns["problem"](n_large)
    return ns["train"](torch_class(name)(params, lr=0.01, weight_decay=0.1, foreach=False), params, grads)


def _child_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_OPTIM_")}
    env.update(extra)
    return env


def _start_child(env, name, backend, n_large, meet=""):
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD_SCRIPT, name, backend, str(n_large), str(meet)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(child, what):
    try:
        out, err = child.communicate(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        raise AssertionError(f"{what}: still running after {CHILD_TIMEOUT} s (a hang?)\n{err}") from None
    assert child.returncode == 0, f"{what}: exit status {child.returncode}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def test_processes_compiling_into_one_empty_cache_at_once(tmp_path):
    """Four processes (DDP ranks, pytest-xdist workers) compile the same AdamW kernel into one
    empty cache directory at the same moment (each waits at a barrier after its imports): all
    succeed with torch's bits; a fifth process then compiles nothing and gets the same bits."""
    cache, meet = tmp_path / "cache", tmp_path / "meet"
    meet.mkdir()
    env = _child_env(**{numba_engine.CACHE_ENV_VAR: str(cache), "ROUNDPIPE_OPTIM_NUM_THREADS": "1"})
    n_large = LARGE
    children = [_start_child(env, "AdamW", "fast", n_large, meet) for _ in range(4)]
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while len(list(meet.glob("ready-*"))) < len(children):
            assert time.monotonic() < deadline, "the children never reached the barrier"
            assert all(c.poll() is None for c in children), [c.communicate()[1] for c in children]
            time.sleep(0.01)
        (meet / "go").touch()
        results = [_finish(c, f"process {i}") for i, c in enumerate(children)]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
    want = _torch_digest("AdamW", n_large)
    for i, res in enumerate(results):
        assert res["engine"] == "numba", (i, res)
        assert res["digest"] == want, (i, res)  # bit for bit torch.optim's for-loop
        assert all(res["on_disk"]) and res["misses"] >= 1, (i, res)
    warm = _finish(_start_child(env, "AdamW", "fast", n_large), "the fifth process")
    assert warm["misses"] == 0 and warm["hits"] >= 1, warm  # nothing compiled: all from the cache
    assert warm["digest"] == want
    # every kernel's module written once, whole; no temporary file left behind
    numba_dir = cache / "numba"
    assert len(list(numba_dir.glob("roundpipe_numba_*.py"))) == len(warm["on_disk"])
    leftovers = [p.name for p in numba_dir.rglob("*") if "tmp" in p.name]
    assert not leftovers, leftovers
    assert {".nbi", ".nbc"} <= {p.suffix for p in (numba_dir / "__pycache__").iterdir()}


HIGH = 2 * (os.cpu_count() or 1) + 1  # above the core count
# (NUMBA_NUM_THREADS, OMP_NUM_THREADS, ROUNDPIPE_OPTIM_NUM_THREADS or None)
# (torch caps its own count at the core count, so roundpipe is also asked for HIGH threads, to
# run numba's pool above it)
THREAD_SETTINGS = [(1, 1, None), (HIGH, HIGH, None), (HIGH, HIGH, HIGH)]


def test_thread_count_environment_below_and_above_the_core_count(tmp_path):
    """``NUMBA_NUM_THREADS`` and ``OMP_NUM_THREADS`` below (1) and above (2 * cores + 1) the
    core count, also with roundpipe asked for more threads than numba's pool has: numba accepts
    a pool larger than the machine, a step runs min(roundpipe's threads, NUMBA_NUM_THREADS) of
    it, and every setting gives torch's bits (no error, crash or hang)."""
    n_large = HIGH * numba_engine.PARALLEL_MIN_NUMEL + 7  # enough work for HIGH threads
    children = []
    for numba_n, omp_n, rp_n in THREAD_SETTINGS:
        env = _child_env(NUMBA_NUM_THREADS=str(numba_n), OMP_NUM_THREADS=str(omp_n))
        if rp_n is not None:
            env["ROUNDPIPE_OPTIM_NUM_THREADS"] = str(rp_n)
        children.append(_start_child(env, "Adam", "fast", n_large))
    try:
        results = [_finish(c, f"settings {s}") for c, s in zip(children, THREAD_SETTINGS, strict=True)]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
    want = _torch_digest("Adam", n_large)
    for (numba_n, omp_n, rp_n), res in zip(THREAD_SETTINGS, results, strict=True):
        setting = f"NUMBA_NUM_THREADS={numba_n} OMP_NUM_THREADS={omp_n} ROUNDPIPE_OPTIM_NUM_THREADS={rp_n}"
        assert res["engine"] == "numba", (setting, res)
        assert res["digest"] == want, (setting, res)
        assert res["numba_max"] == numba_n, (setting, res)
        rp = rp_n if rp_n is not None else res["torch_threads"]
        assert res["roundpipe_threads"] == rp, (setting, res)
        used = min(rp, numba_n)
        assert res["parallel"] == (used > 1), (setting, res)
        if used > 1:
            assert res["numba_threads"] == used, (setting, res)


def test_cache_dir_setting(monkeypatch, tmp_path):
    monkeypatch.setenv(numba_engine.CACHE_ENV_VAR, str(tmp_path / "rp"))
    assert numba_engine.cache_dir() == str(tmp_path / "rp" / "numba")
    monkeypatch.delenv(numba_engine.CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert numba_engine.cache_dir() == str(tmp_path / "xdg" / "roundpipe" / "numba")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert numba_engine.cache_dir() == str(tmp_path / "home" / ".cache" / "roundpipe" / "numba")


def _tiny_program(k):
    """A distinct small program per ``k`` (a new kernel to compile)."""
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), b.tensor("param") * b.s.x + b.tensor("grad") * float(k))
    return b.build()


def _read_only_dir(tmp_path, how):
    if how == "under-a-file":  # no one, root included, can create a directory under a file
        (tmp_path / "file").write_text("")
        return tmp_path / "file" / "cache"
    if os.geteuid() == 0:
        pytest.skip("root can write a read-only directory")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return ro


@pytest.mark.parametrize("how", ["under-a-file", "chmod-555"])
def test_unwritable_cache_dir_compiles_in_memory_and_warns_once(how, tmp_path, monkeypatch):
    numba_engine.sqrt_kind()  # the once-per-process probe (it compiles a kernel of its own) first
    directory = _read_only_dir(tmp_path, how)
    monkeypatch.setenv(numba_engine.CACHE_ENV_VAR, str(directory))
    monkeypatch.setattr(numba_engine, "_warned_readonly", False)
    be = numba_engine.NumbaEngine()
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in (3, 5):
            prog = _tiny_program(k)
            t = {"param": torch.full((10,), 2.0), "grad": torch.full((10,), 0.5)}
            be.run(prog, {"x": 0.5}, {n: [v] for n, v in t.items()})
            results.append(t["param"])
            assert not be.kernel(prog, ()).cached_on_disk
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "cannot write its kernel cache" in messages[0] and numba_engine.CACHE_ENV_VAR in messages[0]
    assert str(directory / "numba") in messages[0]
    assert torch.equal(results[0], torch.full((10,), 2.5)) and torch.equal(results[1], torch.full((10,), 3.5))
    if how == "chmod-555":
        assert list(directory.iterdir()) == []


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


def _conversion_inputs():
    """float32 whose narrowing is hard: every float16/bfloat16 value widened, and each of them
    with the low bits just below, at and just above the halfway point (ties both ways), the
    subnormal and overflow edges, signed zeros and infinities, NaNs with payloads (quiet and
    signalling, both signs), and a million random bit patterns."""
    h = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    widened = torch.cat([h.view(torch.float16).float(), h.view(torch.bfloat16).float()]).view(torch.int32)
    near = [widened + d for d in (0, 1, -1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x7FFF, 0x8000, 0x8001)]
    g = torch.Generator().manual_seed(7)
    rand = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor(
        [0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00001, 0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF, 0x80000000]
        + [0x477FE000, 0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001, 0x387FC000, 0x38800000],
        dtype=torch.int64,
    ).to(torch.int32)
    x = torch.cat([*near, rand, edges])
    pad = -x.numel() % 64  # torch's vectorized loops only, as the engine's kernels see
    return torch.cat([x, torch.zeros(pad, dtype=torch.int32)]).view(torch.float32)


@pytest.mark.parametrize("f16c", [False, True], ids=["integer-sequences", "f16c"])
def test_low_precision_conversions_are_torchs(f16c):
    """The pairing's conversions (``_conversions``: float32 -> bfloat16/float16 bits as
    ``partner.copy_(master)`` rounds, and back as ``.float()`` widens) equal torch's vectorized
    CPU conversions bit for bit on ``_conversion_inputs`` and on all 2**16 bit patterns, in both
    forms: the integer sequences every x86-64 runs and F16C's instructions (where numba's target
    has them). (Checked once over all 2**32 float32 on an Intel Xeon: equal.)"""
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    if f16c and "f16c" not in numba_engine._target_features():
        pytest.skip("numba's target lacks F16C")
    conv = numba_engine._conversions(intrinsic, types, ir, f16c=f16c)
    narrow_bf16, narrow_f16 = conv["narrow_bfloat16"], conv["narrow_float16"]
    widen_bf16, widen_f16 = conv["widen_bfloat16"], conv["widen_float16"]

    @numba.njit
    def narrow(x, bf, hf):
        for i in range(x.size):
            bf[i] = narrow_bf16(x[i])
            hf[i] = narrow_f16(x[i])

    @numba.njit
    def widen(h, bf, hf):
        for i in range(h.size):
            bf[i] = widen_bf16(h[i])
            hf[i] = widen_f16(h[i])

    x = _conversion_inputs()
    bf, hf = torch.empty(x.shape, dtype=torch.int16), torch.empty(x.shape, dtype=torch.int16)
    narrow(x.numpy(), bf.numpy().view(np.uint16), hf.numpy().view(np.uint16))
    # compared as integers: NaNs by their bits too
    assert_bits_equal(bf, x.to(torch.bfloat16).view(torch.int16), "narrow to bfloat16")
    assert_bits_equal(hf, x.to(torch.float16).view(torch.int16), "narrow to float16")
    h = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    wb, wh = torch.empty(h.shape), torch.empty(h.shape)
    widen(h.numpy().view(np.uint16), wb.numpy(), wh.numpy())
    want_b, want_h = h.view(torch.bfloat16).float(), h.view(torch.float16).float()
    assert_bits_equal(wb.view(torch.int32), want_b.view(torch.int32), "widen bfloat16")
    assert_bits_equal(wh.view(torch.int32), want_h.view(torch.int32), "widen float16")
