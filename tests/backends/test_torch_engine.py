"""The torch engine (``backends/torch_engine.py``): run directly in chunks of any size, and the
chunk size each program gets."""

import pytest

from roundpipe.optim.backends import torch_engine
from roundpipe.optim.spec import SPECS

from ._common import SCALARS, assert_matches, by_hand, every_function_program, inputs


@pytest.mark.parametrize("chunk", [1, 7, 256, 1 << 18])
def test_torch_engine_directly_in_chunks(chunk):
    prog = every_function_program()
    sc = dict(SCALARS, w=0.3, tiny=1e-3)
    tp = torch_engine.compile_program(prog)
    t = inputs(0)
    expected = by_hand(t, sc)
    tp.run(t, sc, chunk=chunk)
    assert_matches(t, expected, f"chunk={chunk}")


def test_torch_engine_chunk_follows_the_working_set():
    """Short programs (few operands) get larger chunks, long ones smaller; always within bounds."""
    lo, hi = torch_engine.MIN_CHUNK, torch_engine.MAX_CHUNK
    sizes = [torch_engine.chunk_size(n) for n in range(1, 40)]
    assert sizes == sorted(sizes, reverse=True)
    assert all(lo <= c <= hi and c & (c - 1) == 0 for c in sizes)
    assert sizes[0] == hi and sizes[-1] == lo
    # every chunk of a program's operands fits the working set, unless already at the minimum
    assert all(c * 4 * n <= torch_engine.WORKING_SET or c == lo for n, c in enumerate(sizes, 1))
    # SGD with momentum touches param, grad, momentum_buffer and one scratch slot
    g = dict(lr=0.1, momentum=0.9, dampening=0, weight_decay=0, nesterov=False, maximize=False)
    sgd = SPECS["SGD"].program({**SPECS["SGD"].options(g), "first": False})
    assert torch_engine.compile_program(sgd).chunk == torch_engine.chunk_size(4)
