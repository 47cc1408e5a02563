"""The ``numba`` engine of the ``fast`` backend (its default): every tensor of a step updated by
one parallel numba loop, bit for bit torch.optim's for-loop (``foreach=False``).

Each spec program is lowered to the statements of one loop iteration and compiled, once per
program and lerp variant, into a kernel that walks a table of addresses; the elements of all
the step's tensors are split into equal shares, one per thread, in one parallel region. How it
works, and why each tuned constant has its value: docs/numba-engine.md.

Modules, each importing only those listed before it:

* ``config``: tuned constants, the sqrt kinds, numba's import;
* ``probes``: what the kernels must reproduce (torch's fused multiply-adds, its sqrt routine,
  numba's target CPU, which emulation of MKL's sqrt equals torch's);
* ``lowering``: a program as records of one iteration, and the passes of a chunk;
* ``codegen``: the kernel module's source;
* ``intrinsics``, ``sqrt_emulation``, ``conversions``: what the generated kernels call (they
  import numba: loaded with the first kernel);
* ``disk_cache``: kernel modules on disk, next to numba's machine code;
* ``layout``: the address table and each thread's share of a launch;
* ``kernels``: compiling (``compile_kernel``) and the process's sqrt kind;
* ``engine``: ``NumbaEngine``, its launches and their replay;
* ``norms``: the gradients' norm sums in one read-only pass (loss scaling and clipping);
* the passes of a staged step (Adafactor, Muon): ``staged_source`` (a pass's kernel source) and
  ``staged_layout`` (a launch's items and scalar rows), ``staged`` (compiling and launching a
  pass: ``prepare``), ``staged_probes`` (the reduction order and fusion torch's ops have).
"""

from __future__ import annotations

from .codegen import KernelSource, generate
from .config import (
    ALIGN,
    CACHE_ENV_VAR,
    GENERATOR_VERSION,
    INSTALL_HINT,
    PARALLEL_MIN_NUMEL,
    PREFETCH_CHUNKS,
    SQRT_CHUNK,
    SQRT_KINDS,
    SQRT_LANES,
    import_numba,
)
from .disk_cache import cache_dir
from .engine import KernelCompileError, NumbaEngine
from .kernels import NumbaKernel, compile_kernel, kernel_source, sqrt_kind
from .layout import pack_layout, partition
from .norms import gradient_sums
from .norms import supported as norms_supported
from .probes import torch_fusion, torch_sqrt

__all__ = [
    "ALIGN",
    "CACHE_ENV_VAR",
    "GENERATOR_VERSION",
    "INSTALL_HINT",
    "PARALLEL_MIN_NUMEL",
    "PREFETCH_CHUNKS",
    "SQRT_CHUNK",
    "SQRT_KINDS",
    "SQRT_LANES",
    "KernelCompileError",
    "KernelSource",
    "NumbaEngine",
    "NumbaKernel",
    "cache_dir",
    "compile_kernel",
    "generate",
    "gradient_sums",
    "import_numba",
    "kernel_source",
    "norms_supported",
    "pack_layout",
    "partition",
    "sqrt_kind",
    "torch_fusion",
    "torch_sqrt",
]
