"""One FSDP2 rank of the exit stress test (``tests/test_exit_stress.py``), and its two launchers.

``rank_main(rank, port, variant, name, out_prefix)`` is the rank: gloo (world size 2, one
thread), ``fully_shard`` over a small MLP with uneven shards, without and then with
``CPUOffloadPolicy(pin_memory=False)``, three steps of ``name`` (AdamW, SGD with momentum and
weight decay, or NAdam) from ``roundpipe.optim`` (``variant`` ``roundpipe``) or ``torch.optim``
(``torch``, the control), the sum of its local shards written to ``<out_prefix>.r<rank>.json``,
then ``barrier`` and ``destroy_process_group``. roundpipe is imported by the roundpipe variant
only, after torch, as a training script does.

Two ways to start a pair (run from the repository root, or with it on ``PYTHONPATH``)::

    python -m tests._exit_rank rank <rank> <port> <variant> <name> <out_prefix>
    python -m tests._exit_rank spawn <port> <variant> <name> <out_prefix>

``rank`` runs one rank in this interpreter, as torchrun starts each rank (a fresh interpreter
per rank; start one for rank 0 and one for rank 1). ``spawn`` runs both ranks with
``torch.multiprocessing.start_processes(..., start_method="spawn")``, as the script of issue 40
did, joins them, and exits with status 1 when a rank failed, after one line on stderr for each
failed rank: ``rank <r>: signal SIGABRT (pid <pid>)`` or ``rank <r>: exit status <n> (pid
<pid>)``. The spawned ranks write to the launcher's stdout and stderr.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

KWARGS = {
    "AdamW": dict(lr=1e-3),
    "SGD": dict(lr=1e-2, momentum=0.9, weight_decay=1e-2),
    "NAdam": dict(lr=1e-3),
}
# after a rank fails, how long the launcher waits for the other to end by itself before
# torch's ProcessContext.join stops it (SIGTERM, then SIGKILL after as long again)
GRACE_S = 30.0


def rank_main(rank, port, variant, name, out_prefix):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    if variant == "roundpipe":
        import roundpipe.optim as optim
    elif variant == "torch":
        import torch.optim as optim
    else:
        raise ValueError(f"variant {variant!r}: roundpipe or torch")
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
            opt = getattr(optim, name)(model.parameters(), **KWARGS[name])
            for step in range(3):
                x = torch.randn(16, 33, generator=torch.Generator().manual_seed(step + rank))
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            results[str(offload)] = float(sum(p.to_local().double().sum() for p in model.parameters()))
        with open(f"{out_prefix}.r{rank}.json", "w") as f:
            json.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _how(exitcode):
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit status {exitcode}"


def spawn_pair(port, variant, name, out_prefix):
    """Both ranks by ``torch.multiprocessing.start_processes``; the failed ranks' lines on
    stderr, and how many failed."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        rank_main, args=(port, variant, name, out_prefix), nprocs=2, join=False, start_method="spawn"
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
        "usage: python -m tests._exit_rank rank <rank> <port> <variant> <name> <out_prefix>\n"
        "       python -m tests._exit_rank spawn <port> <variant> <name> <out_prefix>"
    )
    if len(argv) == 6 and argv[0] == "rank":
        rank_main(int(argv[1]), argv[2], *argv[3:])
        return 0
    if len(argv) == 5 and argv[0] == "spawn":
        return 1 if spawn_pair(*argv[1:]) else 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
