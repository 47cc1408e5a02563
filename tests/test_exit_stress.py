"""FSDP2 ranks exit cleanly under heavy load with ``roundpipe.optim.shutdown_process_group()``,
on roundpipe's default engine and, as the control in the same run, on ``torch.optim``; the
plain shutdown (``barrier`` and ``destroy_process_group``) runs beside it and is reported, so
the abort it guards against stays visible (docs/distributed.md, "Ending a rank").

Each rank pair runs ``tests/_exit_rank.py``'s rank on gloo, one thread each, ``fully_shard``
over a small MLP with uneven shards, with and without ``CPUOffloadPolicy(pin_memory=False)``,
stepping one of the eleven elementwise optimizers (in turn), then ends its group by one of
``SHUTDOWNS``, while ``SPINNERS`` processes keep both cores busy; the (variant, shutdown)
combinations take turns, round by round. The test runs once per launcher: ``subprocess``, each
rank a fresh interpreter (as torchrun starts them), and ``spawn``, one launcher process per
pair that starts both ranks with ``torch.multiprocessing.start_processes(...,
start_method="spawn")`` (as the script of issue 40 did). A rank that exits non-zero, dies by a
signal or prints ``terminate called`` counts as an abort, by its kind (SIGSEGV, SIGABRT, another
signal, an exit status, a timeout: ``KINDS``) (a spawned rank's failure is read from
its launcher's lines on stderr and exit status); its core dump (``RLIMIT_CORE`` raised for the
ranks, and a spawn launcher's ranks inherit it; the kernel's ``core_pattern`` decides where it
goes: with a bare ``core``, into the rank's directory, or the pair's for spawned ranks) is read
with ``gdb`` where both are there, and the backtrace of every thread goes into the report.

An abort after ``shutdown_process_group`` fails the test; the aborts of the plain and the
``destroy`` endings are printed with their backtraces and counted in a warning, not failed on:
they are torch's (pytorch/pytorch#190489) where the control shows them too. The summary gives
each (variant, shutdown)'s rank runs and aborts by kind.

Opt-in: it takes about 12 s per pair on 2 cores, so CI's default pass leaves it out.
``ROUNDPIPE_EXIT_STRESS=N`` runs N pairs of each (variant, shutdown) with each launcher (72
pairs: 144 rank runs of each); ``ROUNDPIPE_EXIT_STRESS_LAUNCH=subprocess`` or ``spawn`` runs
one launcher only (both by default); ``ROUNDPIPE_EXIT_STRESS_SHUTDOWNS`` names the shutdowns,
comma-separated (default ``plain,shutdown``; ``destroy``: ``destroy_process_group`` alone,
without the barrier; ``shutdown-held`` keeps the last model and optimizer alive across the
call); ``ROUNDPIPE_EXIT_STRESS_BUDGET_S`` starts no pair after that many seconds (the report
counts the rank runs that ran). The control does not run ``CONTROL_SKIPS`` (torch.optim.Rprop
cannot step FSDP2's sharded parameters). See CONTRIBUTING.md and docs/exit-crashes.md.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest

from tests._exit_rank import KWARGS as RANK_KWARGS

PAIRS = int(os.environ.get("ROUNDPIPE_EXIT_STRESS", "0") or 0)
LAUNCH = os.environ.get("ROUNDPIPE_EXIT_STRESS_LAUNCH", "")
SHUTDOWNS = tuple(os.environ.get("ROUNDPIPE_EXIT_STRESS_SHUTDOWNS", "plain,shutdown").split(","))
# no pair starts after this many seconds (0: no limit); the report counts what ran
BUDGET_S = float(os.environ.get("ROUNDPIPE_EXIT_STRESS_BUDGET_S", "0") or 0)
pytestmark = pytest.mark.skipif(
    PAIRS < 1, reason="opt-in stress test: ROUNDPIPE_EXIT_STRESS=<pairs per variant> (CONTRIBUTING.md)"
)

SPINNERS = 4
PARALLEL = 2  # rank pairs at a time
PAIR_TIMEOUT_S = 300.0
# in turn, the one of issue 61's crash first
OPTIMIZERS = ("RMSprop", *sorted(k for k in RANK_KWARGS if k != "RMSprop"))
KINDS = ("SIGSEGV", "SIGABRT", "other signal", "exit status", "timeout")
# what the control cannot step: torch.optim.Rprop's ``sign[...] = etaplus`` is an in-place
# index_put_ that DTensor's sharding propagation refuses on a Shard(0) placement
CONTROL_SKIPS = {"Rprop"}
VARIANTS = ("roundpipe", "torch")
LAUNCHES = ("subprocess", "spawn")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_MODULE = [sys.executable, "-m", "tests._exit_rank"]
# what the spawn launcher prints for each failed rank (tests/_exit_rank.py)
FAILED_RANK = re.compile(r"^rank (\d+): (signal \S+|exit status -?\d+) \(pid (\d+)(.*)\)$", re.M)


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROUNDPIPE_OPTIM_", "NUMBA_"))}
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _allow_core_dumps():
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _how(returncode):
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def _backtrace(where, pid=None, seen=None):
    """Every thread's backtrace from a core dump in ``where`` (the one naming ``pid`` if there
    is one, else the first), where there is one and gdb; a core file already in ``seen`` (both
    spawned ranks of a pair dump into its directory) is named, not read again."""
    cores = sorted(f for f in os.listdir(where) if f.startswith("core"))
    if not cores or shutil.which("gdb") is None:
        return f"(no core dump in {where}, or no gdb)"
    core = next((f for f in cores if pid is not None and str(pid) in f), cores[0])
    path = os.path.join(where, core)
    if seen is not None:
        if path in seen:
            return f"(core file {core}: its backtrace is above)"
        seen.add(path)
    cmd = ["gdb", "-batch", "-ex", "info threads", "-ex", "thread apply all bt", sys.executable]
    out = subprocess.run([*cmd, path], capture_output=True, text=True, timeout=600)
    return f"(core file {core} of {cores})\n{out.stdout[-12000:]}"


# (variant, shutdown) -> Counter of abort kinds (``KINDS``) in this launcher's run
KIND_COUNTS: dict = collections.defaultdict(collections.Counter)


class _Pair:
    def __init__(self, tmp_path, launch, variant, shutdown, name, k):
        self.launch, self.variant, self.shutdown, self.name, self.k = launch, variant, shutdown, name, k
        self.key = (variant, shutdown)
        self.where = tmp_path / f"{variant}-{shutdown}-{name}-{k}"
        self.prefix = self.where / "result"
        self.timed_out = False
        self.cores_read = set()
        port = _port()
        popen = dict(
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_allow_core_dumps,
        )
        if launch == "spawn":
            # one session: a timeout kills the launcher and the ranks it spawned together
            self.where.mkdir(parents=True)
            argv = [*RANK_MODULE, "spawn", port, variant, name, str(self.prefix), shutdown]
            self.procs = [subprocess.Popen(argv, cwd=self.where, start_new_session=True, **popen)]
        else:
            self.procs = []
            for r in range(2):
                rank_dir = self.where / f"r{r}"
                rank_dir.mkdir(parents=True)
                argv = [*RANK_MODULE, "rank", str(r), port, variant, name, str(self.prefix), shutdown]
                self.procs.append(subprocess.Popen(argv, cwd=rank_dir, **popen))
        self.started = time.monotonic()

    def running(self):
        return any(p.poll() is None for p in self.procs)

    def kill(self):
        for p in self.procs:
            if self.launch == "spawn":
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            else:
                p.kill()

    def _kind(self, how):
        if self.timed_out:
            return "timeout"
        for kind in ("SIGSEGV", "SIGABRT"):
            if kind in how:
                return kind
        return "other signal" if "signal" in how else "exit status"

    def _abort(self, aborts, who, how, err, core_dir, pid=None):
        KIND_COUNTS[self.key][self._kind(how)] += 1
        wrote = [r for r in range(2) if self.prefix.with_name(f"result.r{r}.json").exists()]
        timeout = f" (killed after {PAIR_TIMEOUT_S:.0f} s)" if self.timed_out else ""
        tail = "\n".join(line for line in err.strip().splitlines() if not FAILED_RANK.match(line))
        tail = "\n".join(tail.splitlines()[-8:])
        aborts[self.key].append(
            f"{self.launch}: {self.variant} {self.name}, {self.shutdown} shutdown, pair {self.k} {who}: "
            f"{how}{timeout} "
            f"(results written by ranks {wrote})\n{tail}\n{_backtrace(core_dir, pid, self.cores_read)}"
        )

    def finish(self, counts, aborts):
        if self.launch == "spawn":
            (p,) = self.procs
            _, err = p.communicate()
            counts[self.key] += 2
            failed = FAILED_RANK.findall(err)
            for r, how, pid, note in failed:
                self._abort(aborts, f"rank {r}", how + note, err, self.where, pid)
            if not failed and (p.returncode != 0 or "terminate called" in err):
                how = _how(p.returncode) + (", terminate called" if "terminate called" in err else "")
                self._abort(aborts, "launcher", how, err, self.where)
            return
        for r, p in enumerate(self.procs):
            _, err = p.communicate()
            counts[self.key] += 1
            if p.returncode != 0 or "terminate called" in err:
                self._abort(aborts, f"rank {r}", _how(p.returncode), err, self.where / f"r{r}")
            else:
                shutil.rmtree(self.where / f"r{r}", ignore_errors=True)


def _run_pairs(tmp_path, launch):
    """Every (variant, shutdown) PAIRS times, taking turns, under the spinners: (rank runs,
    abort reports), each keyed by (variant, shutdown)."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(SPINNERS)]
    jobs = collections.deque(
        (v, s, OPTIMIZERS[k % len(OPTIMIZERS)], k)
        for k in range(PAIRS)
        for v in VARIANTS
        for s in SHUTDOWNS
        if not (v == "torch" and OPTIMIZERS[k % len(OPTIMIZERS)] in CONTROL_SKIPS)
    )
    KIND_COUNTS.clear()
    counts, aborts = collections.Counter(), collections.defaultdict(list)
    running = []
    deadline = time.monotonic() + BUDGET_S if BUDGET_S > 0 else None
    try:
        while jobs or running:
            if deadline is not None and time.monotonic() > deadline and jobs:
                print(f"exit stress: time budget of {BUDGET_S:.0f} s spent, {len(jobs)} pairs not started")
                jobs.clear()
            while jobs and len(running) < PARALLEL:
                running.append(_Pair(tmp_path, launch, *jobs.popleft()))
            time.sleep(0.2)
            still = []
            for pair in running:
                if pair.running():
                    if time.monotonic() - pair.started < PAIR_TIMEOUT_S:
                        still.append(pair)
                        continue
                    pair.timed_out = True
                    pair.kill()
                pair.finish(counts, aborts)
            running = still
    finally:
        for p in spin:
            p.kill()
            p.wait()
        for pair in running:
            pair.kill()
    return counts, aborts


@pytest.mark.parametrize("launch", LAUNCHES)
def test_ranks_exit_cleanly_under_load_against_torch_optim(tmp_path, launch):
    if LAUNCH not in ("", *LAUNCHES):
        pytest.fail(f"ROUNDPIPE_EXIT_STRESS_LAUNCH={LAUNCH!r}: one of {LAUNCHES}, or unset for both")
    if LAUNCH and launch != LAUNCH:
        pytest.skip(f"ROUNDPIPE_EXIT_STRESS_LAUNCH={LAUNCH}")
    from tests._exit_rank import SHUTDOWNS as KNOWN

    if not set(SHUTDOWNS) <= set(KNOWN):
        pytest.fail(f"ROUNDPIPE_EXIT_STRESS_SHUTDOWNS={','.join(SHUTDOWNS)!r}: names from {KNOWN}")
    counts, aborts = _run_pairs(tmp_path, launch)
    summary = {
        f"{v}, {s} shutdown": f"{len(aborts[v, s])} aborts in {counts[v, s]} rank runs ("
        + ", ".join(f"{KIND_COUNTS[v, s][k]} {k}" for k in KINDS)
        + ")"
        for s in SHUTDOWNS
        for v in VARIANTS
    }
    print("exit stress:", json.dumps({"launch": launch, **summary}))
    plain = [a for s in SHUTDOWNS if s in ("plain", "destroy") for v in VARIANTS for a in aborts[v, s]]
    if plain:  # torch's abort, shown in full: the shutdown below is what guards against it
        print(f"{launch}: the plain shutdown's aborts:\n" + "\n".join(plain))
        warnings.warn(f"{launch}: the plain shutdown aborted {len(plain)} times (printed)", stacklevel=1)
    ours = [s for s in SHUTDOWNS if s not in ("plain", "destroy")]
    rp = [a for s in ours for a in aborts["roundpipe", s]]
    if rp:
        pytest.fail(
            f"{launch}: aborts after shutdown_process_group: {summary}\n" + "\n".join(rp), pytrace=False
        )
    control = [a for s in ours for a in aborts["torch", s]]
    if control:
        pytest.fail(
            f"{launch}: only the control aborted after shutdown_process_group ({summary}): the machine "
            "or torch, not roundpipe\n" + "\n".join(control),
            pytrace=False,
        )
