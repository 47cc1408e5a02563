"""The engine's launches (``numba_engine/engine.py``): threads (the serial loop on one thread
and on small tensors, the parallel one otherwise, with equal results; a forked child steps on
one thread; thread-count settings below and above the core count), and the replay of the last
launch on an unchanged plan.
"""

import os

import numba
import pytest
import torch

import roundpipe.optim
from roundpipe.optim import backends
from roundpipe.optim.backends import fast, numba_engine
from tests._util import assert_bits_equal, count_calls

from ._children import child_env, finish, start_child, torch_digest
from ._helpers import LARGE, assert_bits, engine, opt_program


@pytest.mark.parametrize("order", [(1, 2), (2, 1)], ids=["1-then-2", "2-then-1"])
def test_threads_follow_roundpipe_setting_and_results_do_not_change(order, monkeypatch):
    """A one-thread run (the serial kernel) and a two-thread run (the parallel kernel, where
    numba has two threads) of the same steps give the same bits, whichever runs first."""
    monkeypatch.setattr(roundpipe.optim.threads, "_num_threads", None)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3 * LARGE, generator=g)
    grads = [torch.randn(3 * LARGE, generator=g) for _ in range(3)]
    out = {}
    for n in order:
        roundpipe.optim.set_num_threads(n)
        p = torch.nn.Parameter(base.clone())
        opt = roundpipe.optim.AdamW([p], lr=0.01, backend="fast:numba")
        for gr in grads:
            p.grad = gr.clone()
            opt.step()
            if n > 1:
                assert numba.get_num_threads() == min(n, numba.config.NUMBA_NUM_THREADS)
        out[n] = p.detach().clone()
    kernel = engine().kernel(opt_program(opt), (True,))  # betas[0] = 0.9: a small lerp
    assert kernel.serial.signatures, "one thread: the serial kernel"
    if numba.config.NUMBA_NUM_THREADS > 1:
        assert kernel.parallel.signatures, "two threads: the parallel kernel"
    roundpipe.optim.set_num_threads(None)
    assert set(out) == {1, 2}
    assert_bits_equal(out[1], out[2], "1 thread vs 2 threads")


def test_a_step_on_an_unchanged_plan_replays_the_launch_and_sees_every_change(monkeypatch):
    """From the third step on (the first builds the plan, the second rebuilds it once the state
    exists), a step whose plan still holds replays the last launch (rebinds it to new scalars and
    gradient addresses) instead of preparing it anew; a new learning rate, new gradient tensors, a
    parameter moved by ``.data =``, another thread count and another engine are all seen, and
    every step is bit for bit torch's for-loop."""
    monkeypatch.setattr(roundpipe.optim.threads, "_num_threads", None)
    calls = count_calls(monkeypatch, backends.get("fast"), "prepare", "rebind")
    g = torch.Generator().manual_seed(5)
    n = 3 * numba_engine.PARALLEL_MIN_NUMEL  # two threads where two are set
    base = torch.randn(n, generator=g)
    p, q = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    ours = roundpipe.optim.Adam([p], lr=0.01, backend="fast")
    theirs = torch.optim.Adam([q], lr=0.01, foreach=False)

    def step(expect_prepare, expect_rebind):
        grad = torch.randn(n, generator=g)
        p.grad, q.grad = grad.clone(), grad.clone()  # new tensors, new addresses, every step
        before = dict(calls)
        ours.step()
        theirs.step()
        assert_bits(p, q, f"after {calls}")
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert_bits(ours.state[p][k], theirs.state[q][k], k)
        assert calls["prepare"] - before["prepare"] == expect_prepare, calls
        assert calls["rebind"] - before["rebind"] == expect_rebind, calls

    roundpipe.optim.set_num_threads(1)
    step(1, 0)  # builds the plan (and the state)
    step(1, 0)  # rebuilds it: the state now exists
    step(0, 1)  # the launch replayed
    for opt in (ours, theirs):
        opt.param_groups[0]["lr"] = 0.003
    step(0, 1)  # a new learning rate is a new scalar
    p.data = p.data.clone()  # moved: the plan is checked again and rebuilt
    step(1, 0)
    step(0, 1)
    if numba.config.NUMBA_NUM_THREADS >= 2:
        roundpipe.optim.set_num_threads(2)  # another thread count: another kernel
        step(1, 1)
        step(0, 1)
    roundpipe.optim.set_num_threads(1)
    monkeypatch.setenv(fast.ENGINE_ENV_VAR, "torch")  # another engine: prepared anew, each step
    step(1, 1)
    step(1, 1)
    monkeypatch.delenv(fast.ENGINE_ENV_VAR)
    # (the numba engine's last launch is replayed if it ran on one thread, else prepared anew)
    step(0 if numba.config.NUMBA_NUM_THREADS < 2 else 1, 1)
    step(0, 1)
    roundpipe.optim.set_num_threads(None)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_steps_on_one_thread(tmp_path, monkeypatch):
    """After a parallel step, a forked child (one thread there) steps with the serial kernel;
    numba's OpenMP pool, used there, would abort the child."""
    monkeypatch.setattr(roundpipe.optim.threads, "_num_threads", None)
    roundpipe.optim.set_num_threads(2)
    g = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(torch.randn(LARGE, generator=g))
    opt = roundpipe.optim.Adam([p], lr=0.01, backend="fast:numba")
    grads = [torch.randn(LARGE, generator=g) for _ in range(2)]
    p.grad = grads[0]
    opt.step()
    roundpipe.optim.set_num_threads(None)
    out = tmp_path / "child.pt"
    pid = os.fork()
    if pid == 0:  # the child: step, save, exit without running pytest's teardown
        code = 1
        try:
            p.grad = grads[1]
            opt.step()
            torch.save((roundpipe.optim.get_num_threads(), p.detach().clone()), out)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    child_threads, child_param = torch.load(out)
    assert child_threads == 1
    p.grad = grads[1]
    opt.step()
    torch.testing.assert_close(child_param, p.detach(), rtol=0, atol=0)


HIGH = 2 * (os.cpu_count() or 1) + 1  # above the core count
# (NUMBA_NUM_THREADS, OMP_NUM_THREADS, ROUNDPIPE_OPTIM_NUM_THREADS or None)
# (torch caps its own count at the core count, so roundpipe is also asked for HIGH threads, to
# run numba's pool above it)
THREAD_SETTINGS = [(1, 1, None), (HIGH, HIGH, None), (HIGH, HIGH, HIGH)]


def test_thread_count_environment_below_and_above_the_core_count(tmp_path):
    """``NUMBA_NUM_THREADS`` and ``OMP_NUM_THREADS`` below (1) and above (2 * cores + 1) the
    core count, also with roundpipe asked for more threads than numba's pool has: numba accepts
    a pool larger than the machine, a step runs min(roundpipe's threads, NUMBA_NUM_THREADS) of
    it, and every setting gives torch's bits (no error, crash or hang)."""
    n_large = HIGH * numba_engine.PARALLEL_MIN_NUMEL + 7  # enough work for HIGH threads
    children = []
    for numba_n, omp_n, rp_n in THREAD_SETTINGS:
        env = child_env(NUMBA_NUM_THREADS=str(numba_n), OMP_NUM_THREADS=str(omp_n))
        if rp_n is not None:
            env["ROUNDPIPE_OPTIM_NUM_THREADS"] = str(rp_n)
        children.append(start_child(env, "Adam", "fast", n_large))
    try:
        results = [finish(c, f"settings {s}") for c, s in zip(children, THREAD_SETTINGS, strict=True)]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
    want = torch_digest("Adam", n_large)
    for (numba_n, omp_n, rp_n), res in zip(THREAD_SETTINGS, results, strict=True):
        setting = f"NUMBA_NUM_THREADS={numba_n} OMP_NUM_THREADS={omp_n} ROUNDPIPE_OPTIM_NUM_THREADS={rp_n}"
        assert res["engine"] == "numba", (setting, res)
        assert res["digest"] == want, (setting, res)
        assert res["numba_max"] == numba_n, (setting, res)
        rp = rp_n if rp_n is not None else res["torch_threads"]
        assert res["roundpipe_threads"] == rp, (setting, res)
        used = min(rp, numba_n)
        assert res["parallel"] == (used > 1), (setting, res)
        if used > 1:
            assert res["numba_threads"] == used, (setting, res)
