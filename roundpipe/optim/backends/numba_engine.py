"""The ``numba`` engine of the ``fast`` backend (its default): every tensor of a step updated
by one parallel numba loop.

Each spec program is lowered (``formulas.py``, numba's dialect) to the statements of one loop
iteration and compiled, once per program and lerp variant, into a kernel that walks a table of
addresses:

.. code-block:: python

    def kernel_parallel(nthreads, meta, ptrs, sv, sqrt_fn):
        for w in prange(nthreads):                 # ONE parallel region per step
            for it in range(bounds[w], bounds[w + 1]):  # this thread's slices of the tensors
                j, lo, hi = items[it, 0], items[it, 1], items[it, 2]
                s_beta2 = sv[bucket[j], 0]         # the parameter's scalars (float32)
                t0_param = carray(f32ptr(ptrs[0, j] + 4 * lo), hi - lo)  # where it lives
                ...
                for i in range(hi - lo):
                    v0_param_0 = t0_param[i]       # every input read once
                    ...                            # lets and assigns: float32 locals
                    t0_param[i] = v0_param_1       # every target written once

The elements of all the step's tensors are split into ``nthreads`` equal, contiguous shares
(cut at 16-element boundaries), so every thread gets the same work whatever the mix of large
and small tensors, with no barrier between tensors and no gather/scatter copies: small tensors
go through the same kernel. The table (``ptrs``: one row of ``data_ptr()`` per program tensor)
is rebuilt only for the columns whose tensors changed (the gradients, each step). On one thread
the serial twin ``kernel_serial`` runs (numba's pool is never started then).

Rounding is torch's float32 rounding, bit for bit (torch.optim's for-loop, ``foreach=False``):

* every scalar and constant is a float32 value (``sv``), and every operation is on float32;
* each IR function is the shared formula of ``formulas.py`` (torch's formulas in torch's order);
* torch's vectorized CPU kernels compute ``add(a, b, alpha)``, ``addcmul`` and ``lerp`` with a
  fused multiply-add (one rounding where the formula has two). Which of them this torch fuses
  is measured once per process (``torch_fusion``), and exactly those call ``fma``
  (``llvm.fma.f32``). Nothing else is fused: without ``fastmath`` LLVM neither reassociates nor
  contracts ``a * b + c`` by itself;
* ``sqrt`` is torch's CPU ``sqrt``, bit for bit. On x86-64 wheels built with MKL that is VML's
  ``vmsSqrt`` (one ulp off the correctly rounded root in about 20% of elements), found once per
  process (``torch_sqrt``). Calling it costs about 0.8 ns an element, which made an Adam step
  compute-bound on two cores, so the kernels compute what MKL's own float32 kernel for this
  CPU computes: ``rsqrtps`` (``vrsqrt14ps``) and a correction step, sixteen lanes a call,
  handing a block with any lane outside that sequence's range (subnormal, negative, huge,
  inf, NaN) to ``vmsSqrt`` itself (``sqrt_kind``: the emulation is used only where a probe
  finds it equal to ``torch.sqrt``; checked once over all 2**32 float32 on an AMD EPYC (SSE
  sequence) and an Intel Xeon (AVX-512 sequence): equal). Where no emulation matches
  (another CPU's MKL kernel), the kernels call ``vmsSqrt`` (through its
  address, a runtime argument, so kernels stay cacheable on disk); where torch's ``sqrt`` is
  correctly rounded (no MKL) the kernel's own ``sqrt``. A program with a ``sqrt`` runs each
  block of ``SQRT_BLOCK`` elements in passes: pass ``k`` computes the argument of the ``k``-th
  ``sqrt`` into a block buffer (nothing written yet), the roots are taken, and the last pass
  computes everything with the roots and writes the targets. Each block has views of its own
  starting at index 0: indexing from an offset makes numba emit wraparound code, and LLVM then
  does not vectorize the loops (measured: AdamW 3x slower). Every block has the constant
  ``SQRT_BLOCK`` as its length: a slice's last, partial block runs on zero-padded copies of
  its elements, and copies back what it wrote (one block body instead of a second one for
  partial blocks: AdamW's kernel compiled in 1.09 s instead of 1.42 s);
* ``error_model="numpy"``: ``x / 0`` is IEEE (inf or NaN), not ``ZeroDivisionError``.

``bounds``, ``items`` and ``bucket`` (which row of ``sv`` each parameter reads) travel in one
int64 array, ``meta`` (``pack_layout``): each array argument costs its own unboxing, and a step
of one small parameter finds each of them out of cache.

Compiled kernels are cached on disk between processes: the generated source is written to
``<cache>/numba/<module>.py`` (``<cache>`` is ``$ROUNDPIPE_CACHE_DIR``, else
``$XDG_CACHE_HOME/roundpipe``, else ``~/.cache/roundpipe``), the module name a hash of the
source and the numba version, and numba's ``cache=True`` keeps the machine code next to it in
``__pycache__``. The source is created atomically (a temporary file linked into place) and
numba writes its index and machine code the same way, so processes compiling the same kernel
into one empty directory at once never see a partial file. When that directory cannot be
written, a warning says so (once per process) and kernels are compiled in memory.

Threads: a step runs ``min(roundpipe.optim.get_num_threads(), NUMBA_NUM_THREADS)`` threads of
numba's pool, fewer when the step has under ``PARALLEL_MIN_NUMEL`` elements per thread, and
only the serial loop on one thread (which also keeps a forked child, on one thread, from
numba's OpenMP layer, which aborts there). ``numba.set_num_threads`` is thread-local (numba
keeps the count per calling thread), so two threads stepping at once do not change each other's
count. numba's OpenMP layer sets the process's OpenMP thread count when its pool starts, and
with torch's libgomp loaded first that is torch's: a step puts torch's count back.

Shared between threads: compiled kernels (``_kernels``, immutable once built, built under a
lock) and the probes (``torch_fusion``, ``torch_sqrt``: computed once, then read-only). A
launch's table lives in the step plan's cache of one optimizer.

Everything that can fail (numba's import, code generation, compilation, the table) happens in
``prepare``, before a step writes anything; the launch it returns only runs the kernels.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import threading
import types
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import threads
from ..spec.ir import Assign, Let
from ..tensors import Checked
from . import CompileCache, pairing_of, segments
from .formulas import Lowering, lerp_complement_var, lerp_variant, lerp_weights, scalar_env, scalar_var

logger = logging.getLogger("roundpipe.optim")

CACHE_ENV_VAR = "ROUNDPIPE_CACHE_DIR"
INSTALL_HINT = "pip install numba (roundpipe declares it; a wheel, no compiler needed)"
# Bump when the generated code changes meaning without its text changing (it keys the cache).
GENERATOR_VERSION = 13
JIT_OPTIONS = dict(parallel=True, fastmath=False, error_model="numpy", nogil=True, boundscheck=False)
# Each thread gets at least this many elements (else fewer threads run): about 20 us of work at
# memory speed, where waking the pool's threads costs microseconds, and much more whenever the
# machine is busy (a parallel loop waits for its slowest thread).
PARALLEL_MIN_NUMEL = 1 << 15
# Thread shares are cut at multiples of this many elements (64 bytes: no shared cache lines).
ALIGN = 16
# Elements per block of a program with a sqrt (its passes run over one block at a time; a
# multiple of SQRT_LANES). Small blocks keep the passes close to one pass over memory: torch
# fused / ours, two threads, medians of 11 alternating steps in one process (Intel Xeon with
# AVX-512; before a block's off-path lanes went to the routine whole), 4 x 16Mi elements: Adam
# 0.92 / 1.01 / 1.02 with 256 / 128 / 64, AdamW 0.95 / 1.01 / 1.03, Adagrad 0.79 / 0.93 / 0.93;
# transformer: Adam 0.94 / 0.99 / 1.02, AdamW 1.00 / 1.01 / 1.05, Adagrad 0.85 / 0.98 / 0.96;
# 256 one-parameter optimizers of 4Ki: 1.27 / 1.29 (128 / 64, Adam), Adagrad 1.21 / 1.35. (An
# AMD EPYC measured 64-256 alike, and 512 up slower.) Every pass's arrays stay in L1 on any
# x86-64.
SQRT_BLOCK = 64
# A block's passes prefetch (every cache line of) the block this many blocks ahead in each of
# its tensors. Its passes interleave the tensors' streams a few hundred bytes at a time, and
# the hardware prefetchers alone then leave the step short of the memory bandwidth: side by
# side against torch fused, two threads, 4 x 16Mi elements (Intel Xeon): Adagrad 0.88x with
# none, 1.04x with every line 3 or 4 blocks (768 or 1 KiB) ahead, 1.00x with one line of the
# block 4 ahead, and 0.88x with one line 8 blocks ahead; Adam and AdamW 0.96x -> 1.01-1.02x
# (one line, 2 to 6 blocks ahead); one thread, Adagrad 0.81x -> 1.01x.
PREFETCH_BLOCKS = 4
# vmsSqrt's mode argument, as torch's ATen/cpu/vml.h passes it:
# VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
VML_MODE = 0x2 | 0x00140000 | 0x100

_F32 = np.float32


def import_numba():
    """The numba module, or ImportError saying how to install it."""
    try:
        import numba
    except ImportError as e:
        raise ImportError(
            f"roundpipe.optim's numba engine needs numba, which could not be imported ({e}); "
            f"install it with: {INSTALL_HINT}"
        ) from e
    return numba


def cache_dir() -> str:
    """Where generated kernels and numba's machine code are cached."""
    root = os.environ.get(CACHE_ENV_VAR)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "roundpipe")
    return os.path.join(root, "numba")


# ---------------------------------------------------------------------------------------------
# code generation


def _ident(prefix: str, index: int, name: str) -> str:
    return f"{prefix}{index}_{name}" if name.isidentifier() else f"{prefix}{index}"


@dataclass(frozen=True)
class KernelSource:
    """The generated kernel module and the layout of its ``sv`` rows."""

    source: str
    tensors: tuple  # program tensor names: the rows of ``ptrs``
    scalars: tuple  # scalar_env() keys: the first columns of ``sv``
    consts: tuple  # np.float32 constants: the last columns of ``sv``


class _Codegen(Lowering):
    """The shared formulas (formulas.py) in numba's dialect: the statements of one iteration."""

    def __init__(self, program, variant, fused):
        super().__init__(program, variant, fused)
        self.uses_fma = False
        self.arrays = {name: _ident("t", i, name) for i, name in enumerate(program.tensors)}
        self.current: dict[str, str] = {}  # input tensor -> local holding its current value
        self.versions: dict[str, int] = {}
        self.loads: list[str] = []  # input tensors read before they are first assigned
        self.lets: dict[str, str] = {}  # let name -> local
        self.body: list[str] = []
        self.sqrts: list[int] = []  # per sqrt, in order: the length of body once its argument is bound
        self.ntemp = 0

    def _value(self, name: str, version: int) -> str:
        return f"v{self.arrays[name][1:]}_{version}"

    # -- the dialect ---------------------------------------------------------------------------
    def tensor(self, name: str) -> str:
        if name in self.lets:
            return self.lets[name]
        if name not in self.current:
            self.loads.append(name)
            self.versions[name] = 0
            self.current[name] = self._value(name, 0)
        return self.current[name]

    def select(self, cond, a, b):
        return f"({a} if {cond} else {b})"

    def either(self, x, y):
        return f"({x} or {y})"

    def sqrt(self, x):
        # torch's sqrt routine runs on a block between passes (see generate): here the
        # argument is bound (pass k stores it) and the root is read from the block's buffer
        j = len(self.sqrts)
        self.body.append(f"a{j} = {x}")
        self.sqrts.append(len(self.body))
        return f"r{j}[i]"

    def fma(self, a, b, c):
        self.uses_fma = True
        return f"fma({a}, {b}, {c})"

    def bind(self, code: str) -> str:
        if code.isidentifier():
            return code
        self.ntemp += 1
        name = f"e{self.ntemp}"
        self.body.append(f"{name} = {code}")
        return name

    # -- statements ----------------------------------------------------------------------------
    def statement(self, st):
        code = self(st.expr)
        if isinstance(st, Let):
            local = _ident("l", len(self.lets), st.name)
            self.lets[st.name] = local
            self.body.append(f"{local} = {code}")
        elif isinstance(st, Assign):
            self.versions[st.target] = self.versions.get(st.target, 0) + 1
            local = self._value(st.target, self.versions[st.target])
            self.body.append(f"{local} = {code}")
            self.current[st.target] = local


def generate(
    program, variant: tuple, fused=frozenset(), sqrt_kind: str = "routine", pairing=("float32", None)
) -> KernelSource:
    """The kernel source for ``program`` and a lerp variant (``formulas.lerp_variant``);
    ``fused``: the IR functions (``add``, ``addcmul``, ``lerp``) torch computes with an FMA;
    ``sqrt_kind``: how a block's roots are taken (``SQRT_KINDS``; with ``routine``, ``sqrt_fn ==
    0`` at run time means the correctly rounded sqrt; an emulation needs the routine's address,
    which the probe only picks one with, and has no such branch to compile); ``pairing``:
    ``(grad dtype, partner dtype or None)`` by name (``PAIRING_DTYPES``): a ``bfloat16``/
    ``float16`` gradient is widened as it is read, and a partner (the table's last row) written
    with the final ``param``, rounded to its dtype."""
    if sqrt_kind not in SQRT_KINDS:
        raise ValueError(f"sqrt_kind {sqrt_kind!r} is not one of {SQRT_KINDS}")
    grad_dtype, partner_dtype = pairing
    if grad_dtype not in ("float32", *_LOW) or partner_dtype not in (None, *_LOW):
        raise ValueError(f"pairing {pairing!r}: dtypes must be float32, bfloat16 or float16")
    cg = _Codegen(program, variant, fused)
    for st in program.statements:
        cg.statement(st)
    tensors = tuple(program.tensors) + (("partner",) if partner_dtype else ())
    low = {t: d for t, d in (("grad", grad_dtype), ("partner", partner_dtype)) if d in _LOW}
    cg.arrays.setdefault("partner", f"t{len(tensors) - 1}_partner")
    scalars = tuple(sorted(cg.scalars))
    const_names = tuple(sorted(cg.consts))
    i4, i5, i6 = " " * 12, " " * 16, " " * 20
    setup = [  # (pack_layout: items from meta[0], bucket from meta[1], bounds from meta[2])
        f"{i4}k = meta[0] + 3 * it",
        f"{i4}j = meta[k]",
        f"{i4}b = meta[meta[1] + j]",
        *(f"{i4}{name} = sv[b, {k}]" for k, name in enumerate((*scalars, *const_names))),
        f"{i4}lo = meta[k + 1]",
        f"{i4}m = meta[k + 2] - lo",
        # the slice's own pointer and a loop from 0: numba then knows no index is negative
        # (no wraparound code), and LLVM vectorizes the loop (7x faster than range(lo, hi))
    ]

    def views(count, start=None):
        """Each tensor's view: ``count`` elements from ``start`` in the slice, or at ``a{r}``."""
        return [
            f"{cg.arrays[t]} = carray({'u16ptr' if t in low else 'f32ptr'}("
            + (f"ptrs[{r}, j] + {2 if t in low else 4} * {start}" if start else f"a{r}")
            + f"), {count})"
            for r, t in enumerate(tensors)
        ]

    def load(t, index):
        if t in low:
            return f"widen_{low[t]}({cg.arrays[t]}[{index}])"
        return f"{cg.arrays[t]}[{index}]"

    def loop_body(indent, index, lines, stores):
        return [
            *(f"{indent}{cg._value(t, 0)} = {load(t, index)}" for t in cg.loads),
            *(f"{indent}{line}" for line in lines),
            *(f"{indent}{cg.arrays[t]}[{index}] = {cg.current[t]}" for t in program.targets if stores),
            *(
                [f"{indent}{cg.arrays['partner']}[{index}] = narrow_{partner_dtype}({cg.current['param']})"]
                if stores and partner_dtype
                else []
            ),
        ]

    prefetches = set()
    if not cg.sqrts:
        inner = [
            *(f"{i4}{v}" for v in views("m", "lo")),
            f"{i4}for i in range(m):",
            *loop_body(i5, "i", cg.body, True),
        ]
        scratch = []
    else:
        # blocks of SQRT_BLOCK elements; pass k binds the k-th sqrt's argument into q{k} (no
        # store), torch's sqrt routine takes the block's roots into r{k}, the last pass runs
        # the whole body with the roots and stores the targets. Each block gets views of its
        # own that start at index 0 (as the whole slice's do above): indexing with b0 + i
        # would make numba emit wraparound code for negative indices, and LLVM then does not
        # vectorize the loops (measured: AdamW 3x slower). Every block is written with the
        # constant SQRT_BLOCK as its length and trip count: with a run-time count (min(
        # SQRT_BLOCK, m - b0)), AdamW on 4 x 16Mi elements ran 0.91x torch fused against
        # 0.98-1.00x (two threads, Intel Xeon with AVX-512; see SQRT_BLOCK). A slice's last,
        # partial block runs the same body on zero-padded copies (pad_copy) of its mb
        # elements and copies back the tensors it wrote: a second body for partial blocks
        # doubled the kernel's compile time (measured on AdamW: 1.42 s with it, 1.09 s
        # without, and 0.18 s more again with one np.zeros per copy instead of one scratch
        # array), and the copies cost a step nothing measurable (at most 63 elements a tensor).
        early, passes = _sqrt_passes(cg, program)
        unused_q = set()

        def reads(loads, lines):
            """A pass's loads: its inputs, and the early targets it reads back."""
            needed = _needed_names(lines)
            return [
                *(f"{i6}{cg._value(t, 0)} = {load(t, 'i')}" for t in loads),
                *(f"{i6}{cg.current[t]} = {cg.arrays[t]}[i]" for t in early if cg.current[t] in needed),
            ]

        def block():
            """One block's passes over SQRT_BLOCK elements at ``a{r}`` (the slice's, or a
            partial block's scratch copy)."""
            n = SQRT_BLOCK
            body = [f"{i5}{v}" for v in views(n)]
            for k, (loads, lines) in enumerate(passes[:-1]):
                # a root of a target pass 0 stores (Adam's exp_avg_sq.sqrt()) is taken from
                # the target's own block, not from a copy in q{k}
                stored = [t for t in (early if k == 0 else ()) if f"a{k} = {cg.current[t]}" in lines]
                q = cg.arrays[stored[0]] if stored else f"q{k}"
                first = (f"{i6}{cg._value(t, 0)} = {load(t, 'i')}" for t in loads)
                body += [
                    f"{i5}for i in range({n}):",
                    *(reads(loads, lines) if k else first),
                    *(f"{i6}{line}" for line in lines if not (stored and line.startswith(f"a{k} = "))),
                    *([] if stored else [f"{i6}q{k}[i] = a{k}"]),
                    # pass 0 also stores the targets whose final value it has computed
                    *(f"{i6}{cg.arrays[t]}[i] = {cg.current[t]}" for t in (early if k == 0 else ())),
                    *_sqrt_block(sqrt_kind, i5, q, f"r{k}"),
                ]
                if stored:
                    unused_q.add(k)
            loads, lines = passes[-1]
            return body + [
                f"{i5}for i in range({n}):",
                *reads(loads, lines),
                *(f"{i6}{line}" for line in lines),
                *(f"{i6}{cg.arrays[t]}[i] = {cg.current[t]}" for t in program.targets if t not in early),
                *(
                    [f"{i6}{cg.arrays['partner']}[i] = narrow_{partner_dtype}({cg.current['param']})"]
                    if partner_dtype
                    else []
                ),
            ]

        body = block()  # (fills unused_q)
        # one scratch allocation per thread (each np.empty adds to the compile time): the
        # blocks' argument and root buffers, then one zero-padded copy per tensor, at x{r}
        bufs = [f"{c}{k}" for k in range(len(cg.sqrts)) for c in "qr" if not (c == "q" and k in unused_q)]
        nbytes = 4 * SQRT_BLOCK
        scratch = [
            f"        scratch = np.empty({SQRT_BLOCK * (len(bufs) + len(tensors))}, np.float32)",
            "        xs = scratch.ctypes.data",
            *(
                f"        {buf} = carray(f32ptr(xs + {nbytes * n}), {SQRT_BLOCK})"
                for n, buf in enumerate(bufs)
            ),
            *(f"        x{r} = xs + {nbytes * (len(bufs) + r)}" for r in range(len(tensors))),
        ]
        size = {t: 2 if t in low else 4 for t in tensors}
        prefetches = {f"prefetch{nbytes // 4 * size[t] // 64}" for t in tensors}
        at = {t: f"ptrs[{r}, j] + {size[t]} * (lo + b0)" for r, t in enumerate(tensors)}
        inner = [
            f"{i4}for b0 in range(0, m, {SQRT_BLOCK}):",
            f"{i5}mb = min(m - b0, {SQRT_BLOCK})",
            *(f"{i5}a{r} = {at[t]}" for r, t in enumerate(tensors)),
            # the block PREFETCH_BLOCKS ahead, every line of it (a hint: never faults)
            *(
                f"{i5}prefetch{nbytes // 4 * size[t] // 64}(a{r} + {PREFETCH_BLOCKS * nbytes // 4 * size[t]})"
                for r, t in enumerate(tensors)
            ),
            # a partial block runs on zero-padded copies, then copies back what it wrote
            f"{i5}if mb < {SQRT_BLOCK}:",
            *(
                f"{i6}a{r} = "
                + (f"x{r}" if t == "partner" else f"pad_copy(x{r}, a{r}, {size[t]} * mb, {nbytes})")
                for r, t in enumerate(tensors)
            ),
            *body,
            f"{i5}if mb < {SQRT_BLOCK}:",
            *(
                f"{i6}pad_copy({at[t]}, x{r}, {size[t]} * mb, {size[t]} * mb)"
                for r, t in enumerate(tensors)
                if t in {*program.targets, "partner"}
            ),
        ]

    def kernel(name, loop):
        return [
            f"def {name}(nthreads, meta, ptrs, sv, sqrt_fn):",
            f"    for w in {loop}(nthreads):",
            "        wide_vectors()",
            *scratch,
            "        for it in range(meta[2 + w], meta[3 + w]):",
            *setup,
            *inner,
            "",
            "",
        ]

    lines = [
        "# Generated by roundpipe.optim.backends.numba_engine (do not edit): one parallel loop over",
        "# every slice of every tensor of a step, running this spec program,",
        "#",
        *(f"#   {line}" for line in str(program).splitlines()),
        "#",
        f"# lerp variant {tuple(variant)!r}, fused multiply-adds in {sorted(cg.fused)!r}, sqrt {sqrt_kind},",
        *(
            [f"# gradients {grad_dtype}, partners {partner_dtype} (written with the final param),"]
            if low
            else []
        ),
        f"# generator version {GENERATOR_VERSION}. Every scalar and constant is a float32 read from",
        "# sv (a Python float literal would make numba compute in float64). The same loop twice:",
        "# kernel_parallel for numba.njit(parallel=True), kernel_serial for one thread. sqrt_fn: the",
        "# address of torch's sqrt routine (vmsSqrt), or (sqrt routine) 0 for the correctly rounded",
        "# sqrt.",
        "import numpy as np",
        "from numba import carray, prange",
        "",
        "from roundpipe.optim.backends.numba_engine import "
        + ", ".join(
            [
                "f32ptr",
                *(["fma"] if cg.uses_fma else []),
                *([*_SQRT_IMPORTS[sqrt_kind], "pad_copy", *sorted(prefetches)] if cg.sqrts else ()),
                *(["u16ptr"] if low else []),
                *([f"widen_{grad_dtype}"] if "grad" in low and "grad" in cg.loads else []),
                *([f"narrow_{partner_dtype}"] if partner_dtype else []),
                "wide_vectors",
            ]
        ),
        "",
        "",
        *kernel("kernel_parallel", "prange"),
        *kernel("kernel_serial", "range"),
    ]
    consts = tuple(_F32(cg.consts[c]) for c in const_names)
    return KernelSource("\n".join(lines).rstrip() + "\n", tensors, scalars, consts)


_NAME = re.compile(r"\b[vlea]\d+\w*")


def _needed_names(lines) -> set:
    return {n for line in lines for n in _NAME.findall(line.split(" = ", 1)[1])}


def _sqrt_passes(cg, program):
    """The passes of a block of a program with a ``sqrt``: ``(early, passes)``.

    ``passes[k]`` (``k`` < the number of roots) is ``(loads, lines)``: what pass ``k`` reads and
    the statements it runs to bind the ``k``-th root's argument ``a{k}``; the last entry, the
    final pass's, runs what the targets' final values need. Every pass runs only the statements
    its outputs depend on (a backward slice of the body). ``early``: the targets whose final
    value pass 0 has computed, which pass 0 stores (Adam's moments); later passes read those
    back (the block is in cache) instead of recomputing them from the inputs, so the final pass
    of Adam reads param, exp_avg and the roots, not all four inputs again. A target whose
    original value a later pass still needs is not stored early."""
    defs = {}  # local -> (its line, the locals it reads)
    for line in cg.body:
        name, expr = line.split(" = ", 1)
        defs[name] = (line, set(_NAME.findall(expr)))
    cut0 = cg.sqrts[0]
    first = {line.split(" = ", 1)[0] for line in cg.body[:cut0]}
    early = [t for t in program.targets if cg.current[t] in first]
    originals = {cg._value(t, 0): t for t in cg.loads}

    def slice_(outputs, upto, free):
        """The lines of ``cg.body[:upto]`` that ``outputs`` need, and the inputs they load."""
        allowed = {line.split(" = ", 1)[0] for line in cg.body[:upto]}
        need, stack = set(), list(outputs)
        while stack:
            n = stack.pop()
            if n in need or n in free:
                continue
            need.add(n)
            if n in defs and n in allowed:
                stack.extend(defs[n][1])
        lines = [line for line in cg.body[:upto] if line.split(" = ", 1)[0] in need]
        loads = [originals[n] for n in need if n in originals]
        return lines, sorted(loads, key=cg.loads.index)

    while True:
        free = {cg.current[t] for t in early}
        passes = [slice_(["a0", *(cg.current[t] for t in early)], cut0, set())[::-1]]
        for k, cut in enumerate(cg.sqrts[1:], start=1):
            passes.append(slice_([f"a{k}"], cut, free)[::-1])
        finals = [cg.current[t] for t in program.targets if t not in early]
        passes.append(slice_(finals, len(cg.body), free)[::-1])
        clobbered = {t for loads, _ in passes[1:] for t in loads if t in early}
        if not clobbered:
            return early, passes
        early = [t for t in early if t not in clobbered]


# How a kernel takes the roots of a block (``q`` -> ``r``, ``mb`` elements), when ``sqrt_fn`` (the
# address of torch's routine) is not 0:
# * ``routine``: calls it (MKL's ``vmsSqrt``: about 0.8 ns an element, which makes an Adam step
#   compute-bound on a few cores);
# * ``emulated-avx``/``emulated``/``emulated-fma``: computes, SQRT_LANES lanes at a time (its
#   ``rsqrtps`` eight (AVX) or four (SSE) lanes wide), the sequence MKL's SSE float32 kernel
#   (``emulated*``; rounded after each operation) or
#   its AVX2 kernel (``emulated-fma``) runs (``_sqrtv``), or its AVX-512 kernel
#   (``emulated-avx512``: ``vrsqrt14ps`` and one FMA correction, ``_sqrtv_avx512``), which equals it bit
#   for bit wherever that sequence applies (x positive, normal, below 0x7f7ff000; zeros are
#   returned as they are, as sqrt(+-0) is +-0); a block with any other lane (subnormal,
#   negative, huge, inf, NaN) goes to the routine whole, and so do the block's last (fewer than
#   SQRT_LANES) elements. Used only where the probe (``sqrt_kind``) finds it equal to
#   torch.sqrt.
SQRT_KINDS = ("routine", "emulated-avx", "emulated", "emulated-fma", "emulated-avx512")
# the low-precision dtypes of a pairing (masters.py), by name
_LOW = ("bfloat16", "float16")
# kind -> its intrinsic (``_sqrtv``), which takes SQRT_LANES roots a call
_EMULATIONS = {
    "emulated-avx": "sqrtv_avx",
    "emulated": "sqrtv_sse",
    "emulated-fma": "sqrtv_fma",
    "emulated-avx512": "sqrtv_avx512",
}
# what each needs of the CPU (its rsqrt instruction): LLVM aborts the process, rather than
# raising, when asked for an instruction the target lacks, so the probe never compiles those
_EMULATION_FEATURES = {
    "emulated-avx": "avx",
    "emulated": "sse",
    "emulated-fma": "fma",
    "emulated-avx512": "avx512f",  # vrsqrt14ps on zmm registers
}
SQRT_LANES = 16
_SQRT_IMPORTS = {"routine": ["call_sqrt_at"], **{k: ["call_sqrt_at", v] for k, v in _EMULATIONS.items()}}


def _sqrt_block(kind, indent, q, r):
    """The lines that take the roots of a block, ``q`` -> ``r`` (views of SQRT_BLOCK elements of
    which the first ``mb`` are the slice's: the rest is a partial block's zero padding)."""
    if kind == "routine":  # sqrt_fn == 0: torch's sqrt is correctly rounded
        return [
            f"{indent}if sqrt_fn == 0:",
            f"{indent}    for i in range({SQRT_BLOCK}):",
            f"{indent}        {r}[i] = np.sqrt({q}[i])",
            f"{indent}else:",
            f"{indent}    call_sqrt_at(sqrt_fn, mb, {q}.ctypes.data, {r}.ctypes.data)",
        ]
    emu, lanes = _EMULATIONS[kind], SQRT_LANES
    # a block with any lane off the emulation's path goes to the routine whole: no call inside
    # the loop, whose vector constants then stay in registers (a call clobbers them all).
    # Measured on an Intel Xeon, 4 x 16Mi, two threads, against torch fused: Adagrad 0.81-0.83x
    # with the routine called from the loop for the sixteen lanes, 0.90-0.93x so; Adam
    # 0.88-0.89x -> 0.95x, AdamW 0.90x -> 0.99x. A partial block's last (mb % SQRT_LANES)
    # elements then go to the routine on their own, as they did when partial blocks had a
    # kernel of their own (the emulation is MKL's main loop; these are its remainder).
    lines = [
        f"qa = {q}.ctypes.data",
        f"ra = {r}.ctypes.data",
        "bad = 0",
        f"for i in range(0, {SQRT_BLOCK}, {lanes}):",
        f"    bad |= {emu}(qa + 4 * i, ra + 4 * i)",
        "if bad:",
        f"    call_sqrt_at(sqrt_fn, {SQRT_BLOCK}, qa, ra)",
        f"n4 = mb - (mb & {lanes - 1})",
        "if n4 < mb:",
        "    call_sqrt_at(sqrt_fn, mb - n4, qa + 4 * n4, ra + 4 * n4)",
    ]
    return [indent + line for line in lines]


# ---------------------------------------------------------------------------------------------
# torch's fused multiply-adds

_fusion = None


def torch_fusion():
    """Which of ``add`` (with alpha), ``addcmul`` and ``lerp`` this torch computes with a fused
    multiply-add, measured once per process; and whether each matched one of the two formulas
    exactly (``(fused, exact)``).

    torch's vectorized CPU kernels (AVX2, AVX-512) compute ``add(a, b, alpha)`` as
    ``fma(alpha, b, a)``, ``addcmul`` as ``fma(value * b, c, a)`` and ``lerp`` as
    ``fma(w, end - start, start)`` (or from the end), rounding once where the formula in the
    torch source rounds twice; its generic build does not. Measuring it makes the numba
    kernels round as the torch in this process does, bit for bit.
    """
    global _fusion
    if _fusion is not None:
        return _fusion
    with _fusion_lock:
        if _fusion is None:
            _fusion = _probe_fusion()
    return _fusion


_fusion_lock = threading.Lock()


def _probe_fusion():
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4099, generator=gen) for _ in range(3))
    A, B, C = (x.numpy() for x in (a, b, c))
    s, w, v = _F32(0.3), _F32(0.3), _F32(0.7)
    v_comp = v - _F32(1)

    def fma(x, y, z):  # float32 x * y + z rounded once: exact product and sum in float64
        f64 = np.float64
        return (np.asarray(x, f64) * np.asarray(y, f64) + np.asarray(z, f64)).astype(_F32)

    cases = {  # name: (torch's result, the formula rounded at each op, the same with an FMA)
        "add": (torch.add(a, b, alpha=0.3), A + s * B, fma(s, B, A)),
        "addcmul": (torch.addcmul(a, b, c, value=0.3), A + (s * B) * C, fma(s * B, C, A)),
        "lerp": (
            torch.cat([torch.lerp(a, b, float(w)), torch.lerp(a, b, float(v))]).numpy(),
            np.concatenate([A + w * (B - A), v_comp * (B - A) + B]),
            np.concatenate([fma(w, B - A, A), fma(v_comp, B - A, B)]),
        ),
    }
    fused, exact = set(), True
    for name, (got, plain, fma_) in cases.items():
        got = np.asarray(got)
        if np.array_equal(got, plain):
            continue
        fused.add(name)
        if not np.array_equal(got, fma_):
            exact = False
            logger.warning("torch.%s rounds neither like a*b+c nor like fma(a, b, c) here", name)
    return frozenset(fused), exact


# ---------------------------------------------------------------------------------------------
# torch's sqrt

_sqrt = None
_probe_lock = threading.Lock()


def _vml_sqrt_address() -> int:
    """The address of ``vmsSqrt`` in the libtorch this process loaded, or 0."""
    import ctypes

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        path = os.path.join(lib_dir, name)
        if not os.path.exists(path):
            continue
        try:
            fn = ctypes.CDLL(path).vmsSqrt
        except (OSError, AttributeError):
            return 0
        return ctypes.cast(fn, ctypes.c_void_p).value or 0
    return 0


def _probe_values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    wide = torch.empty(1 << 16).uniform_(-104.0, 89.0, generator=gen).exp()  # subnormal to huge
    unit = torch.rand(1 << 16, generator=gen) * 10
    special = torch.tensor([0.0, -0.0, -1.0, float("inf"), -float("inf"), float("nan"), 1e-45, 4.0])
    return torch.cat([wide, unit, special])


def _bits(x: np.ndarray) -> np.ndarray:
    """float32 bits, every NaN as one pattern (payloads are not compared)."""
    bits = x.view(np.int32).copy()
    bits[np.isnan(x)] = 0x7FC00000
    return bits


def torch_sqrt():
    """``(address, what, exact)``: the sqrt routine this torch's CPU ``sqrt`` runs, probed once
    per process on 131,080 floats (subnormal to huge, specials).

    ``address`` is that of MKL's ``vmsSqrt`` when it gives torch's bits exactly (the x86-64
    wheels: torch's ATen/cpu/vml.h calls it with VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE),
    else 0, and the kernels use the correctly rounded sqrt; ``exact`` says whether the chosen
    one equals torch's ``sqrt`` on every probe value.
    """
    global _sqrt
    if _sqrt is not None:
        return _sqrt
    with _probe_lock:
        if _sqrt is None:
            _sqrt = _probe_sqrt()
    return _sqrt


def _probe_sqrt():
    import ctypes

    x = _probe_values()
    want = _bits(torch.sqrt(x).numpy())
    address = _vml_sqrt_address()
    if address:
        fn = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)
        out = torch.empty_like(x)
        for lo in range(0, x.numel(), SQRT_BLOCK):  # in the kernels' blocks
            n = min(SQRT_BLOCK, x.numel() - lo)
            fn(n, x.data_ptr() + 4 * lo, out.data_ptr() + 4 * lo, VML_MODE)
        if np.array_equal(_bits(out.numpy()), want):
            return address, "MKL vmsSqrt, as torch.sqrt (bit for bit on the probe)", True
    with np.errstate(invalid="ignore"):
        rounded = _bits(np.sqrt(x.numpy()))
    if np.array_equal(rounded, want):
        return 0, "correctly rounded, as torch.sqrt (bit for bit on the probe)", True
    differ = int((rounded != want).sum())
    msg = (
        f"correctly rounded; torch.sqrt here is neither that nor MKL's vmsSqrt ({differ} of "
        f"{x.numel()} probe values differ): programs with a sqrt may differ from torch by an ulp"
    )
    logger.warning("roundpipe.optim numba engine: sqrt is %s", msg)
    return 0, msg, False


_kind = None
_kind_lock = threading.Lock()


def sqrt_kind() -> str:
    """How the kernels take torch's roots (``SQRT_KINDS``), probed once per process: the first
    emulation of MKL's kernel that equals ``torch.sqrt`` bit for bit on every probe value (a
    kernel ``param = sqrt(grad)`` run on them, compiled like any other and cached on disk), else
    ``routine`` (calling torch's routine; also where torch.sqrt is not MKL's, or not x86-64:
    the kernels then never call it, as ``sqrt_fn`` is 0)."""
    global _kind
    if _kind is None:
        with _kind_lock:
            if _kind is None:
                _kind = _probe_kind()
    return _kind


def _target_features() -> frozenset:
    """The CPU features numba compiles for (names without the ``+``): this CPU's, unless
    ``NUMBA_CPU_NAME`` names another target (e.g. ``generic``, for caches shared between
    machines): then only those ``NUMBA_CPU_FEATURES`` lists. numba keys its disk cache on the
    same target, so code chosen by these features is never loaded where they are missing."""
    import llvmlite.binding as llvm

    numba = import_numba()
    if numba.config.CPU_NAME and numba.config.CPU_NAME != "host":
        listed = numba.config.CPU_FEATURES or ""
    else:
        listed = llvm.get_host_cpu_features().flatten()
    return frozenset(f[1:] for f in listed.split(",") if f.startswith("+"))


def _probe_order() -> list:
    """The emulations numba's target can run, the likeliest match first: MKL runs its AVX-512
    kernel on Intel CPUs that have AVX-512, and its SSE/AVX kernels on other vendors' (seen: an
    AMD EPYC with AVX-512 takes the SSE sequence). The target is this CPU unless
    ``NUMBA_CPU_NAME`` names another (``_target_features``)."""
    features = _target_features()
    kinds = [k for k in SQRT_KINDS[1:] if _EMULATION_FEATURES[k] in features]
    if "emulated-avx512" in kinds and _cpu_vendor() == "GenuineIntel":
        kinds.insert(0, kinds.pop(kinds.index("emulated-avx512")))
    return kinds


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _probe_kind() -> str:
    import platform

    from ..spec.ir import ProgramBuilder, sqrt

    address = torch_sqrt()[0]
    if not address or platform.machine().lower() not in ("x86_64", "amd64"):
        return "routine"
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), sqrt(b.tensor("grad")))
    program = b.build()
    x = _probe_values()
    want = _bits(torch.sqrt(x).numpy())
    for kind in _probe_order():
        out = torch.empty_like(x)
        try:
            kernel = compile_kernel(program, lerp_variant({}, lerp_weights(program)), frozenset(), kind)
            kernel.run({"param": out, "grad": x}, {}, 1, address)
        except Exception as err:  # an intrinsic this LLVM or CPU lacks: the next one
            logger.debug("roundpipe.optim numba engine: sqrt %s unavailable: %s", kind, err)
            continue
        if np.array_equal(_bits(out.numpy()), want):
            logger.debug("roundpipe.optim numba engine: sqrt %s equals torch.sqrt on the probe", kind)
            return kind
        logger.debug("roundpipe.optim numba engine: sqrt %s differs from torch.sqrt on the probe", kind)
    return "routine"


# ---------------------------------------------------------------------------------------------
# compilation and the on-disk cache

_warned_readonly = False  # process-wide, unlocked: a race can at worst warn twice


def _warn_uncached(directory, err):
    global _warned_readonly
    if _warned_readonly:
        return
    _warned_readonly = True
    msg = (
        f"roundpipe.optim's numba engine: cannot write its kernel cache in {directory!r} ({err}); "
        "compiling kernels in memory instead, so every process compiles them again. "
        f"Set {CACHE_ENV_VAR} to a writable directory to cache them."
    )
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _write_source(directory: str, path: str, source: str) -> None:
    """Create ``path`` with ``source`` unless it already holds exactly that (never rewrite it:
    numba's cache is keyed on the file's modification time)."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == source:
                return
        exists = True
    except FileNotFoundError:
        exists = False
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".py")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(source)
        if exists:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic create-if-absent: a concurrent writer wins cleanly
            except FileExistsError:
                pass
            except OSError:
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_module(name: str, source: str):
    """Import the kernel module from the on-disk cache, or build it in memory."""
    directory = cache_dir()
    path = os.path.join(directory, name + ".py")
    try:
        _write_source(directory, path, source)
    except OSError as err:
        _warn_uncached(directory, err)
    else:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module, True
    namespace = {"__name__": name}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return types.SimpleNamespace(**namespace), False


@dataclass
class NumbaKernel:
    """A program's kernels (parallel and serial) for one lerp variant."""

    program: object
    variant: tuple
    fused: frozenset
    source: KernelSource
    cached_on_disk: bool
    parallel: object  # numba dispatcher of kernel_parallel
    serial: object  # numba dispatcher of kernel_serial
    _row_layout: tuple | None = field(default=None, repr=False, compare=False)

    def row_layout(self, weights) -> tuple:
        """``(names, complements)``: where each scalar of a row of ``sv`` comes from, by the
        scalar's name (None for a lerp complement), and each lerp complement ``w - 1`` (in
        float32) by ``(position, weight)``; the constants after them stay as they are. Computed
        once per kernel (``weights`` are its program's) and shared by every launch of it."""
        if self._row_layout is None:
            names, complements = [], []
            for pos, var in enumerate(self.source.scalars):
                weight = next((w for w in weights if var == lerp_complement_var(w)), None)
                if weight is not None:
                    complements.append((pos, weight))
                    names.append(None)
                else:
                    name = var.removeprefix("s_")
                    assert var == scalar_var(name)
                    names.append(name)
            self._row_layout = (tuple(names), tuple(complements))
        return self._row_layout

    def run(self, tensors: dict, env: dict, nthreads: int = 1, sqrt_fn: int | None = None):
        """Run once on one set of same-shaped real float32 tensors (name -> tensor) with the
        scalars ``env`` (``scalar_env()``): for tests and tools; steps go through the engine.
        ``sqrt_fn``: the sqrt routine's address (default: torch's, ``torch_sqrt``)."""
        table = _Table(self.source.tensors, [tensors["param"]])
        for r, name in enumerate(self.source.tensors):
            table.update(r, [tensors[name]])
        sv = np.asarray([self.sv_row(env)], dtype=np.float32)
        meta = pack_layout(*partition(table.sizes, nthreads), np.zeros(1, np.int64))
        kernel = self.serial if nthreads == 1 else self.parallel
        fn = torch_sqrt()[0] if sqrt_fn is None else sqrt_fn
        if not fn and "call_sqrt_at" in self.source.source and "sqrtv_" in self.source.source:
            raise ValueError("an emulated sqrt needs the routine's address (sqrt_fn): 0 is for 'routine'")
        with _keep_torch_threads():  # (a first parallel call starts numba's pool)
            kernel(nthreads, meta, table.ptrs, sv, fn)

    def sv_row(self, env: dict) -> list:
        """One row of ``sv``: the scalars (from scalar_env()) then the constants."""
        return [*(env[s] for s in self.source.scalars), *self.source.consts]

    def ensure_compiled(self, parallel: bool, ptrs, sv):
        """Compile (or load from the disk cache) the kernel a launch will call, now: an empty
        call with the launch's argument types runs no iteration."""
        dispatcher = self.parallel if parallel else self.serial
        if not dispatcher.signatures:
            dispatcher(1, _EMPTY_META, ptrs, sv, 0)
        return dispatcher

    @property
    def dispatchers(self):
        return (self.parallel, self.serial)


def pack_layout(bounds, items, bucket) -> np.ndarray:
    """A launch's ``meta``: ``[items offset, bucket offset, *bounds, *items (3 per item),
    *bucket]`` in one int64 array (see ``partition`` for ``bounds`` and ``items``)."""
    head = 2 + len(bounds)
    return np.concatenate(
        [np.asarray([head, head + items.size], dtype=np.int64), bounds, items.reshape(-1), bucket]
    ).astype(np.int64, copy=False)


_EMPTY_META = pack_layout(
    np.zeros(2, dtype=np.int64), np.zeros((0, 3), dtype=np.int64), np.zeros(1, np.int64)
)


def partition(sizes, nthreads: int):
    """Split the elements of tensors of ``sizes`` into ``nthreads`` equal contiguous shares.

    Returns ``(bounds, items)``: thread ``w`` runs ``items[bounds[w]:bounds[w + 1]]``, each item
    ``(tensor index, lo, hi)``; shares are cut at multiples of ALIGN elements.
    """
    total = int(sum(sizes))
    share = -(-total // nthreads)
    share = -(-share // ALIGN) * ALIGN
    items, bounds = [], [0]
    cut = share  # end of the current thread's share, in the concatenation of the tensors
    offset = 0
    for j, n in enumerate(sizes):
        lo = 0
        while lo < n:
            while offset + lo >= cut and len(bounds) < nthreads:
                bounds.append(len(items))
                cut += share
            hi = n if len(bounds) == nthreads else min(n, cut - offset)
            items.append((j, lo, hi))
            lo = hi
        offset += n
    bounds += [len(items)] * (nthreads + 1 - len(bounds))
    return np.asarray(bounds, dtype=np.int64), np.asarray(items, dtype=np.int64).reshape(-1, 3)


_kernels = CompileCache()


def compile_kernel(
    program, variant: tuple, fused=None, sqrt: str | None = None, pairing=("float32", None)
) -> NumbaKernel:
    """The kernels for ``program`` and a lerp variant; ``fused`` defaults to torch_fusion()'s,
    ``sqrt`` (a ``SQRT_KINDS`` entry) to sqrt_kind()'s; ``pairing`` as ``generate``'s. numba
    compiles (or loads from its cache) each of the two on its first call."""
    numba = import_numba()
    if fused is None:
        fused = torch_fusion()[0]
    fused = frozenset(fused)
    if sqrt is None:
        sqrt = sqrt_kind()
    key = (program, tuple(variant), fused, sqrt, tuple(pairing))
    return _kernels.get(key, lambda: _compile(numba, program, variant, fused, sqrt, pairing))


def _compile(numba, program, variant, fused, sqrt="routine", pairing=("float32", None)) -> NumbaKernel:
    ks = generate(program, variant, fused, sqrt, pairing)
    key = f"{ks.source}\nnumba {numba.__version__}\ngenerator {GENERATOR_VERSION}"
    name = "roundpipe_numba_" + hashlib.sha256(key.encode()).hexdigest()[:24]
    module, on_disk = _load_module(name, ks.source)
    serial_options = {**JIT_OPTIONS, "parallel": False}
    try:
        par = numba.njit(cache=on_disk, **JIT_OPTIONS)(module.kernel_parallel)
        ser = numba.njit(cache=on_disk, **serial_options)(module.kernel_serial)
    except RuntimeError as err:  # numba found no writable place for its cache files
        _warn_uncached(os.path.dirname(module.__file__), err)
        on_disk = False
        par = numba.njit(cache=False, **JIT_OPTIONS)(module.kernel_parallel)
        ser = numba.njit(cache=False, **serial_options)(module.kernel_serial)
    return NumbaKernel(program, tuple(variant), fused, ks, on_disk, par, ser)


# ---------------------------------------------------------------------------------------------
# the engine

_F32_DTYPE = torch.float32
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_F32_ONE = np.float32(1.0)


class KernelCompileError(RuntimeError):
    """A program's kernel could not be generated or compiled (the cause is chained)."""


class NumbaEngine:
    """Runs spec programs as compiled kernels (``fast``'s default engine; see the module doc)."""

    name = "numba"

    def __init__(self):
        self._numba = import_numba()
        self.fused, fusion_exact = torch_fusion()
        self.sqrt_fn, self.sqrt_what, sqrt_exact = torch_sqrt()
        self.sqrt_kind = sqrt_kind()
        # bit for bit torch.optim's for-loop for every program
        self.exact = fusion_exact and sqrt_exact
        logger.debug(
            "numba engine: numba %s, threading layer %s, fused multiply-adds in %s, sqrt %s (%s)",
            self._numba.__version__,
            self._numba.config.THREADING_LAYER,
            sorted(self.fused),
            self.sqrt_what,
            self.sqrt_kind,
        )

    def kernel(self, program, variant, pairing=("float32", None)) -> NumbaKernel:
        return compile_kernel(program, variant, self.fused, self.sqrt_kind, pairing)

    def prepare(self, program, scalars, columns, cache):
        """Everything a launch over ``columns`` needs (kernels compiled, the address table,
        the scalars' rows, the partition), or an exception; returns ``launch()``, which only
        runs the kernels. See ``backends.Backend``."""
        steady = cache.get("steady")
        if steady is not None and steady.program is program and type(scalars) is dict:
            launch = steady.rebind(self, scalars, columns)
            if launch is not None:
                return launch
        params = columns["param"]
        weights = lerp_weights(program)
        by_variant: dict = {}
        for values, start, stop in segments(scalars, len(params)):
            by_variant.setdefault(lerp_variant(values, weights), []).append((values, start, stop))
        grad_dtype, partner_dtype = pairing_of(columns)
        pair = (_DTYPE_NAMES[grad_dtype], None if partner_dtype is None else _DTYPE_NAMES[partner_dtype])
        names = (*program.tensors, "partner") if partner_dtype is not None else program.tensors
        table = cache.get("table")
        if table is None or table.names != names or table.params is not params:
            table = cache["table"] = _Table(names, params, {"grad": grad_dtype, "partner": partner_dtype})
        for r, name in enumerate(names):
            table.update(r, columns[name])
        if table.total == 0:
            table.release_volatile()
            return _nothing
        nthreads = self._threads(table.total)
        calls = []
        ready = cache.setdefault("ready", {})  # (variant, parallel) -> (kernel, dispatcher)
        for variant, parts in by_variant.items():
            hit = ready.get((variant, nthreads > 1))
            try:
                kernel = hit[0] if hit else self.kernel(program, variant, pair)
                bucket, sv = self._rows(kernel, parts, len(params), weights, cache)
                if hit is None:
                    with _keep_torch_threads():  # a first parallel call starts numba's pool
                        dispatcher = kernel.ensure_compiled(nthreads > 1, table.ptrs, sv)
                    hit = ready[(variant, nthreads > 1)] = (kernel, dispatcher)
            except Exception as err:  # not KeyboardInterrupt: that propagates as itself
                raise KernelCompileError(f"cannot compile the kernel of this program: {err}") from err
            calls.append((hit[1], table.layout(nthreads, bucket), sv))
        launch = _launcher(self._numba, nthreads, calls, table, self.sqrt_fn)
        if len(calls) == 1 and type(scalars) is dict:
            # the next step with the same program, lerp variant, threads and tensors (all but
            # the gradients) only writes its scalars into this row and its gradients' addresses
            if nthreads == 1:  # the serial kernel's call itself (its gradient row is refreshed)
                dispatcher, meta, sv = calls[0]
                quick = functools.partial(dispatcher, 1, meta, table.ptrs, sv, self.sqrt_fn)
            else:
                quick = launch
            cache["steady"] = _Steady(
                program, weights, variant, nthreads, table, hit[0], calls[0][2], launch, quick
            )
        else:
            cache.pop("steady", None)
        return launch

    def run(self, program, scalars, columns, cache=None):
        """``prepare`` then launch (for tools and tests)."""
        self.prepare(program, scalars, columns, {} if cache is None else cache)()

    @staticmethod
    def _rows(kernel, parts, n, weights, cache):
        """Each parameter's row of ``sv`` (``bucket``) and the rows (one per segment)."""
        if len(parts) == 1 and parts[0][1] == 0 and parts[0][2] == n:
            bucket = cache.get("bucket0")
            if bucket is None or len(bucket) != n:
                bucket = cache["bucket0"] = np.zeros(n, dtype=np.int64)
            return bucket, np.asarray([kernel.sv_row(scalar_env(parts[0][0], weights))], dtype=np.float32)
        bucket = np.full(n, -1, dtype=np.int64)
        rows = []
        for k, (values, start, stop) in enumerate(parts):
            bucket[start:stop] = k
            rows.append(kernel.sv_row(scalar_env(values, weights)))
        return bucket, np.asarray(rows, dtype=np.float32)

    def _threads(self, total: int) -> int:
        n = min(threads.get_num_threads(), self._numba.config.NUMBA_NUM_THREADS, total // PARALLEL_MIN_NUMEL)
        return max(1, n)


def _launcher(numba, nthreads, calls, table, sqrt_fn):
    ptrs = table.ptrs
    release = table.release_volatile
    if nthreads == 1:
        # the serial kernels: numba's pool (and with it the OpenMP thread count) is not touched
        def launch():
            try:
                for dispatcher, meta, sv in calls:
                    dispatcher(1, meta, ptrs, sv, sqrt_fn)
            finally:
                release()

        return launch
    get_torch_threads = torch.get_num_threads

    def launch():
        torch_threads = get_torch_threads()
        try:
            if numba.get_num_threads() != nthreads:
                numba.set_num_threads(nthreads)  # thread-local in numba
            for dispatcher, meta, sv in calls:
                dispatcher(nthreads, meta, ptrs, sv, sqrt_fn)
        finally:
            release()
            if get_torch_threads() != torch_threads:  # see _keep_torch_threads
                torch.set_num_threads(torch_threads)

    return launch


_VARIANTS: dict = {}


class _Steady:
    """What a launch of one program over one segment of scalars keeps for the next step (in
    the plan's cache, so one optimizer's: never shared between threads): when the program,
    the lerp variant, the thread count and every column but the gradients are the same, a
    step's prepare is writing its scalars into the row ``sv`` and its gradients' addresses."""

    # (what rebind_grads reads first, together: fewer cache lines)
    __slots__ = (
        "weights",
        "variant",
        "nthreads",
        "total",
        "names",
        "complements",
        "grad_ptrs",
        "sv",
        "quick",
        "program",
        "table",
        "launch",
    )

    def __init__(self, program, weights, variant, nthreads, table, kernel, sv, launch, quick):
        self.program = program
        self.weights = weights
        self.variant = _VARIANTS.setdefault(variant, variant)  # shared: one object less to read
        self.nthreads = nthreads
        self.table = table
        self.sv = sv
        self.launch = launch
        # ``rebind_grads``'s launch: the kernel's call without the table's bookkeeping (a step
        # of one small parameter pays for every object it touches: they are out of cache by
        # the time the next step of the same optimizer comes)
        self.quick = quick
        self.grad_ptrs = table.ptrs[table.grad_row] if table.grad_row is not None else None
        self.total = table.total
        # the row's scalars (scalar_env's variables, in the kernel's order)
        self.names, self.complements = kernel.row_layout(weights)

    def rebind(self, engine, scalars, columns):
        """The launch for this step, or None when something differs (the full prepare runs)."""
        table = self.table
        if columns["param"] is not table.params:
            return None
        row = self._row(engine, scalars)
        if row is None:
            return None
        for r, name in enumerate(table.names):
            table.update(r, columns[name])
        self.sv[0, : len(row)] = row
        return self.launch

    def rebind_grads(self, engine, scalars, grads):
        """``rebind`` when only the scalars and the gradients (a ``Checked`` column) are new."""
        row = self._row(engine, scalars)
        if row is None:
            return None
        # (not kept in the table: its launch would drop the reference again)
        self.grad_ptrs[:] = [t.data_ptr() for t in grads]
        self.sv[0, : len(row)] = row
        return self.quick

    def _row(self, engine, scalars):
        """This step's row of scalars, or None when it needs another kernel or thread count.
        (The previous step's launch has run: a plan steps in one thread.)"""
        weights = self.weights
        if weights and lerp_variant(scalars, weights) != self.variant:
            return None
        if engine._threads(self.total) != self.nthreads:
            return None
        # what scalar_env() and sv_row() compute, without their dicts (KeyError: a scalar is
        # missing, as there); float32 on assignment to ``sv``, as scalar_env's
        row = [0.0 if n is None else scalars[n] for n in self.names]
        for pos, w in self.complements:
            row[pos] = np.float32(scalars[w]) - _F32_ONE
        return row


def _nothing():
    pass


@contextlib.contextmanager
def _keep_torch_threads():
    """numba's OpenMP layer, when it starts its pool, sets the OpenMP thread count of the
    process, which (with torch's libgomp loaded first) is torch's intra-op count: put torch's
    back as it was, so a step never changes the caller's settings."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class _Table:
    """The addresses a launch reads: a row of ``data_ptr()`` per program tensor, refreshed for a
    column only when its list of tensors is a new one (the gradients, every step)."""

    def __init__(self, names, params, dtypes=None):
        self.names = names
        self.params = params
        # each row's dtype (float32 but for a pairing's gradients and partners)
        self.dtypes = [(dtypes or {}).get(n) or _F32_DTYPE for n in names]
        self.sizes = [p.numel() for p in params]
        self.total = sum(self.sizes)
        self.ptrs = np.zeros((len(names), len(params)), dtype=np.int64)
        self.grad_row = names.index("grad") if "grad" in names else None
        self.columns = [None] * len(names)
        self.volatile = [False] * len(names)  # a new list of tensors every step (the grads)
        self._layouts: dict = {}

    def update(self, row: int, column):
        if column is self.columns[row]:
            return
        if type(column) is not Checked and (
            [t.numel() for t in column] != self.sizes
            or not all([t.dtype is self.dtypes[row] and t.is_contiguous() for t in column])
        ):
            raise ValueError(
                f"numba engine: {self.names[row]!r} tensors must be contiguous {self.dtypes[row]} of "
                "the parameters' sizes"
            )
        self.ptrs[row] = [t.data_ptr() for t in column]
        self.volatile[row] = self.volatile[row] or self.columns[row] is not None
        self.columns[row] = column

    def release_volatile(self):
        """Drop the references to columns that change every step (so a step's gradients are
        freed when the caller drops them); the next step refreshes their row."""
        for row, volatile in enumerate(self.volatile):
            if volatile:
                self.columns[row] = None

    def layout(self, nthreads, bucket):
        """The launch's ``meta`` (``pack_layout``) for ``nthreads`` and the rows ``bucket``."""
        key = (nthreads, bucket.tobytes())
        hit = self._layouts.get(key)
        if hit is None:
            # parameters outside every segment (bucket -1) are not run
            skipped = bucket.min() < 0 if len(bucket) else False
            sizes = np.where(bucket >= 0, self.sizes, 0) if skipped else self.sizes
            hit = self._layouts[key] = pack_layout(*partition(list(sizes), nthreads), bucket)
        return hit


def kernel_source(program, variant=None, fused=None) -> str:
    """The generated source of ``program`` (for reading; ``variant`` defaults to small lerps)."""
    if variant is None:
        variant = (True,) * len(lerp_weights(program))
    return generate(program, variant, torch_fusion()[0] if fused is None else fused).source


# ---------------------------------------------------------------------------------------------
# intrinsics imported by the generated modules, built on first use (numba is imported lazily):
# ``fma`` (float32 a * b + c rounded once), ``f32ptr`` (an address as a float32 pointer) and
# ``call_sqrt_at`` (torch's sqrt routine, called through its address), ``sqrtv_avx``/``sqrtv_sse``/
# ``sqrtv_fma`` (MKL's sqrt sequence, ``_sqrtv``), ``pad_copy`` (a partial block's padded copy)

# Built once, then read-only; unlocked: threads racing on the first build each make an equal
# set, and the dict ends holding one (``update`` is atomic under the GIL).
_intrinsics: dict = {}


def _make_intrinsics():
    if not _intrinsics:
        import_numba()
        from llvmlite import ir
        from numba.core import types
        from numba.extending import intrinsic

        @intrinsic
        def fma(typingctx, a, b, c):
            """``a * b + c`` in float32, rounded once (``llvm.fma.f32``)."""
            if not all(x == types.float32 for x in (a, b, c)):
                return None

            def codegen(context, builder, signature, args):
                fn = builder.module.declare_intrinsic("llvm.fma", [ir.FloatType()] * 3)
                return builder.call(fn, args)

            return types.float32(types.float32, types.float32, types.float32), codegen

        @intrinsic
        def call_sqrt_at(typingctx, fn, n, src, dst):
            """``fn(n, src, dst, VML_MODE)``: the sqrt routine at address ``fn`` (vmsSqrt's
            signature: int32 count, float32 in, float32 out, int64 mode) on ``n`` elements, the
            arrays given by their addresses."""
            if not all(isinstance(x, types.Integer) for x in (fn, n, src, dst)):
                return None

            def codegen(context, builder, signature, args):
                fnaddr, count, a, r = args
                f32p = ir.FloatType().as_pointer()
                fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32), f32p, f32p, ir.IntType(64)])
                target = builder.inttoptr(fnaddr, fnty.as_pointer())
                count32 = builder.trunc(count, ir.IntType(32))
                mode = ir.Constant(ir.IntType(64), VML_MODE)
                builder.call(target, [count32, builder.inttoptr(a, f32p), builder.inttoptr(r, f32p), mode])
                return context.get_dummy_value()

            return types.void(fn, n, src, dst), codegen

        @intrinsic
        def pad_copy(typingctx, dst, src, n, total):
            """Copies ``n`` bytes from address ``src`` to ``dst``, zeroes ``dst``'s bytes from
            ``n`` up to ``total``, and returns ``dst``."""
            if not all(isinstance(x, types.Integer) for x in (dst, src, n, total)):
                return None

            def codegen(context, builder, signature, args):
                d, s, count, whole = args
                i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
                dp, sp = builder.inttoptr(d, i8p), builder.inttoptr(s, i8p)
                no = ir.Constant(ir.IntType(1), 0)
                memcpy = builder.module.declare_intrinsic("llvm.memcpy", [i8p, i8p, i64])
                memset = builder.module.declare_intrinsic("llvm.memset", [i8p, i64])
                builder.call(memcpy, [dp, sp, count, no])
                rest = builder.gep(dp, [count])
                builder.call(memset, [rest, ir.Constant(ir.IntType(8), 0), builder.sub(whole, count), no])
                return d

            return types.int64(dst, src, n, total), codegen

        @intrinsic
        def wide_vectors(typingctx):
            """Asks LLVM to vectorize the function it is called in with 512-bit registers where
            the target has AVX-512 (``"prefer-vector-width"="512"``): LLVM's tuning for recent
            Intel CPUs otherwise stops at 256 bits, while torch's kernels run AVX-512 there.
            Side by side on an Intel Xeon (two threads, torch fused = 1): large (4 x 16Mi)
            Adagrad 0.82 -> 0.87x, AdamW 1.01 -> 1.09x; small AdamW 2.68 -> 3.00x, SGD 2.06 ->
            2.20x; and with the sqrt emulation on zmm too (``_sqrtv_avx512``) Adagrad 0.96x.
            Results are the same bits (no reductions; every operation is per element). Only
            this function's code changes: numba's target, which the user's own numba code
            shares, is left as it is. (A string attribute, which llvmlite's attribute set
            does not list: added to the set directly.)"""

            def codegen(context, builder, signature, args):
                if "avx512f" in _target_features():
                    set.add(builder.function.attributes, '"prefer-vector-width"="512"')
                return context.get_dummy_value()

            return types.void(), codegen

        _intrinsics.update(
            fma=fma,
            prefetch4=_prefetch(intrinsic, types, ir, 4),
            prefetch2=_prefetch(intrinsic, types, ir, 2),
            wide_vectors=wide_vectors,
            pad_copy=pad_copy,
            # the float32 / uint16 (bfloat16, float16 bits) pointer at a tensor's data_ptr()
            f32ptr=_pointer(intrinsic, types, types.float32),
            u16ptr=_pointer(intrinsic, types, types.uint16),
            **_conversions(intrinsic, types, ir),
            call_sqrt_at=call_sqrt_at,
            sqrtv_sse=_sqrtv(intrinsic, types, ir, with_fma=False, rsqrt_lanes=4),
            sqrtv_avx=_sqrtv(intrinsic, types, ir, with_fma=False, rsqrt_lanes=8),
            sqrtv_fma=_sqrtv(intrinsic, types, ir, with_fma=True, rsqrt_lanes=8),
            sqrtv_avx512=_sqrtv_avx512(intrinsic, types, ir),
        )
    return _intrinsics


def _prefetch(intrinsic, types, ir, lines):
    """An intrinsic ``prefetch<lines>(address)``: prefetches (for reading, into every cache
    level: ``prefetcht0``) the ``lines`` 64-byte cache lines from ``address`` on."""

    def prefetch(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], fnty=fnty)
            for k in range(lines):
                at = builder.inttoptr(builder.add(args[0], ir.Constant(args[0].type, 64 * k)), i8p)
                # read, locality 3 (keep in all levels), data cache
                builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.void(address), codegen

    prefetch.__name__ = f"prefetch{lines}"
    return intrinsic(prefetch)


def _pointer(intrinsic, types, element):
    """An intrinsic: the pointer to ``element`` at an integer address."""
    ptr = types.CPointer(element)

    def pointer(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(address), codegen

    pointer.__name__ = f"{element}ptr"
    return intrinsic(pointer)


def _conversions(intrinsic, types, ir, f16c=None):
    """``widen_bfloat16``/``widen_float16`` (the bits of a bfloat16 or float16, as uint16, to
    float32: exact) and ``narrow_bfloat16``/``narrow_float16`` (float32 to those bits, as torch's
    ``copy_`` rounds on the CPU: nearest-even, subnormals kept). Integer and float32 operations
    only (no ``half`` type, which LLVM may lower to a runtime call), so loops vectorize.

    * bfloat16: ``(u + 0x7fff + ((u >> 16) & 1)) >> 16`` of the float32 bits ``u``; every NaN
      becomes 0xffff (measured: torch 2.13's vectorized and scalar conversions both give it);
    * float16: the branch-free sequences of the FP16 library (M. Dukhan's ``fp16_ieee_from_fp32
      _value`` / ``fp16_ieee_to_fp32_value``), which round through float32 arithmetic; a NaN
      becomes ``sign | 0x7e00 | (mantissa >> 13)``, as F16C's ``vcvtps2ph`` (torch's vectorized
      copy) gives. Widening keeps a NaN's payload and quiets it, as ``vcvtph2ps`` does (torch's
      scalar loop, for a tensor's last few elements, gives 0x7fffffff for every NaN instead).
      Where numba's target has F16C, both are LLVM's ``fptrunc``/``fpext`` through ``half``,
      which x86 lowers to exactly those two instructions (one each per 8 lanes instead of some
      twenty integer and float operations): the same bits, checked over all 2**32 float32 and
      2**16 float16 against torch. Without F16C LLVM would lower them to a runtime call, so
      there the sequences above stay (``f16c``: None, whether the target has it; tests
      choose)."""
    i16, i32, f32 = ir.IntType(16), ir.IntType(32), ir.FloatType()
    if f16c is None:
        f16c = "f16c" in _target_features()

    def c32(v):
        return ir.Constant(i32, v - (1 << 32) if v >= 1 << 31 else v)

    def fconst(v):
        return ir.Constant(f32, v)

    def widen_bf16(builder, h):
        return builder.bitcast(builder.shl(builder.zext(h, i32), c32(16)), f32)

    def narrow_bf16(builder, x):
        u = builder.bitcast(x, i32)
        lsb = builder.and_(builder.lshr(u, c32(16)), c32(1))
        r = builder.lshr(builder.add(builder.add(u, c32(0x7FFF)), lsb), c32(16))
        nan = builder.fcmp_unordered("uno", x, x)
        return builder.trunc(builder.select(nan, c32(0xFFFF), r), i16)

    def widen_f16(builder, h):
        if f16c:  # vcvtph2ps
            return builder.fpext(builder.bitcast(h, ir.HalfType()), f32)
        w = builder.shl(builder.zext(h, i32), c32(16))
        sign = builder.and_(w, c32(0x80000000))
        two_w = builder.add(w, w)
        norm = builder.fmul(
            builder.bitcast(builder.add(builder.lshr(two_w, c32(4)), c32(0x70000000)), f32), fconst(2.0**-112)
        )
        denorm = builder.fsub(
            builder.bitcast(builder.or_(builder.lshr(two_w, c32(17)), c32(0x3F000000)), f32), fconst(0.5)
        )
        small = builder.icmp_unsigned("<", two_w, c32(1 << 27))
        bits = builder.select(small, builder.bitcast(denorm, i32), builder.bitcast(norm, i32))
        return builder.bitcast(builder.or_(sign, bits), f32)

    def narrow_f16(builder, x):
        if f16c:  # vcvtps2ph, rounding as MXCSR says: nearest-even, as torch runs it
            return builder.bitcast(builder.fptrunc(x, ir.HalfType()), i16)
        fabs = builder.module.declare_intrinsic("llvm.fabs", [f32])
        base = builder.fmul(builder.fmul(builder.call(fabs, [x]), fconst(2.0**112)), fconst(2.0**-110))
        w = builder.bitcast(x, i32)
        shl1 = builder.add(w, w)
        sign = builder.and_(w, c32(0x80000000))
        bias = builder.and_(shl1, c32(0xFF000000))
        bias = builder.select(builder.icmp_unsigned("<", bias, c32(0x71000000)), c32(0x71000000), bias)
        base = builder.fadd(
            builder.bitcast(builder.add(builder.lshr(bias, c32(1)), c32(0x07800000)), f32), base
        )
        bits = builder.bitcast(base, i32)
        nonsign = builder.add(
            builder.and_(builder.lshr(bits, c32(13)), c32(0x7C00)), builder.and_(bits, c32(0x0FFF))
        )
        mant = builder.lshr(builder.and_(w, c32(0x007FFFFF)), c32(13))
        nan = builder.or_(c32(0x7E00), mant)
        r = builder.or_(
            builder.lshr(sign, c32(16)),
            builder.select(builder.icmp_unsigned(">", shl1, c32(0xFF000000)), nan, nonsign),
        )
        return builder.trunc(r, i16)

    def make(name, fn, arg_ty, res_ty):
        def conv(typingctx, x):
            if x != arg_ty:
                return None

            def codegen(context, builder, signature, args):
                return fn(builder, args[0])

            return res_ty(arg_ty), codegen

        conv.__name__ = name
        return intrinsic(conv)

    u16, fl32 = types.uint16, types.float32
    return {
        "widen_bfloat16": make("widen_bfloat16", widen_bf16, u16, fl32),
        "widen_float16": make("widen_float16", widen_f16, u16, fl32),
        "narrow_bfloat16": make("narrow_bfloat16", narrow_bf16, fl32, u16),
        "narrow_float16": make("narrow_float16", narrow_f16, fl32, u16),
    }


def _sqrt_intrinsic(intrinsic, types, ir, body, width=SQRT_LANES):
    """An emulation's intrinsic ``sqrtv(src, dst)``: loads the ``SQRT_LANES`` float32 at address
    ``src`` (``width`` at a time); ``body(builder, x, splat, fma)`` (``splat(ty, value)``: a
    constant vector; ``fma``: ``llvm.fma`` on such vectors) returns the roots MKL's kernel
    computes on its main path and the lanes that path applies to; stores the roots (zeros
    returned as they are, as ``sqrt(+-0)`` is ``+-0``) at ``dst``. Returns non-zero when a lane
    is neither on the path nor zero: the caller then gives its block to the routine."""
    lanes = SQRT_LANES

    @intrinsic
    def sqrtv(typingctx, src, dst):
        if not (isinstance(src, types.Integer) and isinstance(dst, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            from numba.core import cgutils

            vf = ir.VectorType(ir.FloatType(), width)
            i32 = ir.IntType(32)

            def splat(ty, value):
                return ir.Constant(ty, [value] * ty.count)

            fma_fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{width}f32"
            )
            need_any = ir.Constant(i32, 0)
            for lo in range(0, lanes, width):
                src = builder.add(args[0], ir.Constant(args[0].type, 4 * lo))
                dst = builder.add(args[1], ir.Constant(args[1].type, 4 * lo))
                x = builder.load(builder.inttoptr(src, vf.as_pointer()), align=4)
                root, on_path = body(builder, x, splat, lambda a, b, c: builder.call(fma_fn, [a, b, c]))
                zero = builder.fcmp_ordered("==", x, splat(vf, 0.0))
                builder.store(builder.select(zero, x, root), builder.inttoptr(dst, vf.as_pointer()), align=4)
                need = builder.not_(builder.or_(on_path, zero))
                need_any = builder.or_(need_any, builder.zext(builder.bitcast(need, ir.IntType(width)), i32))
            return need_any

        return types.int32(src, dst), codegen

    return sqrtv


def _sqrtv(intrinsic, types, ir, with_fma: bool, rsqrt_lanes: int):
    """MKL's float32 HA sqrt kernels' main path: ``y = rsqrtps(x)``, ``s = x * y``, ``h = 0.5 *
    y``, ``e = 0.5 - s * h``, ``s1 = s + s * e``, ``h1 = h + e * h``, ``r = x - s1 * s1``, ``sqrt =
    s1 + r * h1`` (``with_fma``: each ``a +- b * c`` rounded once, as the AVX2 kernel does; else
    rounded after each operation, as the SSE kernel), on positive normal x below 0x7f7ff000
    (MKL's own test: ``bits + 0x7f800000 > 0xfefff000`` as int32 is off it). ``rsqrtps`` is
    taken ``rsqrt_lanes`` (4: SSE, 8: AVX) lanes at a time, as MKL's kernel takes it (every
    lane's estimate is the CPU's table entry, whatever the width); the rest is computed on all
    ``SQRT_LANES`` at once, which LLVM lowers to the widest vectors the CPU has (one zmm with
    AVX-512, two ymm with AVX2: measured 2x fewer instructions per root on an AVX-512 EPYC than
    eight lanes a call)."""

    def body(builder, x, splat, fma):
        lanes = SQRT_LANES
        f32, i32 = ir.FloatType(), ir.IntType(32)
        vf, vi, vr = ir.VectorType(f32, lanes), ir.VectorType(i32, lanes), ir.VectorType(f32, rsqrt_lanes)

        def indices(values):
            return ir.Constant(ir.VectorType(i32, len(values)), list(values))

        off_path = builder.icmp_signed(
            ">", builder.add(builder.bitcast(x, vi), splat(vi, 0x7F800000)), splat(vi, -16781312)
        )
        name = "llvm.x86.sse.rsqrt.ps" if rsqrt_lanes == 4 else "llvm.x86.avx.rsqrt.ps.256"
        rsqrt = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(vr, [vr]))
        parts = [
            builder.call(rsqrt, [builder.shuffle_vector(x, x, indices(range(lo, lo + rsqrt_lanes)))])
            for lo in range(0, lanes, rsqrt_lanes)
        ]
        while len(parts) > 1:  # concatenate pairwise back to ``lanes`` lanes
            width = 2 * parts[0].type.count
            parts = [
                builder.shuffle_vector(parts[k], parts[k + 1], indices(range(width)))
                for k in range(0, len(parts), 2)
            ]
        y = parts[0]
        half = splat(vf, 0.5)
        s = builder.fmul(x, y)
        h = builder.fmul(y, half)
        if with_fma:
            e = fma(builder.fneg(s), h, half)
            s1 = fma(s, e, s)
            h1 = fma(e, h, h)
            r = fma(builder.fneg(s1), s1, x)
            root = fma(h1, r, s1)
        else:
            e = builder.fsub(half, builder.fmul(s, h))
            s1 = builder.fadd(builder.fmul(s, e), s)
            h1 = builder.fadd(builder.fmul(e, h), h)
            r = builder.fsub(x, builder.fmul(s1, s1))
            root = builder.fadd(builder.fmul(r, h1), s1)
        return root, builder.not_(off_path)

    return _sqrt_intrinsic(intrinsic, types, ir, body)


def _sqrtv_avx512(intrinsic, types, ir):
    """MKL's AVX-512 float32 HA kernel's main path (``mkl_vml_kernel_sSqrt_Z0HAynn``, read from
    libtorch_cpu's code): ``y = vrsqrt14ps(x)``, ``h = y * 0.5``, ``s = y * x``, ``r = fma(-s, s,
    x)``, ``sqrt = fma(r, h, s)``, on 0 < x < inf with ``y <= 2**39`` (MKL rescales smaller x).

    Taken sixteen lanes at a time (``vrsqrt14ps`` on a zmm register), with the fewest checks
    that select the same lanes: ``x < inf and y <= 2**39`` (a negative x or NaN has a NaN
    estimate, +0 and subnormals an infinite one; -0's estimate is -inf, and zeros are returned
    as they are anyway). Measured on an Intel Xeon with AVX-512, two threads, 4 x 16Mi
    elements, against torch fused, while the kernels' loops ran on ymm registers: Adagrad
    0.80-0.83x with sixteen lanes and four checks, 0.90-0.92x with eight (ymm), 0.96-0.98x with
    eight and two checks; with the loops on zmm (``wide_vectors``), sixteen lanes and two
    checks against eight: Adagrad 0.96x against 0.87x, Adam 1.04x against 1.01x; on four
    one-parameter optimizers of 4Mi, Adagrad 0.98x against 0.91x."""

    def body(builder, x, splat, fma):
        vf = x.type
        fnty = ir.FunctionType(vf, [vf, vf, ir.IntType(16)])
        rsqrt14 = builder.module.declare_intrinsic("llvm.x86.avx512.rsqrt14.ps.512", fnty=fnty)
        y = builder.call(rsqrt14, [x, splat(vf, 0.0), ir.Constant(ir.IntType(16), -1)])
        h = builder.fmul(y, splat(vf, 0.5))
        s = builder.fmul(y, x)
        root = fma(fma(builder.fneg(s), s, x), h, s)
        on_path = builder.and_(
            builder.fcmp_ordered("<", x, splat(vf, float("inf"))),
            builder.fcmp_ordered("<=", y, splat(vf, 2.0**39)),
        )
        return root, on_path

    return _sqrt_intrinsic(intrinsic, types, ir, body, width=16)


_INTRINSICS = (
    "fma",
    "prefetch4",
    "prefetch2",
    "wide_vectors",
    "pad_copy",
    "f32ptr",
    "u16ptr",
    "call_sqrt_at",
    "sqrtv_sse",
    "sqrtv_avx",
    "sqrtv_fma",
    "sqrtv_avx512",
    "widen_bfloat16",
    "widen_float16",
    "narrow_bfloat16",
    "narrow_float16",
)


def __getattr__(name):
    if name in _INTRINSICS:
        return _make_intrinsics()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KernelCompileError",
    "NumbaEngine",
    "NumbaKernel",
    "cache_dir",
    "compile_kernel",
    "generate",
    "kernel_source",
    "partition",
]
