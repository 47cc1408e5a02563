"""Compiled kernels (``numba_engine/kernels.py``): the types numba compiled them for."""

import numba

from roundpipe.optim.backends import numba_engine, numexpr_engine

from ._helpers import SCALARS, engine, every_function_program, inputs


def test_kernel_types_are_float32():
    prog = every_function_program()
    k = engine().kernel(prog, (True,))
    t = inputs(numba_engine.PARALLEL_MIN_NUMEL)
    sc = dict(SCALARS, w=0.1, tiny=1e-3)
    for nthreads in (1, 2):
        k.run(t, numexpr_engine.scalar_env(sc, numexpr_engine.lerp_weights(prog)), nthreads=nthreads)
    for dispatcher in k.dispatchers:
        for sig in dispatcher.signatures:
            scalar_rows = sig[3]
            assert scalar_rows.dtype == numba.float32 and scalar_rows.ndim == 2, sig
            assert sig[2].dtype == numba.int64, sig  # the addresses
            assert sig[1].dtype == numba.int64 and sig[1].ndim == 1, sig  # the layout (pack_layout)
