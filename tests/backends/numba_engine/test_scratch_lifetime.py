"""A kernel's scratch buffer (the sqrt blocks' roots, the padded copies of partial blocks) lives
until its thread's items are done. numba frees an array after its last use, and the generated
loop reaches the scratch by address only: before the fix it was freed at once, so anything that
allocated while the kernel ran (another thread, the sqrt routine itself) could be handed the
memory the kernel was still writing (a use-after-free: wrong roots, a corrupted heap)."""

import math
import re

import numba
import numpy as np
import torch

from roundpipe.optim.backends.formulas import lerp_variant, lerp_weights
from roundpipe.optim.backends.numba_engine import compile_kernel
from roundpipe.optim.spec.ir import ProgramBuilder, sqrt

_SIGNATURE = numba.types.void(
    numba.types.int32,
    numba.types.CPointer(numba.types.float32),
    numba.types.CPointer(numba.types.float32),
    numba.types.int64,
)


def _routine(scribble: int):
    """A sqrt routine with vmsSqrt's signature (correctly rounded roots) that first allocates
    ``scribble`` float32 (0: none) and fills them with NaN: of the kernel's scratch size, the
    allocator hands back a chunk the kernel has just freed, if it has."""

    @numba.cfunc(_SIGNATURE)
    def routine(n, src, dst, mode):
        if scribble:
            junk = np.empty(scribble, np.float32)
            junk[:] = np.nan
        for i in range(n):
            dst[i] = math.sqrt(src[i])

    return routine


def test_the_scratch_outlives_the_sqrt_routines_allocations():
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), sqrt(b.tensor("grad")))
    program = b.build()
    kernel = compile_kernel(program, lerp_variant({}, lerp_weights(program)), frozenset(), "routine")
    scratch = int(re.search(r"np\.empty\((\d+), np\.float32\)", kernel.source.source).group(1))
    grad = torch.rand(1000) * 100  # 15 blocks and a partial one (its padded copy in the scratch)
    results = []
    for routine in (_routine(0), _routine(scratch)):
        param = torch.zeros(1000)
        kernel.run({"param": param, "grad": grad}, {}, 1, routine.address)
        results.append(param)
    assert not results[0].isnan().any()
    assert torch.equal(results[0], results[1]), "the routine's allocation overwrote the kernel's scratch"
