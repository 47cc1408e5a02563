"""FSDP2 ranks exit cleanly under heavy load, on roundpipe's default engine and, as the control in
the same run, on ``torch.optim``: a flake of the machine and a flake of ours read
differently.

Each rank pair is two fresh interpreters (as torchrun starts them) on gloo, one thread each,
``fully_shard`` over a small MLP with uneven shards, with and without
``CPUOffloadPolicy(pin_memory=False)``, stepping AdamW, SGD (momentum, weight decay) or NAdam,
writing its result, then ``barrier`` and ``destroy_process_group``, while ``SPINNERS`` processes
keep both cores busy. A rank that exits non-zero, dies by a signal or prints ``terminate called``
counts as an abort; its core dump (``RLIMIT_CORE`` raised for the ranks; the kernel's
``core_pattern`` decides where it goes) is read with ``gdb`` where both are there, and the
backtrace of every thread goes into the failure message.

Opt-in: it takes about 12 s per pair on 2 cores, so CI's default pass leaves it out.
``ROUNDPIPE_EXIT_STRESS=N`` runs N pairs of each variant (72 pairs: 144 rank runs each, about
30 minutes); see CONTRIBUTING.md.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest

PAIRS = int(os.environ.get("ROUNDPIPE_EXIT_STRESS", "0") or 0)
pytestmark = pytest.mark.skipif(
    PAIRS < 1, reason="opt-in stress test: ROUNDPIPE_EXIT_STRESS=<pairs per variant> (CONTRIBUTING.md)"
)

SPINNERS = 4
PARALLEL = 2  # rank pairs at a time
PAIR_TIMEOUT_S = 300.0
OPTIMIZERS = ("AdamW", "SGD", "NAdam")
VARIANTS = ("roundpipe", "torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANK = textwrap.dedent(
    """
    import datetime, json, os, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    rank, port, variant, name, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    if variant == "roundpipe":
        import roundpipe.optim as optim
    else:
        import torch.optim as optim
    KW = {"AdamW": dict(lr=1e-3), "SGD": dict(lr=1e-2, momentum=0.9, weight_decay=1e-2)}
    KW["NAdam"] = dict(lr=1e-3)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for offload in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.ReLU(), torch.nn.Linear(65, 7))
            kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, **kw)
            fully_shard(model, **kw)
            opt = getattr(optim, name)(model.parameters(), **KW[name])
            for step in range(3):
                x = torch.randn(16, 33, generator=torch.Generator().manual_seed(step + rank))
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            results[str(offload)] = float(sum(p.to_local().double().sum() for p in model.parameters()))
        with open(out, "w") as f:
            json.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    """
)


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


def _backtrace(rank_dir):
    """Every thread's backtrace from the rank's core dump, where there is one and gdb."""
    cores = [f for f in os.listdir(rank_dir) if f.startswith("core")]
    if not cores or shutil.which("gdb") is None:
        return "(no core dump in the rank's directory, or no gdb)"
    cmd = ["gdb", "-batch", "-ex", "info threads", "-ex", "thread apply all bt", sys.executable]
    core = os.path.join(rank_dir, cores[0])
    out = subprocess.run([*cmd, core], capture_output=True, text=True, timeout=600)
    return out.stdout[-12000:]


def _start(tmp_path, variant, name, k):
    where = tmp_path / f"{variant}-{name}-{k}"
    port = _port()
    procs = []
    for r in range(2):
        rank_dir = where / f"r{r}"
        rank_dir.mkdir(parents=True)
        argv = [sys.executable, "-c", RANK, str(r), port, variant, name, str(where / f"r{r}.json")]
        procs.append(
            subprocess.Popen(
                argv,
                cwd=rank_dir,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=_allow_core_dumps,
            )
        )
    return (variant, name, k, where, procs, time.monotonic())


def _finish(run, counts, aborts):
    variant, name, k, where, procs, _ = run
    for r, p in enumerate(procs):
        _, err = p.communicate()
        counts[variant] += 1
        wrote = (where / f"r{r}.json").exists()
        if p.returncode != 0 or "terminate called" in err:
            how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}"
            tail = "\n".join(err.strip().splitlines()[-8:])
            aborts[variant].append(
                f"{variant} {name} pair {k} rank {r}: {how} (result written: {wrote})\n{tail}\n"
                f"{_backtrace(where / f'r{r}')}"
            )
        else:
            shutil.rmtree(where / f"r{r}", ignore_errors=True)


def test_ranks_exit_cleanly_under_load_against_torch_optim(tmp_path):
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(SPINNERS)]
    jobs = collections.deque((v, OPTIMIZERS[k % 3], k) for k in range(PAIRS) for v in VARIANTS)
    counts, aborts = collections.Counter(), collections.defaultdict(list)
    running = []
    try:
        while jobs or running:
            while jobs and len(running) < PARALLEL:
                running.append(_start(tmp_path, *jobs.popleft()))
            time.sleep(0.2)
            still = []
            for run in running:
                procs, started = run[4], run[5]
                if any(p.poll() is None for p in procs):
                    if time.monotonic() - started < PAIR_TIMEOUT_S:
                        still.append(run)
                        continue
                    for p in procs:
                        p.kill()
                _finish(run, counts, aborts)
            running = still
    finally:
        for p in spin:
            p.kill()
            p.wait()
        for run in running:
            for p in run[4]:
                p.kill()
    summary = {v: f"{len(aborts[v])} aborts in {counts[v]} rank runs" for v in VARIANTS}
    print("exit stress:", json.dumps(summary))
    if aborts["roundpipe"]:
        pytest.fail(
            f"roundpipe: {summary['roundpipe']}; torch.optim (control): {summary['torch']}\n"
            + "\n".join(aborts["roundpipe"]),
            pytrace=False,
        )
    if aborts["torch"]:
        pytest.fail(
            f"only the control aborted ({summary['torch']}): the machine or torch, not roundpipe\n"
            + "\n".join(aborts["torch"]),
            pytrace=False,
        )
