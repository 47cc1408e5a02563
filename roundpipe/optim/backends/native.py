"""The ``native`` backend: every tensor of a step updated by one parallel numba loop.

Each spec program is lowered (``formulas.py``, numba's dialect) to the statements of one loop
iteration and compiled, once per program and lerp variant, into a kernel that walks a table of
addresses:

.. code-block:: python

    def kernel_parallel(nthreads, bounds, items, ptrs, bucket, sv):
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

Rounding is torch's float32 rounding, bit for bit:

* every scalar and constant is a float32 value (``sv``), and every operation is on float32;
* each IR function is the shared formula of ``formulas.py`` (torch's formulas in torch's order);
* torch's vectorized CPU kernels compute ``add(a, b, alpha)``, ``addcmul`` and ``lerp`` with a
  fused multiply-add (one rounding where the formula has two). Which of them this torch fuses
  is measured once per process (``torch_fusion``), and exactly those call ``fma``
  (``llvm.fma.f32``). Nothing else is fused: without ``fastmath`` LLVM neither reassociates nor
  contracts ``a * b + c`` by itself;
* ``error_model="numpy"``: ``x / 0`` is IEEE (inf or NaN), not ``ZeroDivisionError``.

One torch op cannot be matched: torch's CPU ``sqrt`` is MKL's, which is off by one ulp in about
a fifth of the elements; the kernels' ``sqrt`` is correctly rounded (as numpy's and numexpr's).
Programs without ``sqrt`` (SGD, ASGD, Adamax, Rprop) equal torch.optim's for-loop bit for bit;
the others equal the reference backend bit for bit when its ``sqrt`` is correctly rounded.

Compiled kernels are cached on disk between processes: the generated source is written to
``<cache>/native/<module>.py`` (``<cache>`` is ``$ROUNDPIPE_CACHE_DIR``, else
``$XDG_CACHE_HOME/roundpipe``, else ``~/.cache/roundpipe``), the module name a hash of the
source and the numba version, and numba's ``cache=True`` keeps the machine code next to it in
``__pycache__``. When that directory cannot be written, a warning says so (once per process)
and kernels are compiled in memory, every process again.

Threads: a step runs ``min(roundpipe.optim.get_num_threads(), NUMBA_NUM_THREADS)`` threads of
numba's pool, fewer when the step has under ``PARALLEL_MIN_NUMEL`` elements per thread, and
only the serial loop on one thread (which also keeps a forked child, on one thread, from
numba's OpenMP layer, which aborts there). numba's OpenMP layer sets the process's OpenMP
thread count when its pool starts, and with torch's libgomp loaded first that is torch's: a
step puts torch's count back.

numba is an optional dependency (``pip install "roundpipe[native]"``); without it, choosing
this backend raises ``ImportError`` when the optimizer is constructed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
import threading
import types
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .. import threads
from ..spec.ir import Assign, Let
from . import Checked, CompileCache, segments
from .formulas import Lowering, lerp_variant, lerp_weights, scalar_env

logger = logging.getLogger("roundpipe.optim")

CACHE_ENV_VAR = "ROUNDPIPE_CACHE_DIR"
INSTALL_HINT = 'pip install "roundpipe[native]"'
# Bump when the generated code changes meaning without its text changing (it keys the cache).
GENERATOR_VERSION = 3
JIT_OPTIONS = dict(parallel=True, fastmath=False, error_model="numpy", nogil=True, boundscheck=False)
# Each thread gets at least this many elements (else fewer threads run): about 20 us of work at
# memory speed, where waking the pool's threads costs microseconds, and much more whenever the
# machine is busy (a parallel loop waits for its slowest thread).
PARALLEL_MIN_NUMEL = 1 << 15
# Thread shares are cut at multiples of this many elements (64 bytes: no shared cache lines).
ALIGN = 16

_F32 = np.float32


def import_numba():
    """The numba module, or ImportError saying how to install it."""
    try:
        import numba
    except ImportError as e:
        raise ImportError(
            f'roundpipe.optim backend="native" needs numba, which could not be imported ({e}); '
            f"install it with: {INSTALL_HINT}"
        ) from e
    return numba


def cache_dir() -> str:
    """Where generated kernels and numba's machine code are cached."""
    root = os.environ.get(CACHE_ENV_VAR)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "roundpipe")
    return os.path.join(root, "native")


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
        return f"np.sqrt({x})"  # a float32 in, a float32 out (math.sqrt would be float64)

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


def generate(program, variant: tuple, fused=frozenset()) -> KernelSource:
    """The kernel source for ``program`` and a lerp variant (``formulas.lerp_variant``);
    ``fused``: the IR functions (``add``, ``addcmul``, ``lerp``) torch computes with an FMA."""
    cg = _Codegen(program, variant, fused)
    for st in program.statements:
        cg.statement(st)
    tensors = tuple(program.tensors)
    scalars = tuple(sorted(cg.scalars))
    const_names = tuple(sorted(cg.consts))
    i4, i5 = " " * 12, " " * 16
    setup = [
        f"{i4}j = items[it, 0]",
        f"{i4}b = bucket[j]",
        *(f"{i4}{name} = sv[b, {k}]" for k, name in enumerate((*scalars, *const_names))),
        f"{i4}lo = items[it, 1]",
        f"{i4}m = items[it, 2] - lo",
        # the slice's own pointer and a loop from 0: numba then knows no index is negative
        # (no wraparound code), and LLVM vectorizes the loop (7x faster than range(lo, hi))
        *(f"{i4}{cg.arrays[t]} = carray(f32ptr(ptrs[{r}, j] + 4 * lo), m)" for r, t in enumerate(tensors)),
    ]
    body = [
        *(f"{i5}{cg._value(t, 0)} = {cg.arrays[t]}[i]" for t in cg.loads),
        *(f"{i5}{line}" for line in cg.body),
        *(f"{i5}{cg.arrays[t]}[i] = {cg.current[t]}" for t in program.targets),
    ]

    def kernel(name, loop):
        return [
            f"def {name}(nthreads, bounds, items, ptrs, bucket, sv):",
            f"    for w in {loop}(nthreads):",
            "        for it in range(bounds[w], bounds[w + 1]):",
            *setup,
            f"{i4}for i in range(m):",
            *body,
            "",
            "",
        ]

    lines = [
        "# Generated by roundpipe.optim.backends.native (do not edit): one parallel loop over",
        "# every slice of every tensor of a step, running this spec program,",
        "#",
        *(f"#   {line}" for line in str(program).splitlines()),
        "#",
        f"# lerp variant {tuple(variant)!r}, fused multiply-adds in {sorted(cg.fused)!r},",
        f"# generator version {GENERATOR_VERSION}. Every scalar and constant is a float32 read from",
        "# sv (a Python float literal would make numba compute in float64). The same loop twice:",
        "# kernel_parallel for numba.njit(parallel=True), kernel_serial for one thread.",
        "import numpy as np",
        "from numba import carray, prange",
        "",
        "from roundpipe.optim.backends.native import f32ptr" + (", fma" if cg.uses_fma else ""),
        "",
        "",
        *kernel("kernel_parallel", "prange"),
        *kernel("kernel_serial", "range"),
    ]
    consts = tuple(_F32(cg.consts[c]) for c in const_names)
    return KernelSource("\n".join(lines).rstrip() + "\n", tensors, scalars, consts)


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
    torch source rounds twice; its generic build does not. Measuring it makes the native
    kernels round as the torch in this process does, bit for bit.
    """
    global _fusion
    if _fusion is not None:
        return _fusion
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4099, generator=gen) for _ in range(3))
    A, B, C = (x.numpy() for x in (a, b, c))
    s, w, v = _F32(0.3), _F32(0.3), _F32(0.7)
    v_comp = _F32(1) - v

    def fma(x, y, z):  # float32 x * y + z rounded once: exact product and sum in float64
        f64 = np.float64
        return (np.asarray(x, f64) * np.asarray(y, f64) + np.asarray(z, f64)).astype(_F32)

    cases = {  # name: (torch's result, the formula rounded at each op, the same with an FMA)
        "add": (torch.add(a, b, alpha=0.3), A + s * B, fma(s, B, A)),
        "addcmul": (torch.addcmul(a, b, c, value=0.3), A + (s * B) * C, fma(s * B, C, A)),
        "lerp": (
            torch.cat([torch.lerp(a, b, float(w)), torch.lerp(a, b, float(v))]).numpy(),
            np.concatenate([A + w * (B - A), B - (B - A) * v_comp]),
            np.concatenate([fma(w, B - A, A), fma(v_comp, A - B, B)]),
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
    _fusion = (frozenset(fused), exact)
    return _fusion


# ---------------------------------------------------------------------------------------------
# compilation and the on-disk cache

_warned_readonly = False
_modules: dict = {}  # module name -> module (or namespace) holding the kernel function
_modules_lock = threading.Lock()


def _warn_uncached(directory, err):
    global _warned_readonly
    if _warned_readonly:
        return
    _warned_readonly = True
    msg = (
        f'roundpipe.optim backend="native": cannot write its kernel cache in {directory!r} ({err}); '
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
class NativeKernel:
    """A program's kernels (parallel and serial, each compiled on first call) for one variant."""

    program: object
    variant: tuple
    fused: frozenset
    source: KernelSource
    cached_on_disk: bool
    parallel: object  # numba dispatcher of kernel_parallel
    serial: object  # numba dispatcher of kernel_serial

    def run(self, tensors: dict, env: dict, nthreads: int = 1):
        """Run once on one set of same-shaped real float32 tensors (name -> tensor) with the
        scalars ``env`` (``scalar_env()``): for tests and tools; steps go through the backend."""
        table = _Table(self.source.tensors, [tensors["param"]])
        for r, name in enumerate(self.source.tensors):
            table.update(r, [tensors[name]])
        sv = np.asarray([self.sv_row(env)], dtype=np.float32)
        bounds, items = partition(table.sizes, nthreads)
        kernel = self.serial if nthreads == 1 else self.parallel
        kernel(nthreads, bounds, items, table.ptrs, table.bucket, sv)

    def sv_row(self, env: dict) -> list:
        """One row of ``sv``: the scalars (from scalar_env()) then the constants."""
        return [*(env[s] for s in self.source.scalars), *self.source.consts]

    @property
    def dispatchers(self):
        return (self.parallel, self.serial)


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


def compile_kernel(program, variant: tuple, fused=None) -> NativeKernel:
    """The kernels for ``program`` and a lerp variant; ``fused`` defaults to torch_fusion()'s.
    numba compiles (or loads from its cache) each of the two on its first call."""
    numba = import_numba()
    if fused is None:
        fused = torch_fusion()[0]
    fused = frozenset(fused)
    return _kernels.get((program, tuple(variant), fused), lambda: _compile(numba, program, variant, fused))


def _compile(numba, program, variant, fused) -> NativeKernel:
    ks = generate(program, variant, fused)
    key = f"{ks.source}\nnumba {numba.__version__}\ngenerator {GENERATOR_VERSION}"
    name = "roundpipe_native_" + hashlib.sha256(key.encode()).hexdigest()[:24]
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
    return NativeKernel(program, tuple(variant), fused, ks, on_disk, par, ser)


# ---------------------------------------------------------------------------------------------
# the backend

_F32_DTYPE = torch.float32


class NativeBackend:
    name = "native"

    def __init__(self):
        self._numba = import_numba()
        self.fused, self.exact = torch_fusion()

    def check_settings(self):
        threads.get_num_threads()

    def kernel(self, program, variant) -> NativeKernel:
        return compile_kernel(program, variant, self.fused)

    def run(self, program, scalars, columns, cache=None):
        """One kernel launch over every parameter of ``columns`` (see ``backends.Backend``)."""
        cache = {} if cache is None else cache
        params = columns["param"]
        weights = lerp_weights(program)
        segs = segments(scalars, len(params))
        by_variant: dict = {}
        for values, start, stop in segs:
            by_variant.setdefault(lerp_variant(values, weights), []).append((values, start, stop))
        # numba's OpenMP layer, when it starts its pool, sets the OpenMP thread count of the
        # process, which (with torch's libgomp loaded first) is torch's intra-op count: put
        # torch's back as it was, so a step never changes the caller's settings
        before = torch.get_num_threads()
        try:
            for variant, parts in by_variant.items():
                self._launch(self.kernel(program, variant), parts, columns, weights, cache)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def _launch(self, kernel, parts, columns, weights, cache):
        names = kernel.source.tensors
        params = columns["param"]
        table = cache.get("table")
        if table is None or table.names != names or table.params is not params:
            table = cache["table"] = _Table(names, params)
        for r, name in enumerate(names):
            table.update(r, columns[name])
        try:
            self._run_table(kernel, parts, table, weights)
        finally:
            table.release_volatile()

    def _run_table(self, kernel, parts, table, weights):
        params = table.params
        if table.total == 0:
            return
        bucket = table.bucket
        if len(parts) == 1 and parts[0][1] == 0 and parts[0][2] == len(params):
            bucket.fill(0)
            sv = np.asarray([kernel.sv_row(scalar_env(parts[0][0], weights))], dtype=np.float32)
        else:
            bucket.fill(-1)
            rows = []
            for k, (values, start, stop) in enumerate(parts):
                bucket[start:stop] = k
                rows.append(kernel.sv_row(scalar_env(values, weights)))
            sv = np.asarray(rows, dtype=np.float32)
        nthreads = self._threads(table.total)
        bounds, items = table.partition(nthreads, bucket)
        if nthreads == 1:
            kernel.serial(1, bounds, items, table.ptrs, bucket, sv)
        else:
            kernel.parallel(nthreads, bounds, items, table.ptrs, bucket, sv)

    def _threads(self, total: int) -> int:
        numba = self._numba
        n = min(threads.get_num_threads(), numba.config.NUMBA_NUM_THREADS, total // PARALLEL_MIN_NUMEL)
        n = max(1, n)
        if n > 1 and numba.get_num_threads() != n:
            numba.set_num_threads(n)
        return n


class _Table:
    """The addresses a launch reads: a row of ``data_ptr()`` per program tensor, refreshed for a
    column only when its list of tensors is a new one (the gradients, every step)."""

    def __init__(self, names, params):
        self.names = names
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.total = sum(self.sizes)
        self.ptrs = np.zeros((len(names), len(params)), dtype=np.int64)
        self.columns = [None] * len(names)
        self.volatile = [False] * len(names)  # a new list of tensors every step (the grads)
        self.bucket = np.zeros(len(params), dtype=np.int64)
        self._partitions: dict = {}

    def update(self, row: int, column):
        if column is self.columns[row]:
            return
        if type(column) is not Checked and (
            [t.numel() for t in column] != self.sizes
            or not all([t.dtype is _F32_DTYPE and t.is_contiguous() for t in column])
        ):
            raise ValueError(
                f"native kernel: {self.names[row]!r} tensors must be contiguous float32 of the "
                "parameters' sizes"
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

    def partition(self, nthreads, bucket):
        # parameters outside every segment (bucket -1) are not run
        key = (nthreads, bucket.tobytes()) if (bucket < 0).any() else nthreads
        hit = self._partitions.get(key)
        if hit is None:
            sizes = np.where(bucket >= 0, self.sizes, 0) if (bucket < 0).any() else self.sizes
            hit = self._partitions[key] = partition(list(sizes), nthreads)
        return hit


def kernel_source(program, variant=None, fused=None) -> str:
    """The generated source of ``program`` (for reading; ``variant`` defaults to small lerps)."""
    if variant is None:
        variant = (True,) * len(lerp_weights(program))
    return generate(program, variant, torch_fusion()[0] if fused is None else fused).source


# ---------------------------------------------------------------------------------------------
# intrinsics imported by the generated modules, built on first use (numba is optional):
# ``fma`` (float32 a * b + c rounded once) and ``f32ptr`` (an address as a float32 pointer)

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
        def f32ptr(typingctx, address):
            """The float32 pointer at an integer address (a tensor's ``data_ptr()``)."""
            if not isinstance(address, types.Integer):
                return None
            ptr = types.CPointer(types.float32)

            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_value_type(ptr))

            return ptr(address), codegen

        _intrinsics.update(fma=fma, f32ptr=f32ptr)
    return _intrinsics


def __getattr__(name):
    if name in ("fma", "f32ptr"):
        return _make_intrinsics()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "NativeBackend",
    "NativeKernel",
    "cache_dir",
    "compile_kernel",
    "generate",
    "kernel_source",
    "partition",
]
