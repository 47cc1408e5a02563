"""Steps in threads and processes (``roundpipe/optim/threads.py``: the thread count every engine
uses, one thread in a forked child):

* two optimizers stepping in two threads, and a step in a background thread while the main
  thread runs matmuls, give what the same steps give one after another;
* 2 and 4 threads, each stepping its own optimizer of one class, options and shapes (one
  shared program, compiled while they start together), give bit for bit the sequential steps;
* a forked child steps after its parent stepped; a spawned child continues from a checkpoint.

Compile caches are process-wide: each test that counts on a compilation gets fresh ones.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import roundpipe.optim
from roundpipe.optim import backends
from roundpipe.optim import backends as rp_backends
from roundpipe.optim.backends.fast import SMALL_NUMEL
from tests._against_torch import ALL_BACKENDS, LARGE, fresh_compile_caches, rp_opt, seeded_randn
from tests._util import (
    OPTIMIZER_NAMES,
    assert_bits_equal,
    assert_params_close,
    assert_state_dicts_close,
    clone_params,
    groups,
    make_params,
    run_threads,
    set_grads,
)

# Hang detectors, not timing assertions: generous, so that a slow or busy machine never trips
# them (a cold import of torch from a slow disk alone can take tens of seconds).
JOIN_TIMEOUT = 60  # seconds for a thread or a child process to finish
FORK_TIMEOUT = 30  # seconds for a forked child to send its result (it needs well under 1 s)
SPAWN_TIMEOUT = 120  # the same for a spawned child, which imports torch first (about 5 s)


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# two optimizers in two threads


def _big_problem(seed):
    """make_params() plus one parameter above the batching threshold (stepped in place)."""
    return make_params(seed) + [torch.nn.Parameter(_randn(SMALL_NUMEL + 7, seed=seed + 50))]


def _train(opt, params, seed, steps, barrier=None):
    for k in steps:
        set_grads(params, k, seed)
        if barrier is not None:
            barrier.wait(timeout=JOIN_TIMEOUT)
        opt.step()


def test_two_optimizers_in_two_threads(name, engine, monkeypatch):
    """Two optimizers (this one and the next in the list: two programs) stepping at the same
    time from two threads, on a fresh fast backend (so they also compile at the same time),
    give bit for bit what they give one after the other."""
    other = OPTIMIZER_NAMES[(OPTIMIZER_NAMES.index(name) + 1) % len(OPTIMIZER_NAMES)]
    steps = range(4)

    def build():
        pa, pb = _big_problem(1), _big_problem(2)
        oa = rp_opt(name, groups(pa[:4]) + [{"params": pa[4:]}], "fast")
        ob = rp_opt(other, pb, "fast")
        return (oa, pa), (ob, pb)

    (oa, pa), (ob, pb) = build()
    _train(oa, pa, 1, steps)
    _train(ob, pb, 2, steps)

    monkeypatch.setattr(rp_backends, "_instances", {})
    (ca, qa), (cb, qb) = build()
    barrier = threading.Barrier(2)
    run_threads(
        JOIN_TIMEOUT, [lambda: _train(ca, qa, 1, steps, barrier), lambda: _train(cb, qb, 2, steps, barrier)]
    )
    assert_params_close(qa, pa, rtol=0, atol=0)
    assert_params_close(qb, pb, rtol=0, atol=0)
    assert_state_dicts_close(ca.state_dict(), oa.state_dict(), rtol=0, atol=0)
    assert_state_dicts_close(cb.state_dict(), ob.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("opt_name", ["Adam", "RMSprop"])
@pytest.mark.parametrize("rp_threads", [None, 2], ids=["threads-default", "threads-2"])
def test_step_in_background_while_main_thread_runs_matmuls(opt_name, engine, rp_threads):
    """A background thread steps while the main thread multiplies matrices: both give the
    right results, and torch's thread count in the main thread is what it was."""
    a, b = _randn(96, 96, seed=1), _randn(96, 96, seed=2)
    expected_mm = a @ b
    params = _big_problem(3)
    ref_params = clone_params(params)
    ref = rp_opt(opt_name, ref_params, "fast")
    _train(ref, ref_params, 3, range(5))

    threads_before = torch.get_num_threads()
    roundpipe.optim.set_num_threads(rp_threads)
    try:
        opt = rp_opt(opt_name, params, "fast")
        done = threading.Event()
        errors = []

        def background():
            try:
                _train(opt, params, 3, range(5))
            except BaseException as e:  # reported in the main thread
                errors.append(e)
            finally:
                done.set()

        t = threading.Thread(target=background, daemon=True)
        t.start()
        products, deadline = 0, time.monotonic() + JOIN_TIMEOUT
        while (not done.is_set() or products < 3) and time.monotonic() < deadline:
            torch.testing.assert_close(a @ b, expected_mm, rtol=1e-5, atol=1e-5)
            products += 1
        t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not t.is_alive(), "the stepping thread hung"
    finally:
        roundpipe.optim.set_num_threads(None)
    if errors:
        raise errors[0]
    assert torch.get_num_threads() == threads_before
    assert_params_close(params, ref_params, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# fork and spawn


def _send_tensors(conn, tensors):
    buf = io.BytesIO()
    torch.save([t.detach() for t in tensors], buf)
    conn.send_bytes(buf.getvalue())


def _recv_tensors(conn, proc, timeout):
    """The child's tensors, or a clear failure if it sends nothing in ``timeout`` seconds."""
    data = None
    try:
        answered = conn.poll(timeout)
        if answered:
            try:
                data = conn.recv_bytes()
            except EOFError:  # the child closed the pipe without sending: it failed
                pass
        proc.join(timeout=JOIN_TIMEOUT if answered else 0)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    if not answered:
        pytest.fail(f"the child process sent nothing in {timeout} s (hang); killed it")
    assert data is not None and proc.exitcode == 0, f"the child failed (exit code {proc.exitcode})"
    return torch.load(io.BytesIO(data), weights_only=True)


def _forked_child(conn, opt, params):
    try:
        _train(opt, params, 4, range(2, 4))
        _send_tensors(conn, params)
    finally:
        conn.close()


@pytest.mark.parametrize("rp_threads", [None, 2], ids=["threads-default", "threads-2"])
def test_forked_child_steps_after_parent_stepped(engine, rp_threads):
    """The parent steps (its engine's thread pools are up), forks, and the child steps on:
    the child finishes and gets what the parent gets for the same steps.

    ``threads-2``: torch itself runs on one thread here (as this session does), roundpipe on
    two. torch.optim never runs a parallel region then, so its forked children are safe; a
    roundpipe step in the parent has used a two-thread OpenMP region, and GNU OpenMP cannot
    run a parallel region in a child forked after that (torch.optim hangs the same way under
    ``torch.set_num_threads(2)``). roundpipe's own thread setting must not make the child hang.
    """
    roundpipe.optim.set_num_threads(rp_threads)
    try:
        params = _big_problem(4)
        opt = rp_opt("Adam", params, "fast")
        _train(opt, params, 4, range(2))
        ctx = multiprocessing.get_context("fork")
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_forked_child, args=(child_conn, opt, params), daemon=True)
        proc.start()
        child_conn.close()
        child = _recv_tensors(parent_conn, proc, FORK_TIMEOUT)
        _train(opt, params, 4, range(2, 4))
    finally:
        roundpipe.optim.set_num_threads(None)
    assert_params_close(child, params, rtol=0, atol=0)


def _spawned_child(conn, checkpoint, name):
    """Rebuild the optimizer from a checkpoint, step twice, send the parameters back."""
    torch.set_num_threads(1)
    ckpt = torch.load(io.BytesIO(checkpoint), weights_only=True)
    params = [torch.nn.Parameter(p) for p in ckpt["params"]]
    opt = rp_opt(name, params, ckpt["backend"])
    opt.load_state_dict(ckpt["optimizer"])
    _train(opt, params, 5, range(2, 4))
    _send_tensors(conn, params)
    conn.close()


def test_spawned_child_continues_from_checkpoint(engine):
    params = _big_problem(5)
    opt = rp_opt("RMSprop", params, "fast")
    _train(opt, params, 5, range(2))
    buf = io.BytesIO()
    torch.save(
        {"params": [p.detach() for p in params], "optimizer": opt.state_dict(), "backend": "fast"}, buf
    )
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_spawned_child, args=(child_conn, buf.getvalue(), "RMSprop"), daemon=True)
    proc.start()
    child_conn.close()
    child = _recv_tensors(parent_conn, proc, SPAWN_TIMEOUT)
    _train(opt, params, 5, range(2, 4))
    assert_params_close(child, params, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# threads: optimizers of one program stepping at the same time


PROGRAM_JOIN_TIMEOUT = 120
THREAD_SHAPES = [(LARGE,), (3 * LARGE,), (3, 4), (257,), (1,), (31, 7)]
THREAD_STEPS = 20


def _thread_problem(backend, seed):
    params = [torch.nn.Parameter(seeded_randn(s, 1000 * seed + i)) for i, s in enumerate(THREAD_SHAPES)]
    opt = roundpipe.optim.AdamW(params, lr=0.01, weight_decay=0.1, amsgrad=True, backend=backend)
    return opt, params


def _train_program(opt, params, seed, barrier=None):
    for k in range(THREAD_STEPS):
        for i, p in enumerate(params):
            p.grad = seeded_randn(p.shape, 7 * seed + 10_000 * k + i)
        if barrier is not None:
            barrier.wait(timeout=PROGRAM_JOIN_TIMEOUT)
        opt.step()


@pytest.mark.parametrize("rp_threads", [None, 2], ids=["threads-default", "threads-2"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_concurrent_steps_of_one_program_are_the_sequential_ones(backend, n, rp_threads, monkeypatch):
    """``n`` threads start together (a barrier before every step) on fresh compile caches, so
    they also compile the shared program at once; each result is bit for bit its optimizer's
    run alone, one after another (on one step thread, the default thread count)."""
    fresh_compile_caches(monkeypatch)
    alone = []
    for seed in range(n):
        opt, params = _thread_problem(backend, seed)
        _train_program(opt, params, seed)
        alone.append((opt, params))

    fresh_compile_caches(monkeypatch)
    monkeypatch.setattr(backends, "_instances", {})
    roundpipe.optim.set_num_threads(rp_threads)
    runs = [_thread_problem(backend, seed) for seed in range(n)]
    barrier = threading.Barrier(n)
    run_threads(
        PROGRAM_JOIN_TIMEOUT,
        [lambda s=seed, r=run: _train_program(*r, s, barrier) for seed, run in enumerate(runs)],
    )
    for seed, ((opt, params), (ref, ref_params)) in enumerate(zip(runs, alone, strict=True)):
        for i, (p, q) in enumerate(zip(params, ref_params, strict=True)):
            assert_bits_equal(p.detach(), q.detach(), f"thread {seed}: param {i}")
            for k, v in opt.state[p].items():
                assert_bits_equal(v, ref.state[q][k], f"thread {seed}: param {i}: state[{k!r}]")


_ENGINE_THREADS = """
import os, sys
import torch
import roundpipe.optim as ro
torch.set_num_threads(1)
p = torch.nn.Parameter(torch.randn(1000))
p.grad = torch.randn(1000)
opt = ro.AdamW([p], lr=1e-3, backend=sys.argv[1])
opt.step()
opt.step()
print("numexpr" in sys.modules)
"""


@pytest.mark.parametrize("backend", ["fast", "fast:torch", "reference"])
def test_a_step_on_another_engine_leaves_numexpr_unimported(backend):
    """numexpr starts its thread pool when it is imported: a process that never steps on the
    numexpr engine (every rank of a training job on the default one) must not carry it to its
    exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_OPTIM_")}
    out = subprocess.run(
        [sys.executable, "-c", _ENGINE_THREADS, backend], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


_STAGED_FIRST_STEP = """
import sys, torch, roundpipe.optim as ro
torch.set_num_threads(1)
p = torch.nn.Parameter(torch.randn(3, 5))
p.grad = torch.randn(3, 5)
ro.Adafactor([p], backend="fast:numba").step()
print(torch.get_num_threads())
"""


def test_first_staged_step_on_numba_keeps_torch_threads():
    """The first staged pass compiled on the numba engine starts numba's pool, which sets
    OpenMP's thread count (torch's intra-op count): a step must leave the caller's as it was.
    A fresh process, where the pool has not started yet."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_OPTIM_")}
    out = subprocess.run(
        [sys.executable, "-c", _STAGED_FIRST_STEP], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
