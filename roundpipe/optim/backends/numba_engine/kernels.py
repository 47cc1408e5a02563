"""Compiling: a program's kernel module generated (``codegen``), written to the disk cache and
jitted by numba, once per program, lerp variant, fused set, sqrt kind and dtype names in a process
(``compile_kernel``); and the one sqrt kind this process's kernels use (``sqrt_kind``).

Kernels are shared between threads: built under a lock, immutable once built.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import CompileCache
from ..formulas import lerp_complement_var, lerp_variant, lerp_weights, scalar_var
from .codegen import KernelSource, generate
from .config import GENERATOR_VERSION, JIT_OPTIONS, import_numba
from .disk_cache import load_module, warn_uncached
from .layout import EMPTY_LAYOUT, AddressTable, pack_layout, partition
from .probes import find_sqrt_kind, torch_fusion, torch_sqrt


@contextlib.contextmanager
def keep_torch_threads():
    """numba's OpenMP layer, when it starts its pool, sets the OpenMP thread count of the
    process, which (with torch's libgomp loaded first) is torch's intra-op count: put torch's
    back as it was, so a step never changes the caller's settings."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


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
    low: object = None  # the low_precision.Rounding of a bfloat16 or float16 program

    def tails(self, torch_threads: int):
        """``layout.partition``'s ``tails`` for a launch of this kernel (None: no tail flag):
        torch's for-loop tails, or a fused program's remainders (one span a tensor)."""
        if not self.source.tails:
            return None
        if self.program.remainder_step:
            return (1, self.program.remainder_step)
        return (torch_threads, self.low.step)

    def row_layout(self, weights) -> tuple:
        """``(names, complements)``: where each scalar of a row of ``scalar_rows`` comes from,
        by the scalar's name (None for a lerp complement), and each lerp complement ``w - 1``
        (in float32) by ``(position, weight)``; the constants after them stay as they are.
        Computed once per kernel (``weights`` are its program's) and shared by its launches."""
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

    def run(self, tensors: dict, env: dict, nthreads: int = 1, sqrt_routine: int | None = None):
        """Run once on one set of same-shaped real float32 tensors (name -> tensor; of the
        program's dtype, for a low-precision one) with the scalars ``env`` (``scalar_env()``):
        for tests and tools; steps go through the engine. ``sqrt_routine``: the sqrt routine's
        address (default: torch's, ``torch_sqrt``). Tails as torch's for its thread count now."""
        dtypes = {n: tensors[n].dtype for n in self.source.tensors}
        table = AddressTable(self.source.tensors, [tensors["param"]], dtypes)
        for r, name in enumerate(self.source.tensors):
            table.update(r, [tensors[name]])
        scalar_rows = np.asarray([self.scalar_row(env)], dtype=np.float32)
        tails = self.tails(torch.get_num_threads())
        layout = pack_layout(*partition(table.sizes, nthreads, tails), np.zeros(1, np.int64))
        kernel = self.serial if nthreads == 1 else self.parallel
        routine = torch_sqrt()[0] if sqrt_routine is None else sqrt_routine
        if not routine and "emulated_sqrt_" in self.source.source:
            raise ValueError(
                "an emulated sqrt needs the routine's address (sqrt_routine): 0 is for 'routine'"
            )
        with keep_torch_threads():  # (a first parallel call starts numba's pool)
            kernel(nthreads, layout, table.addresses, scalar_rows, routine)

    def scalar_row(self, env: dict) -> list:
        """One row of ``scalar_rows``: the scalars (from scalar_env()) then the constants."""
        return [*(env[s] for s in self.source.scalars), *self.source.consts]

    def ensure_compiled(self, parallel: bool, addresses, scalar_rows):
        """Compile (or load from the disk cache) the kernel a launch will call, now: a call with
        the launch's argument types and no item runs nothing."""
        dispatcher = self.parallel if parallel else self.serial
        if not dispatcher.signatures:
            dispatcher(1, EMPTY_LAYOUT, addresses, scalar_rows, 0)
        return dispatcher

    @property
    def dispatchers(self):
        return (self.parallel, self.serial)


_kernels = CompileCache()


def compile_kernel(
    program,
    variant: tuple,
    fused=None,
    sqrt: str | None = None,
    dtype_names=("float32", None),
    low=None,
    stored=(),
) -> NumbaKernel:
    """The kernels for ``program`` and a lerp variant; ``fused`` defaults to torch_fusion()'s,
    ``sqrt`` (a ``SQRT_KINDS`` entry) to sqrt_kind()'s; ``dtype_names`` and ``low`` as
    ``generate``'s (a low-precision program takes its fused set from ``low``, and no sqrt
    kind: its root is the correctly rounded one), ``stored`` as ``generate``'s. numba compiles (or
    loads from its cache) each of the two on its first call."""
    numba = import_numba()
    if low is not None:
        fused, sqrt = low.fused, "routine"
    if fused is None:
        fused = torch_fusion()[0]
    fused = frozenset(fused)
    if sqrt is None:
        sqrt = sqrt_kind()
    key = (program, tuple(variant), fused, sqrt, tuple(dtype_names), low, tuple(stored))
    return _kernels.get(key, lambda: _compile(numba, program, variant, fused, sqrt, dtype_names, low, stored))


def _compile(numba, program, variant, fused, sqrt, dtype_names, low, stored):
    source = generate(program, variant, fused, sqrt, dtype_names, low, stored)
    parallel, serial, on_disk = jit_module(numba, "roundpipe_numba_", source.source)
    return NumbaKernel(program, tuple(variant), fused, source, on_disk, parallel, serial, low=low)


def jit_module(numba, prefix: str, source: str):
    """``(parallel, serial, on_disk)``: the generated module ``source`` (named by ``prefix`` and
    its hash, written to the disk cache) and numba's dispatchers of its ``kernel_parallel`` and
    ``kernel_serial``, cached on disk where the cache directory can be written."""
    key = f"{source}\nnumba {numba.__version__}\ngenerator {GENERATOR_VERSION}"
    name = prefix + hashlib.sha256(key.encode()).hexdigest()[:24]
    module, on_disk = load_module(name, source)
    serial_options = {**JIT_OPTIONS, "parallel": False}
    try:
        parallel = numba.njit(cache=on_disk, **JIT_OPTIONS)(module.kernel_parallel)
        serial = numba.njit(cache=on_disk, **serial_options)(module.kernel_serial)
    except RuntimeError as err:  # numba found no writable place for its cache files
        warn_uncached(os.path.dirname(module.__file__), err)
        on_disk = False
        parallel = numba.njit(cache=False, **JIT_OPTIONS)(module.kernel_parallel)
        serial = numba.njit(cache=False, **serial_options)(module.kernel_serial)
    return parallel, serial, on_disk


_kind = None
_kind_lock = threading.Lock()


def sqrt_kind() -> str:
    """How this process's kernels take torch's roots (``SQRT_KINDS``), probed once
    (``probes.find_sqrt_kind``, with a kernel ``param = sqrt(grad)`` compiled like any other
    and cached on disk)."""
    global _kind
    if _kind is None:
        with _kind_lock:
            if _kind is None:
                _kind = find_sqrt_kind(_run_root_kernel)
    return _kind


def _run_root_kernel(kind, out, x, address):
    """The sqrt probe's kernel: ``out = sqrt(x)`` taken as ``kind`` takes it."""
    from ...spec.ir import ProgramBuilder, sqrt

    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), sqrt(b.tensor("grad")))
    program = b.build()
    kernel = compile_kernel(program, lerp_variant({}, lerp_weights(program)), frozenset(), kind)
    kernel.run({"param": out, "grad": x}, {}, 1, address)


def kernel_source(program, variant=None, fused=None) -> str:
    """The generated source of ``program`` (for reading; ``variant`` defaults to small lerps)."""
    if variant is None:
        variant = (True,) * len(lerp_weights(program))
    return generate(program, variant, torch_fusion()[0] if fused is None else fused).source
