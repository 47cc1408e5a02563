"""A sharded (FSDP2) optimizer step next to an unsharded one of the same total size.

    python -m roundpipe.optim.bench.fsdp [--optimizers Adam,SGD] [--backends fast,fast:torch]
                                         [--workloads large,layers] [--repeats 7] [--warmup 2]

Only ``opt.step()`` is timed (no forward or backward). For each workload, optimizer (with the
main bench's options, ``bench.OPTIONS``) and engine (the roundpipe backends, default ``fast``,
then ``torch for-loop``: torch.optim with ``foreach=False``, which is what it uses for DTensors
on the CPU):

* ``unsharded N, W threads``: one process, plain tensors, all N elements, W = world size threads
  (the same cores the ranks use below);
* ``unsharded N, 1 thread``;
* ``unsharded N/W, 1 thread``: one process stepping tensors shaped like one rank's shards (the
  work of one rank, alone on the machine);
* ``sharded N, W x 1 thread``: W processes (gloo, CPU) holding ``fully_shard`` DTensor
  parameters, gradients and state, one thread each, stepping at the same time (a barrier before
  each step); the slowest rank's median.

"sharded / (N/W alone)" is the per-rank cost of FSDP2 relative to the same local work without
DTensors and without a neighbour on the other core: DTensor unwrapping, per-step checks, and the
memory bandwidth the ranks share. "sharded / unsharded W threads" is what sharding costs (or
saves) against stepping the same model in one process on the same cores.

Medians of ``--repeats`` timed steps after ``--warmup`` steps (state creation, compilation).
Timings on a shared machine are noise: run it on an idle one.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import warnings

WORLD_SIZE = 2
TORCH = "torch for-loop"  # the engine column of torch.optim's own step
WORKLOADS = {
    # 4 x 4M: large tensors, sharded on dim 0 into 2 x 2M
    "large": [(4096, 1024)] * 4,
    # 4 transformer layers at d=512 (attention 4 x 512x512, MLP 2048x512 and 512x2048, biases
    # and norms): 12.6M elements in 56 tensors, many small
    "layers": [
        shape
        for _ in range(4)
        for shape in [(512, 512)] * 4 + [(2048, 512), (512, 2048), (2048,)] + [(512,)] * 7
    ],
}


def _median_ms(samples):
    return 1e3 * statistics.median(samples)


def _make_opt(torch, name, engine, params):
    import roundpipe.optim
    from roundpipe.optim.bench import OPTIONS
    from roundpipe.optim.spec import SPECS

    if engine == TORCH:
        return SPECS[name].torch_class(params, foreach=False, **OPTIONS[name])
    return getattr(roundpipe.optim, name)(params, backend=engine, **OPTIONS[name])


def _time_steps(opt, warmup, repeats, sync=None):
    for _ in range(warmup):
        opt.step()
    samples = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        opt.step()
        samples.append(time.perf_counter() - start)
    return samples


def _unsharded(args, engines):
    import torch

    out = {}
    for wname in args.workloads:
        shapes = WORKLOADS[wname]
        local = [(-(-s[0] // WORLD_SIZE), *s[1:]) for s in shapes]  # rank 0's shard shapes
        for name in args.optimizers:
            for engine in engines:
                if engine == TORCH and name == "Rprop":
                    continue
                for label, shp, threads in (
                    (f"unsharded N, {WORLD_SIZE} threads", shapes, WORLD_SIZE),
                    ("unsharded N, 1 thread", shapes, 1),
                    (f"unsharded N/{WORLD_SIZE}, 1 thread", local, 1),
                ):
                    torch.set_num_threads(threads)
                    g = torch.Generator().manual_seed(0)
                    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shp]
                    for p in params:
                        p.grad = torch.randn(p.shape, generator=g)
                    opt = _make_opt(torch, name, engine, params)
                    out[(wname, name, engine, label)] = _median_ms(
                        _time_steps(opt, args.warmup, args.repeats)
                    )
                    del opt, params
    torch.set_num_threads(1)
    return out


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, port, args, engines, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from roundpipe.optim.shutdown import shutdown_process_group

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    out = {}
    try:
        for wname in args.workloads:
            for name in args.optimizers:
                for engine in engines:
                    if engine == TORCH and name == "Rprop":
                        continue  # torch 2.13's Rprop cannot step sharded DTensors
                    torch.manual_seed(0)
                    bag = torch.nn.Module()
                    bag.ps = torch.nn.ParameterList(
                        [torch.nn.Parameter(torch.randn(s)) for s in WORKLOADS[wname]]
                    )
                    fully_shard(bag)
                    params = list(bag.parameters())
                    g = torch.Generator().manual_seed(rank)
                    for p in params:
                        local = torch.randn(p.to_local().shape, generator=g)
                        p.grad = DTensor.from_local(
                            local,
                            p.device_mesh,
                            p.placements,
                            run_check=False,
                            shape=p.shape,
                            stride=p.stride(),
                        )
                    opt = _make_opt(torch, name, engine, params)
                    samples = _time_steps(opt, args.warmup, args.repeats, sync=dist.barrier)
                    out[(wname, name, engine, f"sharded N, {WORLD_SIZE} x 1 thread")] = _median_ms(samples)
                    del opt, params, bag
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    shutdown_process_group()  # not a bare destroy: docs/distributed.md, "Ending a rank"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizers", default="Adam,SGD")
    parser.add_argument(
        "--backends", default="fast", help="roundpipe backends, comma-separated, or all (default: fast)"
    )
    parser.add_argument("--workloads", default="large,layers")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    from roundpipe.optim.bench import parse_backends, parse_names
    from roundpipe.optim.spec import SPECS

    try:
        args.optimizers = parse_names(args.optimizers, tuple(SPECS), "optimizer")
        args.workloads = parse_names(args.workloads, tuple(WORKLOADS), "workload")
        backends = parse_backends(args.backends)  # native: fast:numba's old name; all: every engine
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    engines = [*backends, TORCH]
    os.environ["OMP_NUM_THREADS"] = "1"  # the ranks; the unsharded runs set their own counts
    for var in ("ROUNDPIPE_OPTIM_BACKEND", "ROUNDPIPE_OPTIM_ENGINE", "ROUNDPIPE_OPTIM_NUM_THREADS"):
        os.environ.pop(var, None)

    import tempfile

    import torch
    import torch.multiprocessing as tmp

    results = _unsharded(args, engines)
    with tempfile.TemporaryDirectory() as out_dir:
        tmp.start_processes(
            _rank, args=(_free_port(), args, engines, out_dir), nprocs=WORLD_SIZE, start_method="spawn"
        )
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD_SIZE)]
    for key in ranks[0]:
        results[key] = max(r[key] for r in ranks)  # the slowest rank

    cols = [
        f"unsharded N, {WORLD_SIZE} threads",
        "unsharded N, 1 thread",
        f"unsharded N/{WORLD_SIZE}, 1 thread",
        f"sharded N, {WORLD_SIZE} x 1 thread",
    ]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; median step times in ms")
    for wname in args.workloads:
        n = sum(torch.Size(s).numel() for s in WORKLOADS[wname])
        print(f"\n{wname}: N = {n / 1e6:.1f}M fp32 elements in {len(WORKLOADS[wname])} tensors")
        head = [
            "optimizer",
            "engine",
            *cols,
            f"sharded / N/{WORLD_SIZE} alone",
            f"sharded / {WORLD_SIZE} threads",
        ]
        print(" | ".join(head))
        print(" | ".join("---" for _ in head))
        for name in args.optimizers:
            for engine in engines:
                vals = [results.get((wname, name, engine, c)) for c in cols]
                if any(v is None for v in vals):
                    continue
                row = [
                    name,
                    engine,
                    *(f"{v:.2f}" for v in vals),
                    f"{vals[3] / vals[2]:.2f}",
                    f"{vals[3] / vals[0]:.2f}",
                ]
                print(" | ".join(row))


if __name__ == "__main__":
    main()
