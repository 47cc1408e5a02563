"""The on-disk kernel cache (``numba_engine/disk_cache.py``): a second process compiles
nothing and finds torch's thread count unchanged; processes compiling into one empty cache at
once; the cache directory's settings; compiling in memory, with one warning, where the
directory cannot be written.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from roundpipe.optim.backends import numba_engine
from roundpipe.optim.backends.numba_engine import disk_cache
from roundpipe.optim.spec.ir import ProgramBuilder

from ._children import CHILD_TIMEOUT, child_env, finish, start_child, torch_digest
from ._helpers import LARGE

# ---------------------------------------------------------------------------------------------
# the on-disk cache

_LATENCY_SCRIPT = textwrap.dedent(
    """
    import json, os, time, torch
    import roundpipe.optim
    from roundpipe.optim import backends
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (100, 1000, 70000)]
    opt = roundpipe.optim.Adam(params, lr=0.01, weight_decay=0.1, backend="fast:numba")
    for p in params:
        p.grad = torch.randn(p.shape)
    t0 = time.perf_counter()
    opt.step()
    latency = time.perf_counter() - t0
    from roundpipe.optim.backends.numba_engine import kernels
    compiled = kernels._kernels.values()
    print(json.dumps({
        "latency": latency,
        "hits": sum(sum(d.stats.cache_hits.values()) for k in compiled for d in k.dispatchers),
        "misses": sum(sum(d.stats.cache_misses.values()) for k in compiled for d in k.dispatchers),
        "on_disk": [k.cached_on_disk for k in compiled],
        "param0": params[0].detach()[:4].tolist(),
        "torch_threads": torch.get_num_threads(),
    }))
    """
)


def _first_step(env):
    res = subprocess.run(
        [sys.executable, "-c", _LATENCY_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_")}
    env.update({numba_engine.CACHE_ENV_VAR: str(tmp_path), "ROUNDPIPE_OPTIM_NUM_THREADS": "1"})
    cold = _first_step(env)
    warm = _first_step(env)
    # the step's kernel, and the sqrt probe's (``sqrt_kind``)
    assert cold["on_disk"] == warm["on_disk"] and all(cold["on_disk"]), (cold, warm)
    assert cold["misses"] >= 1 and cold["hits"] == 0, cold
    assert warm["misses"] == 0 and warm["hits"] >= 1, warm
    assert warm["param0"] == cold["param0"]
    # numba's OpenMP pool sets the process's OpenMP thread count when it starts: the step puts
    # torch's back
    assert cold["torch_threads"] == warm["torch_threads"] == 1
    # (no timing assertion: warm < cold held here, but wall time on a shared machine is noise;
    # the cache hits and misses above say that nothing was compiled)
    sources = list((tmp_path / "numba").glob("roundpipe_numba_*.py"))
    assert len(sources) == len(cold["on_disk"])  # one module per kernel, written once
    cached = {p.suffix for p in (tmp_path / "numba" / "__pycache__").iterdir()}
    assert {".nbi", ".nbc"} <= cached


def test_processes_compiling_into_one_empty_cache_at_once(tmp_path):
    """Four processes (DDP ranks, pytest-xdist workers) compile the same AdamW kernel into one
    empty cache directory at the same moment (each waits at a barrier after its imports): all
    succeed with torch's bits; a fifth process then compiles nothing and gets the same bits."""
    cache, meet = tmp_path / "cache", tmp_path / "meet"
    meet.mkdir()
    env = child_env(**{numba_engine.CACHE_ENV_VAR: str(cache), "ROUNDPIPE_OPTIM_NUM_THREADS": "1"})
    n_large = LARGE
    children = [start_child(env, "AdamW", "fast", n_large, meet) for _ in range(4)]
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while len(list(meet.glob("ready-*"))) < len(children):
            assert time.monotonic() < deadline, "the children never reached the barrier"
            assert all(c.poll() is None for c in children), [c.communicate()[1] for c in children]
            time.sleep(0.01)
        (meet / "go").touch()
        results = [finish(c, f"process {i}") for i, c in enumerate(children)]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
    want = torch_digest("AdamW", n_large)
    for i, res in enumerate(results):
        assert res["engine"] == "numba", (i, res)
        assert res["digest"] == want, (i, res)  # bit for bit torch.optim's for-loop
        assert all(res["on_disk"]) and res["misses"] >= 1, (i, res)
    warm = finish(start_child(env, "AdamW", "fast", n_large), "the fifth process")
    assert warm["misses"] == 0 and warm["hits"] >= 1, warm  # nothing compiled: all from the cache
    assert warm["digest"] == want
    # every kernel's module written once, whole; no temporary file left behind
    numba_dir = cache / "numba"
    assert len(list(numba_dir.glob("roundpipe_numba_*.py"))) == len(warm["on_disk"])
    leftovers = [p.name for p in numba_dir.rglob("*") if "tmp" in p.name]
    assert not leftovers, leftovers
    assert {".nbi", ".nbc"} <= {p.suffix for p in (numba_dir / "__pycache__").iterdir()}


def test_cache_dir_setting(monkeypatch, tmp_path):
    monkeypatch.setenv(numba_engine.CACHE_ENV_VAR, str(tmp_path / "rp"))
    assert disk_cache.cache_dir() == str(tmp_path / "rp" / "numba")
    monkeypatch.delenv(numba_engine.CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_dir() == str(tmp_path / "xdg" / "roundpipe" / "numba")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert disk_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "roundpipe" / "numba")


def _tiny_program(k):
    """A distinct small program per ``k`` (a new kernel to compile)."""
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), b.tensor("param") * b.s.x + b.tensor("grad") * float(k))
    return b.build()


def _read_only_dir(tmp_path, how):
    if how == "under-a-file":  # no one, root included, can create a directory under a file
        (tmp_path / "file").write_text("")
        return tmp_path / "file" / "cache"
    if os.geteuid() == 0:
        pytest.skip("root can write a read-only directory")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return ro


@pytest.mark.parametrize("how", ["under-a-file", "chmod-555"])
def test_unwritable_cache_dir_compiles_in_memory_and_warns_once(how, tmp_path, monkeypatch):
    numba_engine.sqrt_kind()  # the once-per-process probe (it compiles a kernel of its own) first
    directory = _read_only_dir(tmp_path, how)
    monkeypatch.setenv(numba_engine.CACHE_ENV_VAR, str(directory))
    monkeypatch.setattr(disk_cache, "_warned_readonly", False)
    be = numba_engine.NumbaEngine()
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in (3, 5):
            prog = _tiny_program(k)
            t = {"param": torch.full((10,), 2.0), "grad": torch.full((10,), 0.5)}
            be.run(prog, {"x": 0.5}, {n: [v] for n, v in t.items()})
            results.append(t["param"])
            assert not be.kernel(prog, ()).cached_on_disk
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "cannot write its kernel cache" in messages[0] and numba_engine.CACHE_ENV_VAR in messages[0]
    assert str(directory / "numba") in messages[0]
    assert torch.equal(results[0], torch.full((10,), 2.5)) and torch.equal(results[1], torch.full((10,), 3.5))
    if how == "chmod-555":
        assert list(directory.iterdir()) == []
