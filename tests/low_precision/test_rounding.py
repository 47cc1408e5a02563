"""How torch rounds bfloat16 and float16 ops, and the engines that reproduce it
(``backends/low_precision.py``, ``backends/formulas.py``): torch's chunks and scalar tails
against torch itself at several thread counts, the probe of its formulas, the numba engine's
items cut at the tails, and a program of every IR function on both dtypes, every engine
against the reference backend bit for bit (NaN, infinities, signed zeros, subnormals, values
past the largest float16)."""

import platform

import numpy as np
import pytest
import torch

from roundpipe.optim import backends
from roundpipe.optim.backends import low_precision as lp
from roundpipe.optim.backends.numba_engine import KernelCompileError
from roundpipe.optim.backends.numba_engine.layout import partition
from roundpipe.optim.spec.ir import (
    ProgramBuilder,
    abs_,
    clamp,
    clamp_min,
    maximum,
    rsqrt,
    sqrt,
    validate,
    where,
)
from roundpipe.optim.threads import torch_threads
from tests._util import bits_mismatch
from tests.backends._common import INPUTS, SCALARS, every_function_builder

DTYPES = (torch.bfloat16, torch.float16)
IDS = ["bfloat16", "float16"]


def _add_formulas(a, b, alpha, dtype):
    """torch.add(a, b, alpha)'s vector body and scalar tail, as float32 rounded to ``dtype``."""
    A, B = a.float().numpy(), b.float().numpy()
    r_alpha = lp._round_to(np.array([alpha], np.float32), dtype)[0]
    body = lp._round_to(lp._fma(r_alpha, B, A), dtype)
    tail = lp._round_to(A + lp._round_to(r_alpha * B, dtype), dtype)
    return body, tail


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [40, 64, 32768, 32769, 70001, 100001])
def test_tails_are_where_torch_computes_its_scalar_loop(dtype, threads, n):
    """Every element of torch's ``add`` with an alpha is the body's formula outside
    ``tail_spans`` and the tail's inside: torch's result depends on its thread count, and the
    chunks are modelled for every count."""
    found = lp.rounding(dtype)
    g = torch.Generator().manual_seed(n + threads)
    a, b = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
    with torch_threads(threads):
        got = torch.add(a, b, alpha=0.3).float().numpy()
    body, tail = _add_formulas(a, b, 0.3, dtype)
    in_tail = np.zeros(n, dtype=bool)
    for lo, hi in lp.tail_spans(n, threads, found.step):
        in_tail[lo:hi] = True
    want = np.where(in_tail, tail, body)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), np.nonzero(got != want)[0][:10]


def test_torch_chunks():
    assert lp.torch_chunks(0, 4) == []
    assert lp.torch_chunks(100, 4) == [(0, 100)]
    assert lp.torch_chunks(100001, 1) == [(0, 100001)]
    assert lp.torch_chunks(100001, 3) == [(0, 33334), (33334, 66668), (66668, 100001)]
    assert lp.torch_chunks(40000, 8) == [(0, 20000), (20000, 40000)]  # at most numel / GRAIN_SIZE
    assert lp.tail_spans(100001, 4, 32) == [(24992, 25001), (49993, 50002), (74994, 75003), (99995, 100001)]


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64")
    or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the formulas measured on x86-64 builds with AVX2 or AVX-512 kernels",
)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_the_probe_finds_the_formulas_of_the_vectorized_kernels(dtype):
    """The formulas every x86-64 vector kernel has; the vector step is not read from the CPU's
    capability string (an AVX-512 machine need not step 64: docs/low-precision.md), but measured
    again on another op than the probe's (``maximum`` of opposite zeros, whose body and tail
    differ)."""
    found = lp.rounding(dtype)
    assert found.exact, found.what
    kinds = dict(found.kinds)
    assert {fn: kinds.pop(fn) for fn in ("add", "addcmul", "lerp", "maximum")} == {
        "add": ("fma", "rounded"),
        "addcmul": ("fma", "fma"),
        "lerp": ("fma", "fma"),
        "maximum": ("second", "first"),
    }, found.what
    assert set(kinds) == {f"{op}_nan" for op in lp.NAN_OPS}, found.what
    assert found.step == _step_of_maximum(dtype)


def _step_of_maximum(dtype) -> int:
    """The vector step, from where ``torch.maximum`` of ``+0`` and ``-0`` takes its tail's
    choice (the first) instead of its body's (the second): a loop of ``n`` elements runs its
    last ``n % step`` through the scalar lambda."""
    steps = {8, 16, 32, 64, 128, 256}
    for n in (511, 400, 300):
        a = torch.tensor([0.0, -0.0] * (n // 2 + 1), dtype=dtype)[:n]
        in_tail = (torch.signbit(torch.maximum(a, -a)) == torch.signbit(a)).numpy()
        tail = int(in_tail[::-1].cumprod().sum())  # the run of tail elements at the end
        assert not in_tail[: n - tail].any(), (n, np.nonzero(in_tail)[0][:5])
        steps &= {s for s in steps if n % s == tail}
    assert len(steps) == 1, steps
    return steps.pop()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [7, 64, 70001])
def test_maximum_of_a_nan_is_the_probes_nan_in_the_body_and_in_the_tails(dtype, threads, n):
    """Wherever an operand of ``torch.maximum`` is NaN, its result is the probe's NaN of the
    body outside ``tail_spans`` and of the tail inside, at every thread count; elsewhere the
    larger operand."""
    found = lp.rounding(dtype)
    g = torch.Generator().manual_seed(n + threads)
    a, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    nans = lp._from_bits(lp._nans(dtype), dtype)
    where = torch.randint(0, n, (max(1, n // 5),), generator=g)
    a[where] = nans[torch.arange(len(where)) % len(nans)]
    b[where.flip(0)[::2]] = nans[0]
    with torch_threads(threads):
        got = torch.maximum(a, b).view(torch.int16).numpy().astype(np.uint16)
    body, tail = found.nan("maximum")
    if not (isinstance(body, int) and isinstance(tail, int)):
        pytest.skip(f"this torch's maximum keeps an operand's NaN ({found.what}): no one NaN to expect")
    want = np.full(n, body, dtype=np.uint16)
    for lo, hi in lp.tail_spans(n, threads, found.step):
        want[lo:hi] = tail
    unordered = a.isnan() | b.isnan()
    assert unordered.any() and np.array_equal(got[unordered.numpy()], want[unordered.numpy()]), found.what
    ordered = ~unordered  # (equal zeros compare equal: their signs are the other test's)
    assert torch.equal(torch.maximum(a, b)[ordered], torch.where(a > b, a, b)[ordered])


def test_partition_cuts_items_at_the_tails():
    sizes = [100, 5, 0, 70001, 64]
    bounds, items = partition(sizes, 3, tails=(3, 32))
    assert items.shape[1] == 4 and bounds[0] == 0 and bounds[-1] == len(items)
    covered = {j: np.zeros(n, dtype=int) for j, n in enumerate(sizes)}
    for j, lo, hi, flag in items.tolist():
        covered[j][lo:hi] += 1
        spans = lp.tail_spans(sizes[j], 3, 32)
        inside = [a <= lo and hi <= b for a, b in spans]
        assert flag == any(inside), (j, lo, hi, flag)
        if not flag:  # no item straddles a tail's start or end
            assert all(hi <= a or lo >= b for a, b in spans), (j, lo, hi)
    assert all((c == 1).all() for c in covered.values())
    plain_bounds, plain = partition(sizes, 3)
    assert plain.shape[1] == 3 and len(plain_bounds) == len(bounds)


def _low_program():
    """Every IR function and operator but rsqrt (the staged specs' only, refused on 16-bit)."""
    b, _ = every_function_builder()
    statements = [st for st in b.statements if "rsqrt" not in repr(st)]
    return validate(statements, INPUTS)


def _inputs(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    t = {k: torch.randn(n, generator=g) for k in INPUTS}
    t["acc"] = t["acc"].abs()
    t["grad"][::9] *= 1e-6  # float16 subnormals
    t["param"][::11] *= 1e4 if dtype is torch.float16 else 1e30  # squares past the largest
    t["buf"][::13] *= 1e-39  # bfloat16 subnormals (float16: zeros)
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0]
    for k, name in enumerate(INPUTS):
        t[name][k : k + 5 * 5 : 5] = torch.tensor(specials)
    t["grad"][-5:] = -0.0  # in a tail: maximum's and lerp's signed zeros
    t["buf"][-5:] = 0.0
    return {k: v.to(dtype) for k, v in t.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("backend", ["fast:numba", "fast:torch"])
@pytest.mark.parametrize("w", [0.3, 0.7, 1.0])  # lerp's two branches, and weight 1 (signed zeros)
def test_every_function_bit_for_bit_the_reference(dtype, backend, w):
    program = _low_program()
    scalars = {**SCALARS, "w": w, "tiny": 1e-3}
    for n, threads in ((257, 1), (31, 1), (70001, 2)):
        ours, theirs = _inputs(dtype, n, n), _inputs(dtype, n, n)
        with torch_threads(threads):
            backends.get(backend).run(program, scalars, {k: [v] for k, v in ours.items()})
            backends.get("reference").run(program, scalars, {k: [v] for k, v in theirs.items()})
        for k in INPUTS:
            assert ours[k].dtype is dtype
            # (float16 keeps a NaN's payload: where two NaNs of other payloads meet in one op,
            # which survives is the operand order of torch's compiled instruction, not modelled;
            # test_each_ops_nan_bit_for_bit_torchs has one NaN source an op)
            problem = bits_mismatch(ours[k], theirs[k], nan_bits=dtype is torch.bfloat16)
            assert problem is None, f"{backend} {dtype} n={n} threads={threads} {k}: {problem}"


_NAN_PROGRAMS = {
    "round": lambda x, y, s: x * s.w,
    "sqrt": lambda x, y, s: sqrt(x),
    "neg": lambda x, y, s: -x,
    "abs": lambda x, y, s: abs_(x),
    "clamp": lambda x, y, s: clamp(x, s.lo, s.hi),
    "clamp_min": lambda x, y, s: clamp_min(x, s.lo),
    "where": lambda x, y, s: where(y > 0.0, x, y),
    "maximum": lambda x, y, s: maximum(x, y),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("backend", ["fast:numba", "fast:torch"])
@pytest.mark.parametrize("op", sorted(_NAN_PROGRAMS))
def test_each_ops_nan_bit_for_bit_torchs(dtype, backend, op):
    """Each op whose NaN torch's 16-bit kernels store otherwise in the body and the tail
    (``low_precision.NAN_OPS``), alone, on NaNs of every sign and payload in the body and in
    the tails: the NaN's bits as torch's op has them (the reference backend runs it)."""
    found = lp.rounding(dtype)
    if not found.exact:  # (the engine then claims no bits: exact_for, and the suites compare closely)
        pytest.skip(f"this torch's {found.name} kernels match no known formula or NaN: {found.what}")
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), _NAN_PROGRAMS[op](b.tensor("param"), b.tensor("grad"), b.s))
    program = b.build()
    scalars = {"w": 0.9, "lo": -1.0, "hi": 1.0}
    nans = lp._from_bits(lp._nans(dtype), dtype)
    for n, threads in ((70001, 2), (257, 1), (31, 1)):
        g = torch.Generator().manual_seed(n)
        x, y = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        x[::3] = nans[torch.arange(len(x[::3])) % len(nans)]
        y[1::4] = nans[0]
        ours, theirs = ({"param": x.clone(), "grad": y.clone()} for _ in range(2))
        with torch_threads(threads):
            backends.get(backend).run(program, scalars, {k: [v] for k, v in ours.items()})
            backends.get("reference").run(program, scalars, {k: [v] for k, v in theirs.items()})
        problem = bits_mismatch(ours["param"], theirs["param"], nan_bits=True)
        assert problem is None, f"{backend} {dtype} {op} n={n} threads={threads}: {problem}"


def test_rsqrt_of_16_bit_tensors_is_not_compiled():
    """Its scalar tail is not modelled: fast:numba raises, plain fast falls back to torch's ops."""
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), rsqrt(b.tensor("grad")))
    program = b.build()
    p, g = torch.ones(40, dtype=torch.bfloat16), torch.full((40,), 4.0, dtype=torch.bfloat16)
    with pytest.raises(KernelCompileError, match="rsqrt"):
        backends.get("fast:numba").run(program, {}, {"param": [p], "grad": [g]})
    assert bool((p == 1).all())
