"""The ``native`` backend: each spec program compiled by numba into one loop over elements.

``backend="native"`` is the ``fast`` backend (same batching of small parameters into flat
buffers, same in-place contract) with a third engine: the program, for each lerp variant, is
translated into the Python source of one loop

.. code-block:: python

    def kernel_parallel(n, t0_param, t1_grad, ..., s_beta2, ..., c_3f800000):
        for i in prange(n):
            v0_param_0 = t0_param[i]  # every tensor the program reads, loaded once
            ...
            l2_denom = ...  # a ``let``: a local value
            v0_param_1 = ...  # an ``assign``: the tensor's new current value
            t0_param[i] = v0_param_1  # every target, stored once, after all the loads
            ...

compiled with ``numba.njit(parallel=True, fastmath=False, error_model="numpy")`` and run in
place on zero-copy numpy views, so a step reads each tensor once and writes each target once
(the torch engine streams every operand through the cache once per operation). The same loop
is also compiled serially (``kernel_serial``) for steps on one thread.

Rounding is torch's float32 rounding, bit for bit:

* every scalar and constant is a ``np.float32`` argument (numba would type a Python float
  literal as float64), and every operation is on float32 values;
* each IR function is lowered to the formula ``numexpr_engine`` uses (torch's formulas in
  torch's order: lerp's two branches, NaN-propagating ``maximum`` and ``clamp``,
  ``sign(NaN) = 0``, ``number / tensor`` as ``reciprocal(tensor) * number``);
* with one addition: torch's vectorized CPU kernels compute ``add(a, b, alpha)``, ``addcmul``
  and ``lerp`` with a fused multiply-add (one rounding where the formula has two). Which of them
  this torch fuses is measured once per process (``torch_fusion``), and exactly those call
  ``fma`` (``llvm.fma.f32``). Nothing else is fused: without ``fastmath`` LLVM neither
  reassociates nor contracts ``a * b + c`` by itself;
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
numba's pool on tensors (or flat buffers of small ones) of at least ``PARALLEL_MIN_NUMEL``
elements, the serial loop on smaller ones; on one thread it runs only the serial loop and never
starts that pool (which also
keeps a forked child, on one thread, from numba's OpenMP layer, which aborts there). numba's
OpenMP layer sets the process's OpenMP thread count when its pool starts, and with torch's
libgomp loaded first that is torch's: a step puts torch's count back.

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
from ..spec.ir import Assign, Bin, Const, Let, Scalar, Tensor
from . import numexpr_engine
from .fast import FastBackend

logger = logging.getLogger("roundpipe.optim")

CACHE_ENV_VAR = "ROUNDPIPE_CACHE_DIR"
INSTALL_HINT = 'pip install "roundpipe[native]"'
# Bump when the generated code changes meaning without its text changing (it keys the cache).
GENERATOR_VERSION = 1
JIT_OPTIONS = dict(parallel=True, fastmath=False, error_model="numpy", nogil=True, boundscheck=False)
# Fewer elements than this run the serial loop even with more threads: about 20 us of work at
# memory speed, where waking the pool's threads costs microseconds, and much more whenever the
# machine is busy (a parallel loop waits for its slowest thread).
PARALLEL_MIN_NUMEL = 1 << 15

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
    """The generated kernel and the order of its arguments after ``n``."""

    source: str
    tensors: tuple  # program tensor names, in argument order
    scalars: tuple  # scalar_env() keys, in argument order
    consts: tuple  # np.float32 constant values, in argument order


class _Codegen:
    """Lowers a program to the statements of one loop iteration."""

    def __init__(self, program, variant, fused):
        self.program = program
        self.fused = frozenset(fused)
        self.uses_fma = False
        self.lerp_small = dict(zip(numexpr_engine.lerp_weights(program), variant, strict=True))
        self.arrays = {name: _ident("t", i, name) for i, name in enumerate(program.tensors)}
        self.current: dict[str, str] = {}  # input tensor -> local holding its current value
        self.versions: dict[str, int] = {}
        self.loads: list[str] = []  # input tensors read before they are first assigned
        self.lets: dict[str, str] = {}  # let name -> local
        self.scalars: list[str] = []  # scalar argument names
        self.consts: dict[str, float] = {}  # constant argument name -> value
        self.body: list[str] = []
        self.ntemp = 0

    # -- names ----------------------------------------------------------------------------
    def _value(self, name: str, version: int) -> str:
        base = self.arrays[name]
        return f"v{base[1:]}_{version}"

    def tensor(self, name: str) -> str:
        if name in self.lets:
            return self.lets[name]
        if name not in self.current:
            self.loads.append(name)
            self.versions[name] = 0
            self.current[name] = self._value(name, 0)
        return self.current[name]

    def scalar(self, name: str) -> str:
        var = numexpr_engine.scalar_var(name)
        if var not in self.scalars:
            self.scalars.append(var)
        return var

    def const(self, value: float) -> str:
        name = numexpr_engine.const_var(value)
        self.consts[name] = value
        return name

    def temp(self, code: str) -> str:
        """Bind a sub-expression used more than once to a local (plain names stay inline)."""
        if code.isidentifier():
            return code
        self.ntemp += 1
        name = f"e{self.ntemp}"
        self.body.append(f"{name} = {code}")
        return name

    # -- expressions ----------------------------------------------------------------------
    def __call__(self, e) -> str:
        if isinstance(e, Tensor):
            return self.tensor(e.name)
        if isinstance(e, Scalar):
            return self.scalar(e.name)
        if isinstance(e, Const):
            return self.const(e.value)
        if isinstance(e, Bin):
            if e.op == "/" and not e.a.is_tensor():
                # torch computes number / tensor as reciprocal(tensor) * number
                return f"(({self.const(1.0)} / {self(e.b)}) * {self(e.a)})"
            return f"({self(e.a)} {e.op} {self(e.b)})"
        return getattr(self, "fn_" + e.fn)(*e.args)

    def fma(self, a, b, c) -> str:
        """``a * b + c`` rounded once (``llvm.fma.f32``), as torch's vectorized kernels do."""
        self.uses_fma = True
        return f"fma({a}, {b}, {c})"

    # torch's float32 formulas, as numexpr_engine lowers them (same formulas, same order), with
    # one difference: where torch's CPU kernel computes ``a * b + c`` as one fused multiply-add
    # (``fused``, see torch_fusion()), so does the kernel.
    def fn_neg(self, x):
        return f"(-{self(x)})"

    def fn_sqrt(self, x):
        return f"np.sqrt({self(x)})"  # a float32 in, a float32 out (math.sqrt would be float64)

    def fn_abs(self, x):
        return f"abs({self(x)})"

    def fn_sign(self, x):
        # torch.sign: (0 < x) - (x < 0); NaN gives 0
        x = self.temp(self(x))
        zero, one, minus = self.const(0.0), self.const(1.0), self.const(-1.0)
        return f"({one} if {x} > {zero} else ({minus} if {x} < {zero} else {zero}))"

    def fn_maximum(self, a, b):
        # torch.maximum: NaN propagates from either side
        a, b = self.temp(self(a)), self.temp(self(b))
        return f"({a} if ({a} > {b} or {a} != {a}) else {b})"

    def fn_where(self, c, a, b):
        return f"({self(a)} if {self(c)} else {self(b)})"

    def fn_clamp(self, x, lo, hi):
        # torch.clamp = min(max(x, lo), hi), NaN propagating
        x, lo, hi = self.temp(self(x)), self(lo), self(hi)
        low = self.temp(f"({lo} if {x} < {lo} else {x})")
        return f"({hi} if {low} > {hi} else {low})"

    def _scaled(self, scale, x):
        if isinstance(scale, Const) and scale.value == 1.0:
            return self(x)
        return f"({self(scale)} * {self(x)})"

    def fn_add(self, a, b, alpha):
        if isinstance(alpha, Const) and alpha.value == -1.0:
            return f"({self(a)} - {self(b)})"
        if isinstance(alpha, Const) and alpha.value == 1.0:
            return f"({self(a)} + {self(b)})"
        if "add" in self.fused:
            return self.fma(self(alpha), self(b), self(a))
        return f"({self(a)} + {self._scaled(alpha, b)})"

    def fn_addcmul(self, a, b, c, value):
        if "addcmul" in self.fused:
            return self.fma(self._scaled(value, b), self(c), self(a))
        return f"({self(a)} + ({self._scaled(value, b)} * {self(c)}))"

    def fn_addcdiv(self, a, b, c, value):
        return f"({self(a)} + ({self._scaled(value, b)} / {self(c)}))"

    def fn_lerp(self, a, b, w):
        # ATen's lerp: small weights go from the start, large ones back from the end
        a, b = self.temp(self(a)), self.temp(self(b))
        fused = "lerp" in self.fused
        if self.lerp_small[w.name]:
            w = self.scalar(w.name)
            return self.fma(w, f"({b} - {a})", a) if fused else f"({a} + ({w} * ({b} - {a})))"
        comp = numexpr_engine.lerp_complement_var(w.name)
        if comp not in self.scalars:
            self.scalars.append(comp)
        if fused:  # end - (end - start) * (1 - w), rounded once
            return self.fma(f"({a} - {b})", comp, b)
        return f"({b} - (({b} - {a}) * {comp}))"

    # -- statements -----------------------------------------------------------------------
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
    """The kernel source for ``program`` and a lerp variant (``numexpr_engine.lerp_variant``);
    ``fused``: the IR functions (``add``, ``addcmul``, ``lerp``) torch computes with an FMA."""
    cg = _Codegen(program, variant, fused)
    for st in program.statements:
        cg.statement(st)
    tensors = tuple(program.tensors)
    scalars = tuple(sorted(cg.scalars))
    const_names = tuple(sorted(cg.consts))
    args = ", ".join(["n", *(cg.arrays[t] for t in tensors), *scalars, *const_names])
    ind = " " * 8
    body = [
        *(f"{ind}{cg._value(t, 0)} = {cg.arrays[t]}[i]" for t in cg.loads),
        *(f"{ind}{line}" for line in cg.body),
        *(f"{ind}{cg.arrays[t]}[i] = {cg.current[t]}" for t in program.targets),
    ]
    lines = [
        "# Generated by roundpipe.optim.backends.native (do not edit): one loop iteration of",
        "# this spec program,",
        "#",
        *(f"#   {line}" for line in str(program).splitlines()),
        "#",
        f"# lerp variant {tuple(variant)!r}, fused multiply-adds in {sorted(cg.fused)!r},",
        f"# generator version {GENERATOR_VERSION}. Every scalar and constant is a float32 argument",
        "# (a Python float literal would make numba compute in float64). The same loop twice:",
        "# kernel_parallel for numba.njit(parallel=True), kernel_serial for one thread.",
        "import numpy as np",
        "from numba import prange",
        "",
        *(["from roundpipe.optim.backends.native import fma", ""] if cg.uses_fma else []),
        "",
        f"def kernel_parallel({args}):",
        "    for i in prange(n):",
        *body,
        "",
        "",
        f"def kernel_serial({args}):",
        "    for i in range(n):",
        *body,
        "",
    ]
    consts = tuple(_F32(cg.consts[c]) for c in const_names)
    return KernelSource("\n".join(lines), tensors, scalars, consts)


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
    """A program's kernels (parallel and serial, each compiled on first use) and how to call them."""

    program: object
    variant: tuple
    fused: frozenset
    source: KernelSource
    module_name: str
    cached_on_disk: bool
    parallel: object  # numba dispatcher of kernel_parallel
    serial: object  # numba dispatcher of kernel_serial

    def run(self, tensors: dict, env: dict, parallel: bool = True):
        """Run in place. ``tensors``: name -> real float32 tensor; ``env``: scalar_env().
        ``parallel``: the parallel loop (on numba's current thread count) where there are at
        least PARALLEL_MIN_NUMEL elements, else the serial one."""
        arrays = [tensors[name].detach().view(-1).numpy() for name in self.source.tensors]
        n = arrays[0].shape[0]
        for name, a in zip(self.source.tensors, arrays, strict=True):
            if a.shape[0] != n or a.dtype != _F32:
                raise ValueError(f"native kernel: {name!r} has {a.shape[0]} {a.dtype} elements, expected {n}")
        if n == 0:
            return
        kernel = self.parallel if parallel and n >= PARALLEL_MIN_NUMEL else self.serial
        kernel(n, *arrays, *[env[s] for s in self.source.scalars], *self.source.consts)

    @property
    def dispatchers(self):
        return (self.parallel, self.serial)


def compile_kernel(program, variant: tuple, fused=None) -> NativeKernel:
    """The kernels for ``program`` and a lerp variant; ``fused`` defaults to torch_fusion()'s.
    numba compiles (or loads from its cache) each of the two on its first call."""
    numba = import_numba()
    if fused is None:
        fused = torch_fusion()[0]
    ks = generate(program, variant, fused)
    key = f"{ks.source}\nnumba {numba.__version__}\ngenerator {GENERATOR_VERSION}"
    name = "roundpipe_native_" + hashlib.sha256(key.encode()).hexdigest()[:24]
    with _modules_lock:
        hit = _modules.get(name)
        if hit is None:
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
            hit = _modules[name] = (par, ser, on_disk)
    par, ser, on_disk = hit
    return NativeKernel(program, tuple(variant), frozenset(fused), ks, name, on_disk, par, ser)


# ---------------------------------------------------------------------------------------------
# the backend


class NativeBackend(FastBackend):
    name = "native"

    def __init__(self):
        self._numba = import_numba()
        super().__init__()
        self._native: dict = {}
        self.fused, self.exact = torch_fusion()

    def check_settings(self):
        threads.get_num_threads()

    def engine(self, program, variant, scalars, nthreads) -> str:
        return "native"

    def run(self, program, scalars, columns, cache=None):
        # numba's OpenMP threading layer, when it starts its pool, sets the OpenMP thread count
        # of the process, which (with torch's libgomp loaded first) is torch's intra-op count:
        # put torch's back as it was, so a step never changes the caller's settings
        before = torch.get_num_threads()
        try:
            super().run(program, scalars, columns, cache)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def kernel(self, program, variant) -> NativeKernel:
        key = (id(program), variant)
        hit = self._native.get(key)
        if hit is None or hit.program is not program:
            hit = compile_kernel(program, variant, self.fused)
            with self._lock:
                self._native[key] = hit
        return hit

    def executor(self, engine, program, variant, scalars, nthreads):
        if engine != "native":
            return super().executor(engine, program, variant, scalars, nthreads)
        kernel = self.kernel(program, variant)
        env = numexpr_engine.scalar_env(scalars, numexpr_engine.lerp_weights(program))
        numba = self._numba
        n = max(1, min(nthreads, numba.config.NUMBA_NUM_THREADS))
        if n == 1:
            # one thread: the serial loop, without numba's thread pool (no launch, and safe in
            # a forked child, where numba's OpenMP layer would abort the process)
            return lambda tensors: kernel.run(tensors, env, parallel=False)
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)
        return lambda tensors: kernel.run(tensors, env)


def kernel_source(program, variant=None, fused=None) -> str:
    """The generated source of ``program`` (for reading; ``variant`` defaults to small lerps)."""
    if variant is None:
        variant = (True,) * len(numexpr_engine.lerp_weights(program))
    return generate(program, variant, torch_fusion()[0] if fused is None else fused).source


# ---------------------------------------------------------------------------------------------
# ``fma``: imported by the generated modules, built on first use (numba is optional)

_fma = None


def _make_fma():
    global _fma
    if _fma is None:
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

        _fma = fma
    return _fma


def __getattr__(name):
    if name == "fma":
        return _make_fma()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NativeBackend", "NativeKernel", "cache_dir", "compile_kernel", "generate", "kernel_source"]
