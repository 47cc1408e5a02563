"""Processes that step on the compiled engine exit cleanly on a busy machine (issue 34).

Child processes (``spawn``-like: fresh interpreters) import torch and roundpipe, run a parallel
step on the default engine (two threads, so numba's threading layer starts), a torch op, and a
second step right after it, print what they loaded and exit normally, again and again while
``SPINNERS`` processes keep every core busy. Two ranks on gloo do the same, an ``all_reduce``
before the steps, and end with ``roundpipe.optim.shutdown_process_group()`` (the ending
docs/distributed.md gives ranks; torch's own exit abort after a plain
``destroy_process_group`` is ``tests/test_exit_shutdown.py``'s). Every child must exit with
status 0, print no ``terminate called`` (C++ ``std::terminate``: a joinable ``std::thread``
destroyed, or a thread unwound out of a ``noexcept`` function at exit), and run numba's OpenMP
layer on torch's libgomp: one pool of threads for torch and the kernels
(``threads.threading_report``).

Bounded in time: the runs stop at ``BUDGET_S`` (each child is killed after ``CHILD_TIMEOUT_S``)
and the spinners end by themselves (and are killed at the end). On an idle 2-core machine the
module takes about 30 s. The abort this guards against was rare (a few in a hundred rank runs
under load); each run of the suite adds its share of attempts, and the one-runtime check fails
every time the second runtime is there.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("numba")

SPINNERS = 2
BUDGET_S = 25.0  # runs start until then; a started run may finish after it
CHILD_TIMEOUT_S = 120.0  # a child's exit alone took 60-90 s at load 11 on 2 cores
PARALLEL = 2
MAX_RUNS = 12

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_REPORT = textwrap.dedent(
    """
    def _report(**extra):
        import json, os
        import torch
        from roundpipe.optim.threads import threading_report
        rep = threading_report()
        torch_lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))
        print("REPORT " + json.dumps({**rep, "torch_lib": torch_lib, **extra}), flush=True)
    """
)

PLAIN = _REPORT + textwrap.dedent(
    """
    import faulthandler, sys
    faulthandler.enable(all_threads=True)
    import torch
    import roundpipe.optim as ro
    torch.set_num_threads(2)
    ro.set_num_threads(2)
    p = torch.nn.Parameter(torch.randn(1 << 17))
    p.grad = torch.randn_like(p)
    opt = ro.AdamW([p], lr=1e-3)
    opt.step()
    a = torch.randn(128, 128)
    (a @ a).sum()
    opt.step()  # right after a torch op
    _report(backend=opt.backend)
    """
)

RANKS = _REPORT + textwrap.dedent(
    """
    import datetime, faulthandler, os, sys
    faulthandler.enable(all_threads=True)
    import torch
    import torch.distributed as dist
    import roundpipe.optim as ro
    rank, port = int(sys.argv[1]), sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(2)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=45))
    try:
        p = torch.nn.Parameter(torch.randn(1 << 17))
        p.grad = torch.randn_like(p)
        dist.all_reduce(p.grad)
        opt = ro.AdamW([p], lr=1e-3)
        opt.step()
        opt.step()
        _report(backend=opt.backend, rank=rank)
    except BaseException:
        dist.destroy_process_group()
        raise
    ro.shutdown_process_group()  # not barrier + destroy: docs/distributed.md, "Ending a rank"
    """
)

SPIN = (
    "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
)


def _env():
    env = dict(os.environ)
    for var in (
        "ROUNDPIPE_OPTIM_BACKEND",
        "ROUNDPIPE_OPTIM_ENGINE",
        "ROUNDPIPE_OPTIM_NUM_THREADS",
        "OMP_NUM_THREADS",
        "NUMBA_NUM_THREADS",
        "NUMBA_THREADING_LAYER",
    ):
        env.pop(var, None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Run:
    """One child process (or a pair of ranks), its output collected when it ends."""

    def __init__(self, label, argvs):
        self.label = label
        self.started = time.monotonic()
        self.procs = [
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
            for argv in argvs
        ]
        self.results = None

    def poll(self):
        if self.results is not None:
            return True
        if any(p.poll() is None for p in self.procs):
            if time.monotonic() - self.started < CHILD_TIMEOUT_S:
                return False
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
        self.results = []
        for p in self.procs:
            out, err = p.communicate()
            self.results.append((p.returncode, out, err))
        return True

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _problems(run):
    problems = []
    for i, (rc, out, err) in enumerate(run.results):
        who = f"{run.label}[{i}]"
        tail = " | ".join(err.strip().splitlines()[-6:])
        if rc != 0:
            problems.append(
                f"{who}: exit status {rc} ({'killed by signal ' + str(-rc) if rc < 0 else 'error'}): {tail}"
            )
        if "terminate called" in err:
            problems.append(f"{who}: std::terminate at exit: {tail}")
        reports = [
            json.loads(line[len("REPORT ") :]) for line in out.splitlines() if line.startswith("REPORT ")
        ]
        if rc == 0 and not reports:
            problems.append(f"{who}: no report")
        for rep in reports:
            # one pool: numba's OpenMP layer must run on the libgomp torch loaded (a second
            # runtime may be mapped beside it, unused: threads.py)
            gomp = rep["gomp_parallel"] or ""
            if rep["layer"] == "omp" and not gomp.startswith(rep["torch_lib"] + os.sep):
                problems.append(f"{who}: numba's OpenMP layer runs on {gomp or 'an unknown runtime'}")
    return problems


def test_children_exit_cleanly_under_load():
    spinners = [
        subprocess.Popen([sys.executable, "-c", SPIN, str(BUDGET_S + CHILD_TIMEOUT_S)])
        for _ in range(SPINNERS)
    ]
    runs, running = [], []
    deadline = time.monotonic() + BUDGET_S
    n = 0
    try:
        while True:
            while len(running) < PARALLEL and n < MAX_RUNS and time.monotonic() < deadline:
                if n % 3 == 2:  # every third run: two ranks on gloo
                    port = str(_free_port())
                    argvs = [[sys.executable, "-c", RANKS, str(r), port] for r in range(2)]
                    run = _Run(f"ranks#{n}", argvs)
                else:
                    run = _Run(f"plain#{n}", [[sys.executable, "-c", PLAIN]])
                running.append(run)
                runs.append(run)
                n += 1
            if not running:
                break
            time.sleep(0.05)
            running = [r for r in running if not r.poll()]
    finally:
        for r in running:
            r.kill()
        for s in spinners:
            s.kill()
            s.wait()
    assert runs, "no run started"
    problems = [p for r in runs for p in _problems(r)]
    if problems:
        pytest.fail(f"{len(problems)} problems in {len(runs)} runs:\n" + "\n".join(problems), pytrace=False)
