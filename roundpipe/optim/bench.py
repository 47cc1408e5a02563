"""Benchmark roundpipe.optim against torch.optim's CPU paths, side by side in one process.

    python -m roundpipe.optim.bench [--quick] [--optimizers Adam,SGD] [--workloads small,large]
                                    [--backends fast,native | all] [--busy N] [--repeats N]
                                    [--warmup N] [--threads N] [--json PATH] [--plot PATH.png]

For every optimizer and workload, the same parameters and gradients (seeded) are stepped by each
engine, one column each:

* ``for-loop``  ``torch.optim.<Name>(..., foreach=False)`` (torch's default for CPU tensors)
* ``foreach``   ``torch.optim.<Name>(..., foreach=True)``
* ``fused``     ``torch.optim.<Name>(..., fused=True)``, where torch has a CPU kernel
  (detected by trying; in torch 2.13: Adam, AdamW, SGD, Adagrad)
* ``<backend>`` ``roundpipe.optim.<Name>(..., backend=<backend>)`` for each ``--backends`` entry:
  ``fast`` (its default engine, or ``ROUNDPIPE_OPTIM_ENGINE``), ``fast:torch``, ``fast:numexpr``,
  ``native`` (needs numba), ``reference``. Default: ``fast`` and, where numba is installed,
  ``native``; ``--backends all`` times every engine (``fast:torch``, ``fast:numexpr``, ``native``,
  ``reference``).

Methodology (the machine may be shared and noisy):

* each configuration takes ``--warmup`` steps first (state creation, compilation caches);
* then the configurations step round-robin (the starting one rotates each round) for
  ``--repeats`` rounds; the reported time is the **median** step time of each, and every ratio
  is between two medians of the same run;
* the memory bandwidth is measured in the same run (in-place ``mul_`` and ``copy_`` on 256 MiB
  arrays, before and after the optimizers; the higher of the two medians is the ceiling);
* the bandwidth-bound time of a step is its minimal traffic divided by that bandwidth; "% bw" is
  that bound over the measured median (100% = at the memory limit). The minimal traffic is
  derived from the spec program a step runs (``traffic``): each tensor the program uses before
  it assigns it, read once, plus each tensor it assigns, written once, 4 bytes per fp32 element;
* after timing, each roundpipe backend is checked against torch's for-loop: two steps from
  identical fresh inputs, ``torch.testing.assert_close`` on parameters and state. A mismatch is
  reported in the table instead of a speedup and makes the exit status 1;
* configurations are built for one optimizer at a time and freed before the next;
* ``--busy N`` starts N processes that each keep a core busy (a pure-Python loop) before the
  first measurement and stops them after the last, to measure a machine that is doing other
  work too (data loading, the Python main thread, feeding a GPU): compare with a quiet run.

``--quick`` (a minute or two on 2 idle vCPUs with the default backends; ``all`` takes longer):
1 warm-up step and 3 repetitions instead of 2 and 7; ``large`` is 4 x 2M elements instead of
4 x 16M (still 128 MiB of Adam state, far above L3); ``transformer`` keeps d=512 but has a
8000-token embedding and 2 layers instead of 32000 and 8; ``small`` is unchanged; the bandwidth
probe uses 128 MiB arrays.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import numexpr
import numpy as np
import torch

from roundpipe import optim as rp_optim
from roundpipe.optim import backends as rp_backends
from roundpipe.optim.spec import SPECS
from roundpipe.optim.spec.ir import Assign, Tensor, walk

# the eleven optimizers, in the spec registry's order
ALL_OPTIMIZERS = tuple(SPECS)

# Representative settings: torch's defaults, except SGD with momentum (plain SGD is rare).
OPTIONS = {name: {} for name in ALL_OPTIMIZERS}
OPTIONS["SGD"] = {"momentum": 0.9}

WORKLOADS = ("large", "small", "transformer")
# every roundpipe engine (``--backends all``): fast with each of its engines, native, reference
ALL_BACKENDS = ("fast:torch", "fast:numexpr", "native", "reference")
ENV_PREFIXES = ("ROUNDPIPE_", "OMP_", "NUMEXPR_", "MKL_", "NUMBA_")  # environment worth reporting
TORCH_CONFIGS = ("torch for-loop", "torch foreach", "torch fused")
LOOP, FOREACH, FUSED = TORCH_CONFIGS
ELEMENT_BYTES = torch.float32.itemsize  # every workload is fp32
STEADY_STEP = 10  # the step whose program gives the traffic: past every optimizer's first steps


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def label(config: str) -> str:
    """A configuration's column name: ``for-loop``, ``foreach``, ``fused`` or the backend."""
    return config.removeprefix("torch ").removeprefix("rp ")


# ---------------------------------------------------------------------------------------------
# minimal traffic, from the spec


def steady_program(name: str):
    """The spec program a step of ``name`` runs with ``OPTIONS[name]`` once past its first steps.

    Its options come from the group (``spec.options``), its flags from ``init_state`` (a step
    that finds the state already there) and from ``scalars`` at step ``STEADY_STEP``, as the
    optimizer's own step computes them.
    """
    spec = SPECS[name]
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    group = spec.torch_class([p], **OPTIONS[name]).param_groups[0]
    state: dict = {}
    spec.init_state(group, p, state)  # the first step creates the state ...
    flags = dict(spec.init_state(group, p, state) or {})  # ... the later ones find it
    scalar_state = {k: state[k] for k in spec.scalar_state}
    for _ in range(STEADY_STEP):
        values = spec.scalars(group, scalar_state)
    flags.update((k, v) for k, v in values.items() if isinstance(v, bool))
    return spec.program({**spec.options(group), **flags})


def traffic(program) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(read, written)``: the tensors a one-pass step must load, and those it must store.

    A tensor is loaded if a statement uses it before any statement assigns it (after that its
    value is the one just computed); every target is stored.
    """
    read: list[str] = []
    assigned: set[str] = set()
    for st in program.statements:
        for node in walk(st.expr):
            name = node.name if isinstance(node, Tensor) else None
            if name in program.tensors and name not in assigned and name not in read:
                read.append(name)
        if isinstance(st, Assign):
            assigned.add(st.target)
    return tuple(read), tuple(program.targets)


def bytes_per_element(name: str) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
    """Minimal bytes a steady-state step of ``name`` moves per fp32 element, and what it reads
    and writes."""
    read, written = traffic(steady_program(name))
    return ELEMENT_BYTES * (len(read) + len(written)), read, written


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
            SPECS[name].torch_class([p], fused=True, **OPTIONS[name]).step()
    except Exception:
        return False
    return True


def make_optimizer(config: str, name: str, params):
    kwargs = OPTIONS[name]
    torch_class = SPECS[name].torch_class
    if config == LOOP:
        return torch_class(params, foreach=False, **kwargs)
    if config == FOREACH:
        return torch_class(params, foreach=True, **kwargs)
    if config == FUSED:
        return torch_class(params, fused=True, **kwargs)
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
        # the parameters, then each state entry: all tensors at once, then one by one to say where
        pairs = [("param", list(rp_params), list(ref_params))]
        for key, v in ref.state[ref_params[0]].items():
            if isinstance(v, torch.Tensor):
                pairs.append(
                    (
                        f"state {key!r}",
                        [rp.state[b].get(key) for b in rp_params],
                        [ref.state[a][key] for a in ref_params],
                    )
                )
        for what, got, expected in pairs:
            try:
                torch.testing.assert_close(_flat(got), _flat(expected))
            except (AssertionError, AttributeError, RuntimeError, TypeError):  # a mismatch, a missing entry
                for i, (w, v) in enumerate(zip(got, expected, strict=True)):
                    torch.testing.assert_close(w, v, msg=lambda m, i=i, what=what: f"{what} {i}: {m}")
                raise
    except Exception as e:  # an AssertionError, or the backend failing
        return f"{type(e).__name__}: {e}".strip()
    return None


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


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
# a busy machine

# Each --busy process: ignore Ctrl-C (the benchmark stops it), say it runs, spin until its parent
# is gone (a benchmark killed without cleaning up leaves nothing behind).
_SPIN = """\
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent = os.getppid()
sys.stdout.write("spinning\\n")
sys.stdout.flush()
while os.getppid() == parent:
    for _ in range(100000):
        pass
"""


@contextmanager
def busy(n: int):
    """``n`` processes that each keep a core busy (a pure-Python loop) until the block exits.

    They are new interpreters (``subprocess``, no fork of this process and its thread pools),
    running once this returns, and stopped when the block exits for any reason (an error,
    Ctrl-C); if this process dies without stopping them, they notice and exit by themselves.
    """
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _SPIN],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
            )
        for proc in procs:
            if proc.stdout.readline().strip() != b"spinning":
                raise RuntimeError(f"a --busy process did not start (exit status {proc.wait()})")
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
            proc.stdout.close()


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Row:
    optimizer: str
    bytes_per_element: int
    reads: tuple  # the tensors a step must read, and write (``traffic``)
    writes: tuple
    numel: int
    median_ms: dict = field(default_factory=dict)  # config -> ms
    min_ms: dict = field(default_factory=dict)
    samples_ms: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # config -> message
    checks: dict = field(default_factory=dict)  # backend -> None or message


def bench_one(name, configs, base_params, base_grads, warmup, repeats, wl) -> Row:
    numel = sum(p.numel() for p in base_params)
    row = Row(name, *bytes_per_element(name), numel)
    live = {}
    for config in configs:
        try:
            opt = make_optimizer(config, name, clone_params(base_params, base_grads))
            for _ in range(warmup):
                opt.step()
        except Exception as e:
            row.errors[config] = f"{type(e).__name__}: {e}"
            log(f"  [{wl}] {name} {config}: FAILED: {row.errors[config]}")
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


def machine_meta(args) -> dict:
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
        "roundpipe_threads": rp_optim.get_num_threads(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
    }
    if "native" in args.backends:
        import numba

        meta["numba"] = numba.__version__
        meta["numba_threads"] = numba.config.NUMBA_NUM_THREADS
    return meta


def thread_pools() -> list[str]:
    """The OpenMP and BLAS pools loaded in this process, as threadpoolctl reads them (torch's
    libgomp, numba's OpenMP layer, numpy's OpenBLAS): which ran and how wide, for the report."""
    from threadpoolctl import threadpool_info

    return [
        f"{i['internal_api']} {i['num_threads']} threads ({os.path.basename(i['filepath'])})"
        for i in threadpool_info()
    ]


def run(args, busy_pids=()) -> dict:
    quick = args.quick
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    repeats = args.repeats if args.repeats is not None else (3 if quick else 7)
    bw_numel = (32 if quick else 64) * 2**20
    bw_repeats = 5 if quick else 9

    fused = {n: has_fused(n) for n in args.optimizers}
    rp_configs = ["rp " + b for b in args.backends]
    meta = {
        **machine_meta(args),
        "busy": args.busy,
        "busy_pids": list(busy_pids),
        "load_average_before": args.load_before,
        "quick": quick,
        "warmup": warmup,
        "repeats": repeats,
        "backends": args.backends,
        "optimizers": args.optimizers,
        "options": {n: OPTIONS[n] for n in args.optimizers},
        "fused_available": fused,
        "argv": sys.argv[1:],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    log(
        f"threads: torch {meta['torch_threads']}, numexpr {meta['numexpr_threads']}, "
        f"roundpipe {meta['roundpipe_threads']}; warm-up {warmup}, repetitions {repeats}; "
        f"engines: for-loop, foreach, fused, {', '.join(args.backends)}; busy processes: {args.busy}"
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
        for name in args.optimizers:
            t0 = time.perf_counter()
            configs = [LOOP, FOREACH] + ([FUSED] if fused[name] else []) + rp_configs
            row = bench_one(name, configs, base_params, base_grads, warmup, repeats, wl)
            for b in args.backends:
                if "rp " + b in row.errors:
                    continue
                row.checks[b] = check(name, b, base_params, base_grads)
                if row.checks[b] is not None:
                    log(f"  [{wl}] {name} {b}: MISMATCH with torch: {row.checks[b]}")
            gc.collect()
            times = ", ".join(f"{label(c)} {ms:.2f}" for c, ms in row.median_ms.items())
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
    meta["thread_pools"] = thread_pools()
    return {"meta": meta, "bandwidth": bandwidth, "workloads": results}


# ---------------------------------------------------------------------------------------------
# reporting


def configs_of(backends) -> list[str]:
    """Every column: torch's three paths, then the roundpipe backends."""
    return list(TORCH_CONFIGS) + ["rp " + b for b in backends]


def bound_ms(row: Row, gbps: float) -> float:
    return row.bytes_per_element * row.numel / (gbps * 1e9) * 1e3


def derived(row: Row, backends, gbps: float) -> dict:
    """Per column: speedup over torch's for-loop and over torch fused, fraction of the bound."""
    out = {"bound_ms": bound_ms(row, gbps)}
    loop, fused = row.median_ms.get(LOOP), row.median_ms.get(FUSED)
    for config in configs_of(backends):
        ms = row.median_ms.get(config)
        if ms is None:
            continue
        d = {
            "median_ms": ms,
            "speedup_vs_for_loop": loop / ms if loop else None,
            "speedup_vs_fused": fused / ms if fused else None,
            "fraction_of_bandwidth_limit": out["bound_ms"] / ms,
        }
        if config.startswith("rp "):
            d["matches_torch"] = row.checks.get(label(config)) is None
        out[label(config)] = d
    return out


def fmt_ms(v):
    return "n/a" if v is None else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def _table(header, lines) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]

    def fmt(cells):
        pairs = zip(cells, widths, strict=True)
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(pairs))

    return [fmt(header), "-+-".join("-" * w for w in widths), *[fmt(c) for c in lines]]


def _ratio(row: Row, d: dict, config: str, key: str) -> str:
    if config in row.errors:
        return "ERROR"
    if config.startswith("rp ") and row.checks.get(label(config)):
        return "MISMATCH"
    v = d.get(label(config), {}).get(key)
    if v is None:
        return "n/a"
    return f"{100 * v:.0f}%" if key == "fraction_of_bandwidth_limit" else f"{v:.2f}x"


def format_tables(wl: str, res: dict, backends, gbps: float) -> str:
    """The workload's tables: median ms per step of every column, then ratios between medians."""
    configs = configs_of(backends)
    rp = [c for c in configs if c.startswith("rp ")]
    rows = res["rows"]
    ds = [derived(row, backends, gbps) for row in rows]
    times = [
        [row.optimizer, str(row.bytes_per_element), fmt_ms(d["bound_ms"])]
        + [fmt_ms(row.median_ms.get(c)) for c in configs]
        for row, d in zip(rows, ds, strict=True)
    ]
    out = [
        f"workload {wl}: {res['description']}; {res['tensors']} tensors, {res['numel']:,} elements",
        "median ms per step:",
        *_table(["optimizer", "B/elem", "bw-bound"] + [label(c) for c in configs], times),
    ]
    sections = [
        ("speedup over torch for-loop (for-loop median / median):", "speedup_vs_for_loop", configs[1:]),
        ("speedup over torch fused (fused median / median):", "speedup_vs_fused", rp),
        ("% of the bandwidth bound (bw-bound / median):", "fraction_of_bandwidth_limit", [FUSED, *rp]),
    ]
    for title, key, columns in sections:
        lines = [
            [row.optimizer] + [_ratio(row, d, c, key) for c in columns]
            for row, d in zip(rows, ds, strict=True)
            if key != "speedup_vs_fused" or FUSED in row.median_ms
        ]
        if lines:
            out += ["", title, *_table(["optimizer"] + [label(c) for c in columns], lines)]
    return "\n".join(out)


def report(result: dict, backends) -> str:
    meta, bw = result["meta"], result["bandwidth"]
    gbps = bw["ceiling_GBps"]
    versions = (
        f"torch {meta['torch']}, numexpr {meta['numexpr']} (vml {meta['numexpr_use_vml']}), "
        f"numpy {meta['numpy']}, python {meta['python']}"
    )
    if "numba" in meta:
        versions += f", numba {meta['numba']} (NUMBA_NUM_THREADS {meta['numba_threads']})"
    load = meta["load_average_before"]
    out = [
        f"roundpipe.optim benchmark ({'quick' if meta['quick'] else 'full'}): {versions}",
        f"threads: torch {meta['torch_threads']}, numexpr {meta['numexpr_threads']}, "
        f"roundpipe step {meta['roundpipe_threads']}, cpus {meta['cpu_count']}; "
        f"median of {meta['repeats']} round-robin repetitions "
        f"after {meta['warmup']} warm-up step(s)",
        (
            f"busy: {meta['busy']} other process(es) spinning a pure-Python loop during the whole run"
            if meta["busy"]
            else "busy: none (a quiet run: no --busy processes)"
        )
        + (f"; load average before the run {load[0]:.2f}" if load else ""),
        f"memory bandwidth (bytes read + written; in-place mul_ on {bw['mul_']['bytes'] // 2**21} MiB, "
        "copy_ between two such arrays): "
        f"mul_ {bw['mul_']['GBps']:.1f} GB/s, copy_ {bw['copy_']['GBps']:.1f} GB/s; "
        f"ceiling used: {gbps:.1f} GB/s",
        "B/elem: bytes a step must read and write per element (from its spec program); "
        "bw-bound: B/elem x elements / bandwidth ceiling, in ms",
    ]
    if meta.get("thread_pools"):
        out.append("thread pools after the run (threadpoolctl): " + "; ".join(meta["thread_pools"]))
    if meta["env"]:
        out.append("environment: " + " ".join(f"{k}={v}" for k, v in sorted(meta["env"].items())))
    for wl, res in result["workloads"].items():
        out += ["", format_tables(wl, res, backends, gbps)]
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
                "reads": row.reads,
                "writes": row.writes,
                "numel": row.numel,
                "median_ms": {label(c): v for c, v in row.median_ms.items()},
                "min_ms": {label(c): v for c, v in row.min_ms.items()},
                "samples_ms": {label(c): v for c, v in row.samples_ms.items()},
                "errors": {label(c): v for c, v in row.errors.items()},
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
    configs = configs_of(backends)
    fig, axes = plt.subplots(len(wls), 1, figsize=(13, 3.6 * len(wls)), squeeze=False)
    for ax, (wl, res) in zip(axes[:, 0], wls, strict=True):
        rows = res["rows"]
        x = np.arange(len(rows))
        width = 0.8 / len(configs)
        for k, c in enumerate(configs):
            ys = [row.median_ms.get(c, np.nan) for row in rows]
            ax.bar(x + (k - (len(configs) - 1) / 2) * width, ys, width, label=label(c))
        ax.scatter(x, [bound_ms(r, gbps) for r in rows], marker="_", s=400, c="k", label="bandwidth bound")
        ax.set_xticks(x, [r.optimizer for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"{wl}: {res['description']}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    meta = result["meta"]
    fig.suptitle(
        f"roundpipe.optim vs torch.optim on CPU (torch threads {meta['torch_threads']}, "
        f"numexpr threads {meta['numexpr_threads']}, busy processes {meta['busy']})"
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
        if by_lower[item.lower()] not in out:
            out.append(by_lower[item.lower()])
    if not out:
        raise argparse.ArgumentTypeError(f"no {what} given")
    return out


def _loads(backend: str) -> str | None:
    """None if roundpipe can run ``backend`` here, else why not (native without numba)."""
    try:
        rp_backends.resolve(backend)
    except ImportError as e:
        return str(e)
    return None


def _backends(text: str) -> list[str]:
    names = _names(text, (*rp_backends.NAMES, "all"), "backend")
    if "all" not in names:
        return names
    out = []
    for b in [*names[: names.index("all")], *ALL_BACKENDS, *names[names.index("all") + 1 :]]:
        if b not in out and b != "all":
            why = _loads(b) if b in ALL_BACKENDS else None
            if why:
                log(f"note: --backends all: skipping {b}: {why}")
            else:
                out.append(b)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m roundpipe.optim.bench",
        description="Time roundpipe.optim against torch.optim (for-loop, foreach, fused) on CPU.",
    )
    p.add_argument(
        "--quick", action="store_true", help="a minute or two: fewer repetitions, smaller workloads"
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
        type=_backends,
        help=f"roundpipe backends to time, comma-separated from {','.join(rp_backends.NAMES)}, or all "
        f"(= {','.join(ALL_BACKENDS)}); default: fast, and native where numba is installed",
    )
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="keep N other processes busy (a pure-Python loop each) during the whole run (default 0)",
    )
    p.add_argument("--repeats", type=int, help="round-robin repetitions (default 7, --quick 3)")
    p.add_argument("--warmup", type=int, help="warm-up steps per configuration (default 2, --quick 1)")
    p.add_argument("--threads", type=int, help="set torch's and numexpr's thread counts")
    p.add_argument("--json", metavar="PATH", help="write all results (every sample) as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="draw a chart (needs matplotlib: the 'plot' extra)")
    args = p.parse_args(argv)
    if args.backends is None:
        args.backends = ["fast"] + (["native"] if _loads("native") is None else [])
    for b in args.backends:
        why = _loads(b)
        if why:
            p.error(f"--backends {b}: {why}")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.busy < 0:
        p.error("--busy must be at least 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
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
    args.load_before = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    with busy(args.busy) as pids:
        result = run(args, pids)
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
