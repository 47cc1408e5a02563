"""The command line (``python -m roundpipe.optim.bench``) and the run it drives."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import sys
import time

import numexpr
import numpy as np
import torch

import roundpipe.optim.threads as rp_threads
from roundpipe import optim as rp_optim
from roundpipe.optim import backends as rp_backends

from . import eightbit, first_use, partners, stored
from .arguments import ALL_BACKENDS, parse_args  # noqa: F401 (the command line's, re-exported)
from .eightbit_columns import OPTIMIZERS as EIGHTBIT_OPTIMIZERS
from .engine import FallbackWatch, fast_engine
from .report import failures_of, plot, report, to_json
from .timing import (
    ForwardBackward,
    bench_one,
    busy,
    log,
    measure_bandwidth,
    one_thread,
    set_threads,
    summarize_bandwidth,
    thread_pools,
)
from .workloads import (
    FOREACH,
    FUSED,
    LOOP,
    OPTIONS,
    SUMMARY_WORKLOADS,
    check,
    check_kind,
    fastest_torch,
    has_foreach,
    has_fused,
    in_summary,
    label,
    make_workload,
    tensors_for,
    workload_parts,
)

ENV_PREFIXES = ("ROUNDPIPE_", "OMP_", "NUMEXPR_", "MKL_", "NUMBA_")  # environment worth reporting


# ---------------------------------------------------------------------------------------------
# the run


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
    try:
        import numba
    except ImportError:  # fast then runs its torch engine; the header says so
        pass
    else:
        meta["numba"] = numba.__version__
        meta["numba_threads"] = numba.config.NUMBA_NUM_THREADS
    return meta


def run(args, busy_pids=()) -> dict:
    """Time every optimizer of ``args`` on its workloads; the results as ``report`` reads them."""
    warmup, repeats = _repetitions(args)
    bw_numel = (32 if args.quick else 64) * 2**20
    bw_repeats = 5 if args.quick else 9
    fused = {n: has_fused(n) for n in args.optimizers}
    meta = _run_meta(args, busy_pids, warmup, repeats, fused)
    _log_settings(args, meta)
    parts = [w for name in args.workloads for w in workload_parts(name, args.quick)]
    parts = [w for k, w in enumerate(parts) if w.name not in {v.name for v in parts[:k]}]
    if meta["partners"] or meta["stored"]:
        meta["one_thread_skipped"] = "--partners, --dtype and --state-dtype time their own tables"
    else:
        meta["one_thread_skipped"] = one_thread_skipped(args, parts)
        if meta["one_thread_skipped"]:
            log(f"one-thread pass: skipped ({meta['one_thread_skipped']})")
    log("measuring memory bandwidth ...")
    bw_samples = measure_bandwidth(bw_numel, bw_repeats)

    before = ForwardBackward() if meta["after_backward"] else None
    t_start = time.perf_counter()
    results = {}
    one = None
    with FallbackWatch() as watch:
        for wl in parts:
            results[wl.name] = _bench_workload(args, meta, wl, fused, before)
        if not meta["one_thread_skipped"]:
            one = one_thread_pass(args.optimizers, fused, parts, warmup, repeats, before)
    meta["fast_engine"] = fast_engine(watch.messages)
    meta["check_kind"] = {b: check_kind(b) for b in args.backends}  # "bit for bit" or "close"

    more = measure_bandwidth(bw_numel, bw_repeats)
    for op in bw_samples:
        bw_samples[op] += more[op]
    bandwidth = summarize_bandwidth(bw_samples, bw_numel)
    meta["elapsed_s"] = time.perf_counter() - t_start
    meta["thread_pools"] = thread_pools()
    meta["threading"] = rp_threads.threading_report()["summary"]
    out = {"meta": meta, "bandwidth": bandwidth, "workloads": results}
    if one is not None:
        out["one_thread"] = one
    return out


def _repetitions(args) -> tuple[int, int]:
    """``(warm-up steps, timed repetitions)``: the command line's, else the defaults for
    ``--quick`` or a full run."""
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    return warmup, repeats


def _run_meta(args, busy_pids, warmup, repeats, fused) -> dict:
    """What the report's header says about the run: the machine, the load and the settings."""
    return {
        **machine_meta(args),
        "busy": args.busy,
        "busy_pids": list(busy_pids),
        "load_average_before": args.load_before,
        "quick": args.quick,
        "warmup": warmup,
        "repeats": repeats,
        "backends": args.backends,
        "optimizers": args.optimizers,
        "options": {n: dict(OPTIONS[n]) for n in args.optimizers},
        "fused_available": fused,
        "partners": getattr(args, "partners", None),  # --partners: fused against composition
        "stored": _stored_mode(args),  # --dtype, --state-dtype: (mode, dtype name) or None
        "amp": bool(getattr(args, "amp", False)),
        "after_backward": bool(getattr(args, "after_backward", False)),
        "argv": sys.argv[1:],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _stored_mode(args):
    """``("dtype" | "state_dtype", dtype name)`` of ``--dtype`` or ``--state-dtype`` (stored.py)."""
    if getattr(args, "fused", None):
        return ("fused", args.fused)
    if getattr(args, "dtype", None):
        return ("dtype", args.dtype)
    if getattr(args, "state_dtype", None):
        return ("state_dtype", args.state_dtype)
    return None


def _log_settings(args, meta) -> None:
    """One line of the threads, repetitions and engines a run times."""
    partners_dtype = meta["partners"]
    engines = f"{', '.join(args.backends)}, for-loop, foreach, fused"
    if meta["stored"]:
        engines = f"--{meta['stored'][0].replace('_', '-')} {meta['stored'][1]}"
    if partners_dtype:
        engines = f"{partners_dtype} partners: {', '.join(partners.CONFIGS)}"
        if meta["amp"]:
            engines += ", " + ("loss scaling and clipping" if partners_dtype == "float16" else "clipping")
    log(
        f"threads: torch {meta['torch_threads']}, numexpr {meta['numexpr_threads']}, "
        f"roundpipe {meta['roundpipe_threads']}; warm-up {meta['warmup']}, repetitions {meta['repeats']}; "
        f"engines: {engines}; busy processes: {args.busy}"
    )


def _bench_workload(args, meta, wl, fused, before) -> dict:
    """Every optimizer of ``args`` timed on workload ``wl``: its entry of the results."""
    partners_dtype, warmup, repeats = meta["partners"], meta["warmup"], meta["repeats"]
    base_params, base_grads = make_workload(wl)
    numel = sum(p.numel() for p in base_params)
    log(f"[{wl.name}] {wl.description}: {len(base_params)} tensors, {numel:,} elements")
    rows, notes = [], {}
    for name in args.optimizers:
        t0 = time.perf_counter()
        keep, why = tensors_for(name, [tuple(p.shape) for p in base_params])
        if why is not None:
            kept = sum(base_params[i].numel() for i in keep)
            notes[name] = f"{why}: {len(keep)} of {len(base_params)} tensors, {kept:,} elements"
            log(f"  [{wl.name}] {name}: {notes[name]}")
        if not keep:
            continue
        if meta["stored"]:
            mode, dtype_name = meta["stored"]
            row = stored.bench_row(
                mode, name, dtype_name, fused[name], base_params, base_grads, warmup, repeats, wl.name, before
            )
        elif partners_dtype:
            row = partners.bench_row(
                name,
                partners_dtype,
                fused[name],
                base_params,
                base_grads,
                warmup,
                repeats,
                wl.name,
                amp=meta["amp"],
                before=before,
            )
        else:
            row = bench_row(
                args.backends,
                name,
                fused[name],
                wl,
                [base_params[i] for i in keep],
                [base_grads[i] for i in keep],
                warmup,
                repeats,
                before,
            )
        gc.collect()
        show = str if partners_dtype or meta["stored"] else label
        times = ", ".join(f"{show(c)} {ms:.2f}" for c, ms in row.median_ms.items())
        log(f"  [{wl.name}] {name}: {times} ms  ({time.perf_counter() - t0:.1f}s)")
        rows.append(row)
    entry = {
        "description": wl.description,
        "tensors": len(base_params),
        "numel": numel,
        "per_param": wl.per_param,
        "rows": rows,
        "notes": notes,
    }
    del base_params, base_grads
    gc.collect()
    return entry


def one_thread_skipped(args, parts) -> str | None:
    """Why a normal run takes no one-thread pass (``one_thread_pass``), or None if it takes one."""
    if getattr(args, "no_one_thread", False):
        return "--no-one-thread"
    if args.threads:
        return f"--threads {args.threads}: the whole run is at that count"
    if min(os.cpu_count() or 1, torch.get_num_threads()) == 1:
        return "the run is at one thread already"
    if not any(w.name in SUMMARY_WORKLOADS for w in parts):
        return f"no {' or '.join(SUMMARY_WORKLOADS)} workload in the run"
    if not any(in_summary(n) for n in args.optimizers):
        return "no optimizer of the summary in the run"
    return None


def one_thread_pass(optimizers, fused, parts, warmup, repeats, before=None) -> dict:
    """The summary's one-thread column: with every pool at one thread (``timing.one_thread``), as
    on each rank of a ``torchrun`` launch, roundpipe's default backend and torch's fastest paths
    (``fastest_torch``) timed by ``bench_one`` as in the run, on its ``SUMMARY_WORKLOADS``, for
    each optimizer ``in_summary``; no checks (the run's own did them). Its workloads' tensors
    are made again (seeded: the same values)."""
    out: dict = {"workloads": {}}
    with one_thread() as threads:
        out["threads"] = threads
        log(
            f"one-thread pass: threads: torch {threads['torch']}, numexpr {threads['numexpr']}, "
            f"roundpipe {threads['roundpipe']}"
        )
        for wl in parts:
            if wl.name not in SUMMARY_WORKLOADS:
                continue
            base_params, base_grads = make_workload(wl)
            rows = []
            for name in optimizers:
                if not in_summary(name):
                    continue
                keep, _ = tensors_for(name, [tuple(p.shape) for p in base_params])
                if not keep:
                    continue
                t0 = time.perf_counter()
                configs = ["rp " + rp_backends.DEFAULT, *fastest_torch(name, fused[name])]
                row = bench_one(
                    name,
                    configs,
                    [base_params[i] for i in keep],
                    [base_grads[i] for i in keep],
                    warmup,
                    repeats,
                    wl.name,
                    before=before,
                )
                times = ", ".join(f"{label(c)} {ms:.2f}" for c, ms in row.median_ms.items())
                log(f"  [{wl.name}, 1 thread] {name}: {times} ms  ({time.perf_counter() - t0:.1f}s)")
                rows.append(row)
            out["workloads"][wl.name] = {"rows": rows}
            del base_params, base_grads
            gc.collect()
    return out


def bench_row(backends, name, fused, wl, base_params, base_grads, warmup, repeats, before=None):
    """The normal mode's row: roundpipe's backends and torch's paths timed (``bench_one``), then
    each backend checked against torch's for-loop (``row.checks``)."""
    torch_configs = [LOOP] if wl.per_param or not has_foreach(name) else [LOOP, FOREACH]
    configs = ["rp " + b for b in backends] + torch_configs + ([FUSED] if fused else [])
    row = bench_one(
        name, configs, base_params, base_grads, warmup, repeats, wl.name, wl.per_param, before=before
    )
    for b in backends:
        if "rp " + b in row.errors:
            continue
        row.checks[b] = check(name, b, base_params, base_grads, per_param=wl.per_param)
        if row.checks[b] is not None:
            log(f"  [{wl.name}] {name} {b}: MISMATCH with torch: {row.checks[b]}")
    return row


@contextlib.contextmanager
def _options(overrides):
    """``OPTIONS`` with ``--option``'s overrides for the run (the module dict every part reads),
    then as it was."""
    saved = {name: dict(OPTIONS[name]) for name, _, _ in overrides}
    try:
        for name, key, value in overrides:
            OPTIONS[name][key] = value
        yield
    finally:
        for name, opts in saved.items():
            OPTIONS[name].clear()
            OPTIONS[name].update(opts)


def main_first_use(args) -> int:
    meta = {**machine_meta(args), "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    res = first_use.measure(args.model, log=log)
    print(first_use.format_report(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "first_use": res}, f, indent=1)
        log(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    if args.first_use:
        return main_first_use(args)
    args.load_before = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    eight = [n for n in args.optimizers if n in EIGHTBIT_OPTIMIZERS]  # timed apart: eightbit.py
    args.optimizers = [n for n in args.optimizers if n not in eight]
    text, doc, failures = "", {}, []
    with _options(args.option):  # the report derives bytes per element from them too
        with busy(args.busy) as pids:
            result = run(args, pids) if args.optimizers else None
            before = ForwardBackward() if eight and args.after_backward else None
            extra = eightbit.run(args, eight, machine_meta(args), before) if eight else None
        if result is None:
            pass
        elif args.partners:
            text, doc = partners.report(result), partners.to_json(result)
            failures = partners.failures_of(result)
        elif args.dtype or args.state_dtype or args.fused:
            text, doc, failures = stored.report(result), stored.to_json(result), stored.failures_of(result)
        else:
            text, doc = report(result, args.backends), to_json(result, args.backends)
            failures = failures_of(result, args.backends)
    if extra is not None:
        text = "\n\n".join(t for t in (text, eightbit.report(extra, args.backends)) if t)
        doc["eightbit"], failures = eightbit.to_json(extra), failures + eightbit.failures_of(extra)
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"wrote {args.json}")
    if args.plot:
        plot(result, args.backends, args.plot)
        log(f"wrote {args.plot}")
    return 1 if failures else 0
