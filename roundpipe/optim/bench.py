"""Benchmark roundpipe.optim against torch.optim's CPU paths, side by side in one process.

    python -m roundpipe.optim.bench [--quick] [--optimizers Adam,SGD] [--workloads small,large]
                                    [--backends fast,reference] [--repeats N] [--warmup N]
                                    [--threads N] [--json PATH] [--plot PATH.png]

For every optimizer that ``roundpipe.optim`` provides (the others are skipped with a message) and
every workload, the same parameters and gradients (seeded) are stepped by each configuration:

* ``torch for-loop``  ``torch.optim.<Name>(..., foreach=False)``
* ``torch foreach``   ``torch.optim.<Name>(..., foreach=True)``
* ``torch fused``     ``torch.optim.<Name>(..., fused=True)``, where torch has a CPU kernel
  (detected by trying; in torch 2.13: Adam, AdamW, SGD, Adagrad)
* ``rp <backend>``    ``roundpipe.optim.<Name>(..., backend=<backend>)``; ``fast`` by default

Methodology (the machine may be shared and noisy):

* each configuration takes ``--warmup`` steps first (state creation, compilation caches);
* then the configurations step round-robin (the starting one rotates each round) for
  ``--repeats`` rounds; the reported time is the **median** step time of each;
* the memory bandwidth is measured in the same run (in-place ``mul_`` and ``copy_`` on 256 MiB
  arrays, before and after the optimizers; the higher of the two medians is the ceiling);
* the bandwidth-bound time of a step is the minimal traffic (each tensor the step reads, read
  once, plus each tensor it writes, written once: ``BYTES_PER_ELEMENT`` below) divided by that
  bandwidth; "% bw" is that bound over the measured median (100% = at the memory limit);
* after timing, each roundpipe backend is checked against torch's for-loop: two steps from
  identical fresh inputs, ``torch.testing.assert_close`` on parameters and state. A mismatch is
  reported in the table instead of a speedup and makes the exit status 1;
* configurations are built for one optimizer at a time and freed before the next.

``--quick`` (about a minute on 2 vCPUs): 1 warm-up step and 3 repetitions instead of 2 and 7;
``large`` is 4 x 2M elements instead of 4 x 16M (still 128 MiB of Adam state, far above L3);
``transformer`` keeps d=512 but has a 8000-token embedding and 2 layers instead of 32000 and 8;
``small`` is unchanged; the bandwidth probe uses 128 MiB arrays.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

import numexpr
import numpy as np
import torch

from roundpipe import optim as rp_optim
from roundpipe.optim.spec import SPECS

# the eleven optimizers, in the spec registry's order
ALL_OPTIMIZERS = tuple(SPECS)

# Representative settings: torch's defaults, except SGD with momentum (plain SGD is rare).
OPTIONS = {name: {} for name in ALL_OPTIMIZERS}
OPTIONS["SGD"] = {"momentum": 0.9}

# Minimal bytes a step moves per fp32 element with the settings above (steady state): every
# tensor the step reads, read once, plus every tensor it writes, written once, 4 bytes each.
BYTES_PER_ELEMENT = {
    # reads param, grad, square_avg, acc_delta; writes param, square_avg, acc_delta
    "Adadelta": 28,
    # reads param, grad, sum; writes param, sum
    "Adagrad": 20,
    # reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq
    "Adam": 28,
    # reads param, grad, exp_avg, exp_inf; writes param, exp_avg, exp_inf
    "Adamax": 28,
    # as Adam (the decoupled decay reads the param that is read anyway)
    "AdamW": 28,
    # reads param, grad; writes param, ax (t0=1e6: mu == 1, so ax = param and the old ax is unread)
    "ASGD": 16,
    # reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq
    "NAdam": 28,
    # reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq
    "RAdam": 28,
    # reads param, grad, square_avg; writes param, square_avg (momentum=0, centered=False)
    "RMSprop": 20,
    # reads param, grad, prev, step_size; writes param, prev, step_size
    "Rprop": 28,
    # reads param, grad, momentum_buffer; writes param, momentum_buffer
    "SGD": 20,
}

WORKLOADS = ("large", "small", "transformer")
ENV_PREFIXES = ("ROUNDPIPE_", "OMP_", "NUMEXPR_", "MKL_")  # environment variables worth reporting
TORCH_CONFIGS = ("torch for-loop", "torch foreach", "torch fused")
LOOP, FOREACH, FUSED = TORCH_CONFIGS


def rp_threads():
    """The thread count roundpipe's steps use, where roundpipe.optim reports one."""
    get = getattr(rp_optim, "get_num_threads", None)
    return get() if get else None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# workloads


def workload_shapes(name: str, quick: bool) -> tuple[str, list[tuple[int, ...]]]:
    """(description, shapes) of a workload."""
    if name == "large":
        n = (2 if quick else 16) * 2**20
        return f"4 tensors of {n // 2**20}M fp32 ({n * 4 // 2**20} MiB each)", [(n,)] * 4
    if name == "small":
        g = torch.Generator().manual_seed(1234)
        sizes = torch.randint(0, 1025, (2000,), generator=g).tolist()
        shapes = [(s,) for s in sizes] + [(3, 4, 5), (2, 8, 16), (1, 1, 1), (4, 1, 7), (8, 8, 8), (16, 3, 3)]
        return "2000 1-D tensors of 0..1024 elements (seeded) + 6 small 3-D ones", shapes
    if name == "transformer":
        vocab, layers, d = (8000, 2, 512) if quick else (32000, 8, 512)
        shapes = [(vocab, d)]
        for _ in range(layers):
            shapes += [(d, d), (d,)] * 4  # q, k, v, o weights and biases
            shapes += [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # mlp up and down
            shapes += [(d,)] * 4  # two layernorms, weight and bias
        shapes += [(d,), (d,)]  # final layernorm
        return f"{vocab}x{d} embedding + {layers} layers at d={d} (qkvo, mlp 4d, biases, layernorms)", shapes
    raise ValueError(name)


def make_workload(name: str, quick: bool):
    desc, shapes = workload_shapes(name, quick)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g).mul_(0.1) for s in shapes]
    return desc, params, grads


def clone_params(base_params, base_grads):
    params = []
    for p, g in zip(base_params, base_grads, strict=True):
        q = torch.nn.Parameter(p.clone())
        q.grad = g.clone()
        params.append(q)
    return params


# ---------------------------------------------------------------------------------------------
# configurations


def has_fused(name: str) -> bool:
    """Whether torch has a fused CPU implementation of this optimizer (by trying one)."""
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            getattr(torch.optim, name)([p], fused=True, **OPTIONS[name]).step()
    except Exception:
        return False
    return True


def make_optimizer(config: str, name: str, params):
    kwargs = OPTIONS[name]
    if config == LOOP:
        return getattr(torch.optim, name)(params, foreach=False, **kwargs)
    if config == FOREACH:
        return getattr(torch.optim, name)(params, foreach=True, **kwargs)
    if config == FUSED:
        return getattr(torch.optim, name)(params, fused=True, **kwargs)
    backend = config.removeprefix("rp ")
    return getattr(rp_optim, name)(params, backend=backend, **kwargs)


def timed_step(opt) -> float:
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def check(name: str, backend: str, base_params, base_grads, steps: int = 2) -> str | None:
    """None if roundpipe matches torch's for-loop after ``steps`` steps, else the mismatch."""
    ref_params = clone_params(base_params, base_grads)
    rp_params = clone_params(base_params, base_grads)
    ref = make_optimizer(LOOP, name, ref_params)
    rp = make_optimizer("rp " + backend, name, rp_params)
    try:
        for _ in range(steps):
            ref.step()
            rp.step()
        for i, (a, b) in enumerate(zip(ref_params, rp_params, strict=True)):
            torch.testing.assert_close(b.detach(), a.detach(), msg=lambda m, i=i: f"param {i}: {m}")
            for key, v in ref.state[a].items():
                w = rp.state[b].get(key)
                if isinstance(v, torch.Tensor):
                    torch.testing.assert_close(w, v, msg=lambda m, i=i, k=key: f"param {i} state {k!r}: {m}")
    except Exception as e:  # an AssertionError, or the backend failing
        return f"{type(e).__name__}: {e}".strip()
    return None


# ---------------------------------------------------------------------------------------------
# memory bandwidth


def measure_bandwidth(numel: int, repeats: int) -> dict:
    """Seconds per in-place ``mul_`` (reads and writes numel floats) and per ``copy_``."""
    a = torch.full((numel,), 1.0)
    b = torch.empty_like(a)
    b.copy_(a)  # touch every page first
    out = {"mul_": [], "copy_": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.mul_(1.0000001)
        out["mul_"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b.copy_(a)
        out["copy_"].append(time.perf_counter() - t0)
    return out


def summarize_bandwidth(samples: dict, numel: int) -> dict:
    moved = 2 * 4 * numel  # each op reads numel floats and writes numel floats
    res = {}
    for op, ts in samples.items():
        med = statistics.median(ts)
        res[op] = {"bytes": moved, "samples_s": ts, "median_s": med, "GBps": moved / med / 1e9}
    res["ceiling_GBps"] = max(r["GBps"] for r in res.values())
    return res


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Row:
    optimizer: str
    bytes_per_element: int
    numel: int
    median_ms: dict = field(default_factory=dict)  # config -> ms
    min_ms: dict = field(default_factory=dict)
    samples_ms: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # config -> message
    checks: dict = field(default_factory=dict)  # backend -> None or message


def bench_one(name, configs, base_params, base_grads, warmup, repeats, label) -> Row:
    numel = sum(p.numel() for p in base_params)
    row = Row(name, BYTES_PER_ELEMENT[name], numel)
    live = {}
    for config in configs:
        try:
            opt = make_optimizer(config, name, clone_params(base_params, base_grads))
            for _ in range(warmup):
                opt.step()
        except Exception as e:
            row.errors[config] = f"{type(e).__name__}: {e}"
            log(f"  [{label}] {name} {config}: FAILED: {row.errors[config]}")
            continue
        live[config] = opt
    order = list(live)
    samples = {c: [] for c in order}
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for k in range(len(order)):
                config = order[(r + k) % len(order)]
                samples[config].append(timed_step(live[config]))
    finally:
        gc.enable()
    live.clear()
    gc.collect()
    for config, ts in samples.items():
        row.samples_ms[config] = [t * 1e3 for t in ts]
        row.median_ms[config] = statistics.median(ts) * 1e3
        row.min_ms[config] = min(ts) * 1e3
    return row


def run(args) -> dict:
    quick = args.quick
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    repeats = args.repeats if args.repeats is not None else (3 if quick else 7)
    bw_numel = (32 if quick else 64) * 2**20
    bw_repeats = 5 if quick else 9

    available = [n for n in args.optimizers if hasattr(rp_optim, n)]
    missing = [n for n in args.optimizers if n not in available]
    if missing:
        log(
            f"note: roundpipe.optim does not provide {', '.join(missing)} (yet); skipped. "
            f"It provides: {', '.join(n for n in ALL_OPTIMIZERS if hasattr(rp_optim, n)) or 'none'}"
        )
    if not available:
        raise SystemExit("error: none of the requested optimizers exists in roundpipe.optim")
    fused = {n: has_fused(n) for n in available}
    rp_configs = ["rp " + b for b in args.backends]

    meta = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numexpr": numexpr.__version__,
        "numpy": np.__version__,
        "numexpr_use_vml": bool(numexpr.use_vml),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "numexpr_threads": numexpr.get_num_threads(),
        "roundpipe_threads": rp_threads(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
        "quick": quick,
        "warmup": warmup,
        "repeats": repeats,
        "backends": args.backends,
        "optimizers": available,
        "skipped_optimizers": missing,
        "options": {n: OPTIONS[n] for n in available},
        "fused_available": fused,
        "argv": sys.argv[1:],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    log(
        f"threads: torch {meta['torch_threads']}, numexpr {meta['numexpr_threads']}; "
        f"warm-up {warmup}, repetitions {repeats}"
    )
    log("measuring memory bandwidth ...")
    bw_samples = measure_bandwidth(bw_numel, bw_repeats)

    t_start = time.perf_counter()
    results = {}
    for wl in args.workloads:
        desc, base_params, base_grads = make_workload(wl, quick)
        numel = sum(p.numel() for p in base_params)
        log(f"[{wl}] {desc}: {len(base_params)} tensors, {numel:,} elements")
        rows = []
        for name in available:
            t0 = time.perf_counter()
            configs = [LOOP, FOREACH] + ([FUSED] if fused[name] else []) + rp_configs
            row = bench_one(name, configs, base_params, base_grads, warmup, repeats, wl)
            for b in args.backends:
                if "rp " + b in row.errors:
                    continue
                row.checks[b] = check(name, b, base_params, base_grads)
                if row.checks[b] is not None:
                    log(f"  [{wl}] {name} rp {b}: MISMATCH with torch: {row.checks[b]}")
            gc.collect()
            times = ", ".join(f"{c} {ms:.2f}" for c, ms in row.median_ms.items())
            log(f"  [{wl}] {name}: {times} ms  ({time.perf_counter() - t0:.1f}s)")
            rows.append(row)
        results[wl] = {"description": desc, "tensors": len(base_params), "numel": numel, "rows": rows}
        del base_params, base_grads
        gc.collect()

    more = measure_bandwidth(bw_numel, bw_repeats)
    for op in bw_samples:
        bw_samples[op] += more[op]
    bandwidth = summarize_bandwidth(bw_samples, bw_numel)
    meta["elapsed_s"] = time.perf_counter() - t_start
    return {"meta": meta, "bandwidth": bandwidth, "workloads": results}


# ---------------------------------------------------------------------------------------------
# reporting


def bound_ms(row: Row, gbps: float) -> float:
    return row.bytes_per_element * row.numel / (gbps * 1e9) * 1e3


def derived(row: Row, backends, gbps: float) -> dict:
    """Speedups and bandwidth fractions of each roundpipe backend."""
    out = {"bound_ms": bound_ms(row, gbps)}
    loop, fused = row.median_ms.get(LOOP), row.median_ms.get(FUSED)
    for b in backends:
        ms = row.median_ms.get("rp " + b)
        if ms is None:
            continue
        out[b] = {
            "speedup_vs_for_loop": loop / ms if loop else None,
            "speedup_vs_fused": fused / ms if fused else None,
            "fraction_of_bandwidth_limit": out["bound_ms"] / ms,
            "matches_torch": row.checks.get(b) is None,
        }
    return out


def fmt_ms(v):
    return "n/a" if v is None else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def format_table(wl: str, res: dict, backends, gbps: float) -> str:
    header = ["optimizer", "B/elem", "for-loop ms", "foreach ms", "fused ms"]
    for b in backends:
        header += [f"{b} ms"]
    for b in backends:
        header += [f"{b} vs loop", f"{b} vs fused", f"{b} % bw"]
    header += ["bw-bound ms"]
    lines = []
    for row in res["rows"]:
        d = derived(row, backends, gbps)
        cells = [row.optimizer, str(row.bytes_per_element)]
        cells += [fmt_ms(row.median_ms.get(c)) for c in TORCH_CONFIGS]
        cells += [fmt_ms(row.median_ms.get("rp " + b)) for b in backends]
        for b in backends:
            if b not in d:
                cells += ["ERROR"] * 3
            elif not d[b]["matches_torch"]:
                cells += ["MISMATCH"] * 3
            else:
                x = d[b]
                cells += [
                    f"{x['speedup_vs_for_loop']:.2f}x",
                    "n/a" if x["speedup_vs_fused"] is None else f"{x['speedup_vs_fused']:.2f}x",
                    f"{100 * x['fraction_of_bandwidth_limit']:.0f}%",
                ]
        cells.append(fmt_ms(d["bound_ms"]))
        lines.append(cells)
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    title = f"workload {wl}: {res['description']}; {res['tensors']} tensors, {res['numel']:,} elements"

    def fmt(cells):
        pairs = zip(cells, widths, strict=True)
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(pairs))

    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([title, fmt(header), sep, *[fmt(c) for c in lines]])


def report(result: dict, backends) -> str:
    meta, bw = result["meta"], result["bandwidth"]
    gbps = bw["ceiling_GBps"]
    out = [
        f"roundpipe.optim benchmark ({'quick' if meta['quick'] else 'full'}): torch {meta['torch']}, "
        f"numexpr {meta['numexpr']} (vml {meta['numexpr_use_vml']}), numpy {meta['numpy']}, "
        f"python {meta['python']}",
        f"threads: torch {meta['torch_threads']}, numexpr {meta['numexpr_threads']}, "
        f"roundpipe step {meta['roundpipe_threads']}, cpus {meta['cpu_count']}; "
        f"median of {meta['repeats']} round-robin repetitions "
        f"after {meta['warmup']} warm-up step(s)",
        f"memory bandwidth (bytes read + written; in-place mul_ on {bw['mul_']['bytes'] // 2**21} MiB, "
        "copy_ between two such arrays): "
        f"mul_ {bw['mul_']['GBps']:.1f} GB/s, copy_ {bw['copy_']['GBps']:.1f} GB/s; "
        f"ceiling used: {gbps:.1f} GB/s",
        "times are median ms per step; 'vs loop'/'vs fused' = torch time / roundpipe time; "
        "'% bw' = bandwidth-bound time / roundpipe time",
    ]
    if meta["env"]:
        out.append("environment: " + " ".join(f"{k}={v}" for k, v in sorted(meta["env"].items())))
    if meta["skipped_optimizers"]:
        out.append(f"not in roundpipe.optim yet (skipped): {', '.join(meta['skipped_optimizers'])}")
    for wl, res in result["workloads"].items():
        out += ["", format_table(wl, res, backends, gbps)]
    failures = failures_of(result, backends)
    if failures:
        out += ["", "FAILURES (roundpipe errors or mismatches with torch; no speedup reported):"]
        out += [f"  {f}" for f in failures]
    return "\n".join(out)


def failures_of(result: dict, backends) -> list[str]:
    out = []
    for wl, res in result["workloads"].items():
        for row in res["rows"]:
            for b in backends:
                err = row.errors.get("rp " + b)
                if err:
                    out.append(f"{wl} {row.optimizer} {b}: {err}")
                elif row.checks.get(b):
                    out.append(f"{wl} {row.optimizer} {b}: {row.checks[b]}")
            for c in (LOOP, FOREACH):
                if c in row.errors:
                    out.append(f"{wl} {row.optimizer} {c}: {row.errors[c]}")
    return out


def to_json(result: dict, backends) -> dict:
    gbps = result["bandwidth"]["ceiling_GBps"]
    workloads = {}
    for wl, res in result["workloads"].items():
        rows = {}
        for row in res["rows"]:
            rows[row.optimizer] = {
                "options": OPTIONS[row.optimizer],
                "bytes_per_element": row.bytes_per_element,
                "numel": row.numel,
                "median_ms": row.median_ms,
                "min_ms": row.min_ms,
                "samples_ms": row.samples_ms,
                "errors": row.errors,
                "checks": {b: (m or "ok") for b, m in row.checks.items()},
                **derived(row, backends, gbps),
            }
        workloads[wl] = {**{k: v for k, v in res.items() if k != "rows"}, "optimizers": rows}
    return {"meta": result["meta"], "bandwidth": result["bandwidth"], "workloads": workloads}


def plot(result: dict, backends, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gbps = result["bandwidth"]["ceiling_GBps"]
    wls = list(result["workloads"].items())
    configs = list(TORCH_CONFIGS) + ["rp " + b for b in backends]
    fig, axes = plt.subplots(len(wls), 1, figsize=(13, 3.6 * len(wls)), squeeze=False)
    for ax, (wl, res) in zip(axes[:, 0], wls, strict=True):
        rows = res["rows"]
        x = np.arange(len(rows))
        width = 0.8 / len(configs)
        for k, c in enumerate(configs):
            ys = [row.median_ms.get(c, np.nan) for row in rows]
            ax.bar(x + (k - (len(configs) - 1) / 2) * width, ys, width, label=c)
        ax.scatter(x, [bound_ms(r, gbps) for r in rows], marker="_", s=400, c="k", label="bandwidth bound")
        ax.set_xticks(x, [r.optimizer for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"{wl}: {res['description']}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    meta = result["meta"]
    fig.suptitle(
        f"roundpipe.optim vs torch.optim on CPU (torch threads {meta['torch_threads']}, "
        f"numexpr threads {meta['numexpr_threads']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# command line


def _names(text: str, valid, what: str) -> list[str]:
    by_lower = {v.lower(): v for v in valid}
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item.lower() not in by_lower:
            raise argparse.ArgumentTypeError(f"unknown {what} {item!r}; valid: {', '.join(valid)}")
        out.append(by_lower[item.lower()])
    if not out:
        raise argparse.ArgumentTypeError(f"no {what} given")
    return out


def parse_args(argv=None):
    from .backends import NAMES as BACKENDS

    p = argparse.ArgumentParser(
        prog="python -m roundpipe.optim.bench",
        description="Time roundpipe.optim against torch.optim (for-loop, foreach, fused) on CPU.",
    )
    p.add_argument(
        "--quick", action="store_true", help="about a minute: fewer repetitions, smaller workloads"
    )
    p.add_argument(
        "--optimizers",
        type=lambda s: _names(s, ALL_OPTIMIZERS, "optimizer"),
        default=list(ALL_OPTIMIZERS),
        help="comma-separated, e.g. Adam,SGD (default: all)",
    )
    p.add_argument(
        "--workloads",
        type=lambda s: _names(s, WORKLOADS, "workload"),
        default=list(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)",
    )
    p.add_argument(
        "--backends",
        type=lambda s: _names(s, BACKENDS, "backend"),
        default=["fast"],
        help=f"roundpipe backends to time, comma-separated from {','.join(BACKENDS)} (default: fast)",
    )
    p.add_argument("--repeats", type=int, help="round-robin repetitions (default 7, --quick 3)")
    p.add_argument("--warmup", type=int, help="warm-up steps per configuration (default 2, --quick 1)")
    p.add_argument("--threads", type=int, help="set torch's and numexpr's thread counts")
    p.add_argument("--json", metavar="PATH", help="write all results (every sample) as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="draw a chart (needs matplotlib: the 'plot' extra)")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install -e '.[plot]'), or drop --plot"
        )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        numexpr.set_num_threads(args.threads)
    result = run(args)
    print(report(result, args.backends), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(result, args.backends), f, indent=1)
        log(f"wrote {args.json}")
    if args.plot:
        plot(result, args.backends, args.plot)
        log(f"wrote {args.plot}")
    return 1 if failures_of(result, args.backends) else 0


if __name__ == "__main__":
    sys.exit(main())
