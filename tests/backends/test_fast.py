"""The fast backend (``backends/fast.py``): many parameters of mixed sizes in one run (small
ones batched through a cached workspace), and the engine it picks."""

import pytest
import torch

from roundpipe.optim import backends
from roundpipe.optim.backends import fast

from ._common import INPUTS, SCALARS, every_function_program, inputs, run


def test_fast_backend_many_tensors_in_one_run(engine):
    """A run over many parameters of mixed sizes (small ones are batched into flat buffers)
    gives each the result it gets alone, written into its own tensor."""
    prog = every_function_program()
    sc = dict(SCALARS, w=0.2, tiny=1e-3)
    sizes = [1, 33, 0, 5000, fast.SMALL_NUMEL + 3, 2, (4, 5)]
    cols = {k: [] for k in INPUTS}
    expected = []
    for i, n in enumerate(sizes):
        shape = n if isinstance(n, tuple) else (n,)
        numel = int(torch.tensor(shape).prod())
        t = {k: v.reshape(shape) for k, v in inputs(100 + i, n=numel, nan=numel > 20).items()}
        expected.append({k: v.clone() for k, v in t.items()})
        for k in INPUTS:
            cols[k].append(t[k])
    ptrs = {k: [t.data_ptr() for t in v] for k, v in cols.items()}
    objs = {k: list(v) for k, v in cols.items()}
    cache = {}
    for _ in range(2):  # the second run reuses the cached workspace
        backends.get("fast").run(prog, sc, cols, cache)
        for e in expected:
            run("reference", prog, e, sc)
    assert cache, "small tensors were not batched through a cached workspace"
    for i, e in enumerate(expected):
        got = {k: cols[k][i] for k in INPUTS}
        for k in INPUTS:
            torch.testing.assert_close(
                got[k], e[k], equal_nan=True, rtol=1e-5, atol=1e-6, msg=f"item {i} {k}"
            )
    for k in INPUTS:
        assert [t.data_ptr() for t in cols[k]] == ptrs[k]
        assert all(a is b for a, b in zip(cols[k], objs[k], strict=True))


def test_default_engine_is_numba(monkeypatch):
    """Without ROUNDPIPE_OPTIM_ENGINE the fast backend runs the numba engine; a named engine
    is that engine; a bad setting is rejected before anything runs."""
    monkeypatch.delenv(fast.ENGINE_ENV_VAR, raising=False)
    prog = every_function_program()
    assert fast.FastBackend().engine(prog) == "numba"
    assert backends.get("fast:numexpr").engine(prog) == "numexpr"
    assert backends.get("fast:torch").engine(prog) == "torch"
    monkeypatch.setenv(fast.ENGINE_ENV_VAR, "torch")
    assert fast.FastBackend().engine(prog) == "torch"
    monkeypatch.setenv(fast.ENGINE_ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="gpu"):
        fast.FastBackend().check_settings()
