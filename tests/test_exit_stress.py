"""FSDP2 ranks exit cleanly under heavy load, on roundpipe's default engine and, as the control in
the same run, on ``torch.optim``: a flake of the machine and a flake of ours read
differently.

Each rank pair runs ``tests/_exit_rank.py``'s rank on gloo, one thread each, ``fully_shard``
over a small MLP with uneven shards, with and without ``CPUOffloadPolicy(pin_memory=False)``,
stepping AdamW, SGD (momentum, weight decay) or NAdam, writing its result, then ``barrier`` and
``destroy_process_group``, while ``SPINNERS`` processes keep both cores busy. The test runs once
per launcher: ``subprocess``, each rank a fresh interpreter (as torchrun starts them), and
``spawn``, one launcher process per pair that starts both ranks with
``torch.multiprocessing.start_processes(..., start_method="spawn")`` (as the script of issue 40
did). A rank that exits non-zero, dies by a signal or prints ``terminate called`` counts as an
abort (a spawned rank's failure is read from its launcher's lines on stderr and exit status);
its core dump (``RLIMIT_CORE`` raised for the ranks, and a spawn launcher's ranks inherit it;
the kernel's ``core_pattern`` decides where it goes: with a bare ``core``, into the rank's
directory, or the pair's for spawned ranks) is read with ``gdb`` where both are there, and the
backtrace of every thread goes into the failure message.

Opt-in: it takes about 12 s per pair on 2 cores, so CI's default pass leaves it out.
``ROUNDPIPE_EXIT_STRESS=N`` runs N pairs of each variant with each launcher (72 pairs: 144 rank
runs of each variant per launcher, about 30 minutes per launcher);
``ROUNDPIPE_EXIT_STRESS_LAUNCH=subprocess`` or ``spawn`` runs one launcher only (both by
default). See CONTRIBUTING.md.
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

import pytest

PAIRS = int(os.environ.get("ROUNDPIPE_EXIT_STRESS", "0") or 0)
LAUNCH = os.environ.get("ROUNDPIPE_EXIT_STRESS_LAUNCH", "")
pytestmark = pytest.mark.skipif(
    PAIRS < 1, reason="opt-in stress test: ROUNDPIPE_EXIT_STRESS=<pairs per variant> (CONTRIBUTING.md)"
)

SPINNERS = 4
PARALLEL = 2  # rank pairs at a time
PAIR_TIMEOUT_S = 300.0
OPTIMIZERS = ("AdamW", "SGD", "NAdam")
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


class _Pair:
    def __init__(self, tmp_path, launch, variant, name, k):
        self.launch, self.variant, self.name, self.k = launch, variant, name, k
        self.where = tmp_path / f"{variant}-{name}-{k}"
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
            argv = [*RANK_MODULE, "spawn", port, variant, name, str(self.prefix)]
            self.procs = [subprocess.Popen(argv, cwd=self.where, start_new_session=True, **popen)]
        else:
            self.procs = []
            for r in range(2):
                rank_dir = self.where / f"r{r}"
                rank_dir.mkdir(parents=True)
                argv = [*RANK_MODULE, "rank", str(r), port, variant, name, str(self.prefix)]
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

    def _abort(self, aborts, who, how, err, core_dir, pid=None):
        wrote = [r for r in range(2) if self.prefix.with_name(f"result.r{r}.json").exists()]
        timeout = f" (killed after {PAIR_TIMEOUT_S:.0f} s)" if self.timed_out else ""
        tail = "\n".join(line for line in err.strip().splitlines() if not FAILED_RANK.match(line))
        tail = "\n".join(tail.splitlines()[-8:])
        aborts[self.variant].append(
            f"{self.launch}: {self.variant} {self.name} pair {self.k} {who}: {how}{timeout} "
            f"(results written by ranks {wrote})\n{tail}\n{_backtrace(core_dir, pid, self.cores_read)}"
        )

    def finish(self, counts, aborts):
        if self.launch == "spawn":
            (p,) = self.procs
            _, err = p.communicate()
            counts[self.variant] += 2
            failed = FAILED_RANK.findall(err)
            for r, how, pid, note in failed:
                self._abort(aborts, f"rank {r}", how + note, err, self.where, pid)
            if not failed and (p.returncode != 0 or "terminate called" in err):
                how = _how(p.returncode) + (", terminate called" if "terminate called" in err else "")
                self._abort(aborts, "launcher", how, err, self.where)
            return
        for r, p in enumerate(self.procs):
            _, err = p.communicate()
            counts[self.variant] += 1
            if p.returncode != 0 or "terminate called" in err:
                self._abort(aborts, f"rank {r}", _how(p.returncode), err, self.where / f"r{r}")
            else:
                shutil.rmtree(self.where / f"r{r}", ignore_errors=True)


@pytest.mark.parametrize("launch", LAUNCHES)
def test_ranks_exit_cleanly_under_load_against_torch_optim(tmp_path, launch):
    if LAUNCH not in ("", *LAUNCHES):
        pytest.fail(f"ROUNDPIPE_EXIT_STRESS_LAUNCH={LAUNCH!r}: one of {LAUNCHES}, or unset for both")
    if LAUNCH and launch != LAUNCH:
        pytest.skip(f"ROUNDPIPE_EXIT_STRESS_LAUNCH={LAUNCH}")
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(SPINNERS)]
    jobs = collections.deque((v, OPTIMIZERS[k % 3], k) for k in range(PAIRS) for v in VARIANTS)
    counts, aborts = collections.Counter(), collections.defaultdict(list)
    running = []
    try:
        while jobs or running:
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
    summary = {v: f"{len(aborts[v])} aborts in {counts[v]} rank runs" for v in VARIANTS}
    print("exit stress:", json.dumps({"launch": launch, **summary}))
    if aborts["roundpipe"]:
        pytest.fail(
            f"{launch}: roundpipe: {summary['roundpipe']}; torch.optim (control): {summary['torch']}\n"
            + "\n".join(aborts["roundpipe"]),
            pytrace=False,
        )
    if aborts["torch"]:
        pytest.fail(
            f"{launch}: only the control aborted ({summary['torch']}): the machine or torch, not "
            "roundpipe\n" + "\n".join(aborts["torch"]),
            pytrace=False,
        )
