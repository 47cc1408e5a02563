"""A kernel's scratch buffer (the sqrt blocks' roots, the padded copies of partial blocks) lives
until its thread's items are done. numba frees an array after its last use, and the generated
loop reaches the scratch by address only: before the fix it was freed at once, so anything that
allocated while the kernel ran (another thread, the sqrt routine itself) could be handed the
memory the kernel was still writing (a use-after-free: wrong roots, a corrupted heap)."""

import math
import re

import numba
import numpy as np
import pytest
import torch

from roundpipe.optim.backends.formulas import lerp_variant, lerp_weights
from roundpipe.optim.backends.numba_engine import PARALLEL_MIN_NUMEL, compile_kernel
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


@pytest.mark.parametrize("nthreads", [1, 2])
def test_the_scratch_outlives_the_sqrt_routines_allocations(nthreads):
    """The serial loop (one thread) freed it before the fix; the parallel loop's lived on."""
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), sqrt(b.tensor("grad")))
    program = b.build()
    kernel = compile_kernel(program, lerp_variant({}, lerp_weights(program)), frozenset(), "routine")
    scratch = int(re.search(r"np\.empty\((\d+), np\.float32\)", kernel.source.source).group(1))
    n = 2 * PARALLEL_MIN_NUMEL + 1000 if nthreads > 1 else 1000
    grad = torch.rand(n) * 100  # full blocks and a partial one (its padded copy in the scratch)
    results = []
    for routine in (_routine(0), _routine(scratch)):
        param = torch.zeros(n)
        kernel.run({"param": param, "grad": grad}, {}, nthreads, routine.address)
        results.append(param)
    assert not results[0].isnan().any()
    assert torch.equal(results[0], results[1]), "the routine's allocation overwrote the kernel's scratch"
