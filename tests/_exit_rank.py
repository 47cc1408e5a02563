"""One FSDP2 rank of the exit stress test (``tests/test_exit_stress.py``), and its two launchers.

``rank_main(rank, port, variant, name, out_prefix, shutdown)`` is the rank: gloo (world size 2,
one thread), ``fully_shard`` over a small MLP with uneven shards, without and then with
``CPUOffloadPolicy(pin_memory=False)``, three steps of ``name`` (one of ``KWARGS``: every
elementwise optimizer) from ``roundpipe.optim`` (``variant`` ``roundpipe``) or ``torch.optim``
(``torch``, the control), then the end of the group by ``shutdown``:

* ``plain``: ``barrier`` and ``destroy_process_group``, what torch's examples do (the shutdown
  whose exit can abort: docs/distributed.md, "Ending a rank");
* ``destroy``: ``destroy_process_group`` alone, as issue 61's script ended (a rank may leave
  while the other still runs a collective of its last step);
* ``shutdown``: ``roundpipe.optim.shutdown_process_group()`` once the models and optimizers are
  gone (the training runs in a function that has returned), so it frees the group;
* ``shutdown-held``: the same call with the last model and optimizer still alive, so the group
  outlives it and only its kept barrier guards the exit.

Then it writes ``<out_prefix>.r<rank>.json``: the sum of its local shards per offload setting
(``results``), what ``shutdown_process_group`` returned (``freed``, null for ``plain``) and the
names of the threads alive after the shutdown that were not before ``init_process_group``
(``threads``, from ``/proc/self/task``; empty where there is none). roundpipe is imported by the
roundpipe variant only, after torch, as a training script does.

``inflight_main(rank, port, shutdown)`` forces the abort that the FSDP2 rank meets by chance
under load (a collective still in flight at the end, see its docstring); it imports no
roundpipe code but the shutdown module.

Three ways to start a pair (run from the repository root, or with it on ``PYTHONPATH``)::

    python -m tests._exit_rank rank <rank> <port> <variant> <name> <out_prefix> [<shutdown>]
    python -m tests._exit_rank spawn <port> <variant> <name> <out_prefix> [<shutdown>]
    python -m tests._exit_rank inflight <rank> <port> plain|shutdown   # one rank, as ``rank``

(``shutdown`` ``plain`` where it is left out.) ``rank`` runs one rank in this interpreter, as
torchrun starts each rank (a fresh interpreter per rank; start one for rank 0 and one for rank
1). ``spawn`` runs both ranks with ``torch.multiprocessing.start_processes(...,
start_method="spawn")``, as the script of issue 40 did, joins them, and exits with status 1 when
a rank failed, after one line on stderr for each failed rank: ``rank <r>: signal SIGABRT (pid
<pid>)`` or ``rank <r>: exit status <n> (pid <pid>)``. The spawned ranks write to the launcher's
stdout and stderr.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

# every elementwise optimizer (issue 61's crash stepped RMSprop at its defaults)
KWARGS = {
    "Adadelta": dict(lr=1.0),
    "Adagrad": dict(lr=1e-2),
    "Adam": dict(lr=1e-3, amsgrad=True),
    "AdamW": dict(lr=1e-3),
    "Adamax": dict(lr=2e-3),
    "ASGD": dict(lr=1e-2, t0=1),
    "NAdam": dict(lr=1e-3),
    "RAdam": dict(lr=1e-3),
    "RMSprop": dict(lr=1e-2),
    "Rprop": dict(lr=1e-2),
    "SGD": dict(lr=1e-2, momentum=0.9, weight_decay=1e-2),
}
# after a rank fails, how long the launcher waits for the other to end by itself before
# torch's ProcessContext.join stops it (SIGTERM, then SIGKILL after as long again)
GRACE_S = 30.0


SHUTDOWNS = ("plain", "destroy", "shutdown", "shutdown-held")


def _threads():
    """{thread id: name} of this process (empty where there is no /proc)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    names = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[tid] = f.read().strip()
        except OSError:  # ended meanwhile
            pass
    return names


def _shutdown_function(variant):
    """roundpipe.optim.shutdown_process_group; for the torch variant the same module loaded
    from its file alone, so that the control imports no other roundpipe code."""
    if variant == "roundpipe":
        from roundpipe.optim import shutdown_process_group

        return shutdown_process_group
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "roundpipe", "optim", "shutdown.py")
    spec = importlib.util.spec_from_file_location("_exit_rank_shutdown", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.shutdown_process_group


def _train(rank, optim, name):
    """Both offload settings, three steps each: the sums of the local shards, and the last
    model and optimizer."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    results = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.ReLU(), torch.nn.Linear(65, 7))
        kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, **kw)
        fully_shard(model, **kw)
        opt = getattr(optim, name)(model.parameters(), **KWARGS[name])
        for step in range(3):
            x = torch.randn(16, 33, generator=torch.Generator().manual_seed(step + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results[str(offload)] = float(sum(p.to_local().double().sum() for p in model.parameters()))
    return results, (model, opt)


def rank_main(rank, port, variant, name, out_prefix, shutdown="plain"):
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401  (before init_process_group, as a script's imports)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    if variant == "roundpipe":
        import roundpipe.optim as optim
    elif variant == "torch":
        import torch.optim as optim
    else:
        raise ValueError(f"variant {variant!r}: roundpipe or torch")
    if shutdown not in SHUTDOWNS:
        raise ValueError(f"shutdown {shutdown!r}: one of {SHUTDOWNS}")
    shutdown_process_group = _shutdown_function(variant)
    before = _threads()
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        results, held = _train(rank, optim, name)
        if shutdown != "shutdown-held":
            del held
    except BaseException:
        dist.destroy_process_group()
        raise
    freed = None
    if shutdown in ("plain", "destroy"):
        if shutdown == "plain":
            dist.barrier()
        dist.destroy_process_group()
    else:
        freed = shutdown_process_group()
    threads = sorted(n for tid, n in _threads().items() if tid not in before)
    with open(f"{out_prefix}.r{rank}.json", "w") as f:
        json.dump({"results": results, "freed": freed, "threads": threads}, f)


# the in-flight pair: rank 1 joins rank 0's all_reduce this late, and rank 0's last exit function
# holds the GIL about 4 times as long (summing this many ints in C, no bytecode)
INFLIGHT_DELAY_S = 0.3
INFLIGHT_HOLD = 10**8
_HELD = []  # the in-flight rank's tensor and group, alive to the end


def inflight_main(rank, port, shutdown):
    """The exit abort forced: a collective still in flight when the script ends.

    Both ranks start an ``all_reduce`` and keep its tensor and the group (as torch's caches keep
    an FSDP2 mesh, and with it the group), not the work; rank 1 starts it ``INFLIGHT_DELAY_S``
    late. Then ``shutdown`` (``plain``: ``destroy_process_group``; ``shutdown``:
    ``shutdown_process_group``, loaded alone as for the torch variant) and, as the only exit
    function, C code that holds the GIL up to the finalizing flag. After ``plain``, rank 0's
    gloo worker finishes the all_reduce while that runs, drops the work, asks for the GIL to
    release the tensor's Python object, is still waiting when the flag is set and is told to
    exit: ``terminate called without an active exception``, SIGABRT (rank 1's worker as well,
    finishing first). ``shutdown_process_group``'s barrier waits for the all_reduce and keeps
    it, so the worker destroys nothing."""
    import atexit
    import time

    import torch
    import torch.distributed as dist

    if shutdown not in ("plain", "shutdown"):
        raise ValueError(f"shutdown {shutdown!r}: plain or shutdown")
    shutdown_process_group = _shutdown_function("torch")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    if rank == 1:
        time.sleep(INFLIGHT_DELAY_S)
    tensor = torch.ones(1 << 10)
    dist.all_reduce(tensor, async_op=True)
    _HELD.extend([tensor, dist.group.WORLD])
    if shutdown == "plain":
        dist.destroy_process_group()
    else:
        print(f"rank {rank}: shutdown_process_group returned {shutdown_process_group()}", flush=True)
    atexit._clear()  # no exit function of torch's or Python's (bytecode) runs after the one below
    atexit.register(sum, range(INFLIGHT_HOLD))


def _how(exitcode):
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit status {exitcode}"


def spawn_pair(port, variant, name, out_prefix, shutdown="plain"):
    """Both ranks by ``torch.multiprocessing.start_processes``; the failed ranks' lines on
    stderr, and how many failed."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        rank_main,
        args=(port, variant, name, out_prefix, shutdown),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    first = None
    try:
        while not context.join(grace_period=GRACE_S):
            pass
    except mp.ProcessExitedException as e:
        first = e.error_index
        print(f"launcher: {e}", file=sys.stderr)
    except mp.ProcessRaisedException as e:
        first = e.error_index
        print(f"launcher: {e}", file=sys.stderr)
    failed = 0
    for r, p in enumerate(context.processes):
        p.join()
        if p.exitcode != 0:
            failed += 1
            note = ""
            if first is not None and r != first and p.exitcode in (-signal.SIGTERM, -signal.SIGKILL):
                note = f", probably stopped by the launcher after rank {first} failed"
            print(f"rank {r}: {_how(p.exitcode)} (pid {p.pid}{note})", file=sys.stderr, flush=True)
    return failed


def main(argv):
    usage = (
        "usage: python -m tests._exit_rank rank <rank> <port> <variant> <name> <out_prefix> [<shutdown>]\n"
        "       python -m tests._exit_rank spawn <port> <variant> <name> <out_prefix> [<shutdown>]\n"
        "       python -m tests._exit_rank inflight <rank> <port> plain|shutdown"
    )
    if len(argv) == 4 and argv[0] == "inflight":
        inflight_main(int(argv[1]), argv[2], argv[3])
        return 0
    if len(argv) in (6, 7) and argv[0] == "rank":
        rank_main(int(argv[1]), argv[2], *argv[3:])
        return 0
    if len(argv) in (5, 6) and argv[0] == "spawn":
        return 1 if spawn_pair(*argv[1:]) else 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
