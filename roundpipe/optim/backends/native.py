"""The ``native`` backend: each spec program compiled by numba into one parallel loop over elements.

``backend="native"`` is the ``fast`` backend (same batching of small parameters into flat
buffers, same in-place contract) with a third engine: the program, for each lerp variant, is
translated into the Python source of one kernel

.. code-block:: python

    def kernel(n, t0_param, t1_grad, ..., s_beta2, ..., c_3f800000):
        for i in prange(n):
            v_param_0 = t0_param[i]  # every tensor the program reads, loaded once
            ...
            l_denom = ...  # a ``let``: a local value
            v_param_1 = ...  # an ``assign``: the tensor's new current value
            t0_param[i] = v_param_1  # every target, stored once
            ...

compiled with ``numba.njit(parallel=True, fastmath=False, error_model="numpy")`` and run in
place on zero-copy numpy views, so a step reads each tensor once and writes each target once
(the torch engine streams every operand through the cache once per operation).

Rounding is torch's float32 rounding: every scalar and constant is a ``np.float32`` argument
(a Python float literal would make numba compute in float64), each IR function is lowered to
the formula ``numexpr_engine`` uses (torch's own formulas, in torch's order: lerp's two
branches, NaN-propagating ``maximum`` and ``clamp``, ``sign(NaN) = 0``, ``number / tensor`` as
``reciprocal(tensor) * number``), and without ``fastmath`` LLVM neither reassociates nor
contracts ``a * b + c`` into an FMA. ``error_model="numpy"`` makes ``x / 0`` IEEE (inf/NaN)
instead of raising ``ZeroDivisionError``.

Compiled kernels are cached on disk between processes: the generated source is written to
``<cache>/native/<module>.py`` (``<cache>`` is ``$ROUNDPIPE_CACHE_DIR``, else
``$XDG_CACHE_HOME/roundpipe``, else ``~/.cache/roundpipe``), the module name a hash of the
source and the numba version, and numba's ``cache=True`` keeps the machine code next to it in
``__pycache__``. When that directory cannot be written, a warning says so (once per process)
and kernels are compiled in memory, every process again.

Threads: numba's pool runs ``min(roundpipe.optim.get_num_threads(), NUMBA_NUM_THREADS)``
threads during a step.

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
import warnings
from dataclasses import dataclass

import numpy as np

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

_F32 = np.float32


def import_numba():
    """The numba module, or ImportError saying how to install it."""
    try:
        import numba
    except ImportError as e:
        raise ImportError(
            f'roundpipe.optim backend="native" needs numba, which is not installed ({e}); '
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
    consts: tuple  # float32 constant values, in argument order


class _Codegen:
    """Lowers a program to the statements of one loop iteration."""

    def __init__(self, program, variant):
        self.program = program
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

    # torch's float32 formulas, as numexpr_engine lowers them (same formulas, same order)
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
        return f"({self(a)} + {self._scaled(alpha, b)})"

    def fn_addcmul(self, a, b, c, value):
        return f"({self(a)} + ({self._scaled(value, b)} * {self(c)}))"

    def fn_addcdiv(self, a, b, c, value):
        return f"({self(a)} + ({self._scaled(value, b)} / {self(c)}))"

    def fn_lerp(self, a, b, w):
        # ATen's lerp: small weights go from the start, large ones back from the end
        a, b = self.temp(self(a)), self.temp(self(b))
        if self.lerp_small[w.name]:
            return f"({a} + ({self.scalar(w.name)} * ({b} - {a})))"
        comp = numexpr_engine.lerp_complement_var(w.name)
        if comp not in self.scalars:
            self.scalars.append(comp)
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


def generate(program, variant: tuple) -> KernelSource:
    """The kernel source for ``program`` and a lerp variant (``numexpr_engine.lerp_variant``)."""
    cg = _Codegen(program, variant)
    for st in program.statements:
        cg.statement(st)
    tensors = tuple(program.tensors)
    scalars = tuple(sorted(cg.scalars))
    const_names = tuple(sorted(cg.consts))
    args = ["n", *(cg.arrays[t] for t in tensors), *scalars, *const_names]
    ind = " " * 8
    lines = [
        "# Generated by roundpipe.optim.backends.native (do not edit): one loop iteration of",
        f"# a spec program, lerp variant {tuple(variant)!r}, generator version {GENERATOR_VERSION}.",
        "#",
        *(f"#   {line}" for line in str(program).splitlines()),
        "#",
        "# Every scalar and constant is a float32 argument: a Python float literal would be float64.",
        "import numpy as np",
        "from numba import prange",
        "",
        "",
        f"def kernel({', '.join(args)}):",
        "    for i in prange(n):",
        *(f"{ind}{cg._value(t, 0)} = {cg.arrays[t]}[i]" for t in cg.loads),
        *(f"{ind}{line}" for line in cg.body),
        *(f"{ind}{cg.arrays[t]}[i] = {cg.current[t]}" for t in program.targets),
        "",
    ]
    consts = tuple(cg.consts[c] for c in const_names)
    return KernelSource("\n".join(lines), tensors, scalars, consts)


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
    return _Namespace(namespace), False


class _Namespace:
    def __init__(self, d):
        self.__dict__.update(d)


@dataclass
class NativeKernel:
    """A compiled kernel and how to call it."""

    program: object
    variant: tuple
    source: KernelSource
    module_name: str
    cached_on_disk: bool
    dispatcher: object  # the numba dispatcher

    def run(self, tensors: dict, env: dict):
        """Run in place. ``tensors``: name -> real float32 tensor; ``env``: scalar_env()."""
        arrays = [tensors[name].detach().view(-1).numpy() for name in self.source.tensors]
        n = arrays[0].shape[0]
        for name, a in zip(self.source.tensors, arrays, strict=True):
            if a.shape[0] != n or a.dtype != _F32:
                raise ValueError(f"native kernel: {name!r} has {a.shape[0]} {a.dtype} elements, expected {n}")
        if n == 0:
            return
        self.dispatcher(n, *arrays, *[env[s] for s in self.source.scalars], *self.source.consts)


def compile_kernel(program, variant: tuple) -> NativeKernel:
    numba = import_numba()
    ks = generate(program, variant)
    key = f"{ks.source}\nnumba {numba.__version__}\ngenerator {GENERATOR_VERSION}"
    name = "roundpipe_native_" + hashlib.sha256(key.encode()).hexdigest()[:24]
    with _modules_lock:
        hit = _modules.get(name)
        if hit is None:
            module, on_disk = _load_module(name, ks.source)
            dispatcher = numba.njit(cache=on_disk, **JIT_OPTIONS)(module.kernel)
            hit = _modules[name] = (dispatcher, on_disk)
    dispatcher, on_disk = hit
    consts = tuple(_F32(v) for v in ks.consts)
    ks = KernelSource(ks.source, ks.tensors, ks.scalars, consts)
    return NativeKernel(program, tuple(variant), ks, name, on_disk, dispatcher)


# ---------------------------------------------------------------------------------------------
# the backend


class NativeBackend(FastBackend):
    name = "native"

    def __init__(self):
        self._numba = import_numba()
        super().__init__()
        self._native: dict = {}

    def check_settings(self):
        threads.get_num_threads()

    def engine(self, program, variant, scalars, nthreads) -> str:
        return "native"

    def kernel(self, program, variant) -> NativeKernel:
        key = (id(program), variant)
        hit = self._native.get(key)
        if hit is None or hit.program is not program:
            hit = compile_kernel(program, variant)
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
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)
        return lambda tensors: kernel.run(tensors, env)


def kernel_source(program, variant=None) -> str:
    """The generated source of ``program`` (for reading; ``variant`` defaults to small lerps)."""
    if variant is None:
        variant = (True,) * len(numexpr_engine.lerp_weights(program))
    return generate(program, variant).source


__all__ = ["NativeBackend", "NativeKernel", "cache_dir", "compile_kernel", "generate", "kernel_source"]
