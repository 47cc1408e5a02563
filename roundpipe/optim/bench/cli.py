"""The command line (``python -m roundpipe.optim.bench``) and the run it drives."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
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

from . import eightbit, first_use, partners
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
    ALL_OPTIMIZERS,
    DEFAULT_OPTIMIZERS,
    FOREACH,
    FUSED,
    LOOP,
    OPTIONS,
    SUMMARY_WORKLOADS,
    WORKLOAD_NAMES,
    WORKLOADS,
    check,
    check_kind,
    fastest_torch,
    has_foreach,
    has_fused,
    in_summary,
    is_staged,
    label,
    make_workload,
    tensors_for,
    workload_parts,
)

# every roundpipe engine worth timing (``--backends all``): the default first
ALL_BACKENDS = (rp_backends.DEFAULT, "fast:torch", "fast:numexpr", "reference")
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
    if meta["partners"]:
        meta["one_thread_skipped"] = "--partners times its own table"
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
        "amp": bool(getattr(args, "amp", False)),
        "after_backward": bool(getattr(args, "after_backward", False)),
        "argv": sys.argv[1:],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _log_settings(args, meta) -> None:
    """One line of the threads, repetitions and engines a run times."""
    partners_dtype = meta["partners"]
    engines = f"{', '.join(args.backends)}, for-loop, foreach, fused"
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
        if partners_dtype:
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
        show = str if partners_dtype else label
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


# ---------------------------------------------------------------------------------------------
# command line


def parse_names(text: str, valid, what: str) -> list[str]:
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


def parse_backends(text: str) -> list[str]:
    """``--backends``: names from ``backends.NAMES`` or ``all`` (``ALL_BACKENDS``), in order,
    without repeats, the default (``fast``) moved first; a deprecated alias (``native``) is
    accepted as the name it stands for, with a note."""
    aliases = rp_backends.ALIASES
    items = []
    for item in text.split(","):
        item = item.strip()
        if item.lower() in aliases:
            log(f"note: --backends {item} is the old name of {aliases[item.lower()]}")
            item = aliases[item.lower()]
        items.append(item)
    names = parse_names(",".join(items), (*rp_backends.NAMES, "all"), "backend")
    out = []
    for b in names:
        for one in ALL_BACKENDS if b == "all" else (b,):
            if one not in out:
                out.append(one)
    return sorted(out, key=lambda b: b != rp_backends.DEFAULT)  # stable: the default first


def _option(text: str) -> tuple[str, str, object]:
    """``NAME.KEY=VALUE`` (``--option``) as ``(NAME, KEY, VALUE)``, VALUE a Python literal."""
    import ast

    target, sep, value = text.partition("=")
    name, dot, key = target.partition(".")
    if not (sep and dot and key):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME.KEY=VALUE")
    if name not in ALL_OPTIMIZERS:
        raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(ALL_OPTIMIZERS)}")
    import inspect

    known = [
        k for k in inspect.signature(getattr(rp_optim, name)).parameters if k not in ("params", "backend")
    ]
    if key not in known:
        raise argparse.ArgumentTypeError(f"{name} has no hyperparameter {key!r}; it has {', '.join(known)}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{value!r} in {text!r} is not a Python literal") from None
    return name, key, parsed


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


def parse_args(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    if args.workloads is None:
        args.workloads = list(partners.WORKLOADS if args.partners else WORKLOADS)
    if args.optimizers is None:  # --partners: the elementwise optimizers
        args.optimizers = [n for n in DEFAULT_OPTIMIZERS if not (args.partners and is_staged(n))]
    _check_args(p, args)
    return args


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m roundpipe.optim.bench",
        description="Time roundpipe.optim against torch.optim (for-loop, foreach, fused) on CPU; "
        "or, with --first-use, what its first import and step cost.",
    )
    p.add_argument("--quick", action="store_true", help="a few minutes: fewer repetitions, smaller workloads")
    p.add_argument(
        "--optimizers",
        type=lambda s: parse_names(s, (*ALL_OPTIMIZERS, *EIGHTBIT_OPTIMIZERS), "optimizer"),
        default=None,
        help=f"comma-separated from {','.join(ALL_OPTIMIZERS + EIGHTBIT_OPTIMIZERS)}, e.g. Adam,SGD "
        "(default: all but Muon, whose step is mostly torch's bfloat16 Newton-Schulz matmuls, and "
        "the 8-bit ones; with --partners: the elementwise ones, all but Adafactor and Muon); "
        "AdamW8bit: roundpipe's against torch's fused fp32 AdamW, bitsandbytes' and torchao's "
        "AdamW8bit (where installed), with state and peak memory per parameter",
    )
    p.add_argument(
        "--workloads",
        type=lambda s: parse_names(s, WORKLOAD_NAMES, "workload"),
        default=None,
        help=f"comma-separated subset of {','.join(WORKLOAD_NAMES)} (default: {','.join(WORKLOADS)}; "
        f"per_param = per_param_small,per_param_large; with --partners: {','.join(partners.WORKLOADS)})",
    )
    p.add_argument(
        "--backends",
        type=parse_backends,
        default=[rp_backends.DEFAULT],
        help=f"roundpipe backends to time, comma-separated from {','.join(rp_backends.NAMES)}, or all "
        f"(= {','.join(ALL_BACKENDS)}); default: {rp_backends.DEFAULT}",
    )
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="keep N other processes busy (a pure-Python loop each) during the whole run (default 0)",
    )
    p.add_argument(
        "--after-backward",
        action="store_true",
        help="run a forward and backward pass (torch, untimed) right before every timed step, as "
        "in a training loop (default: steps back to back)",
    )
    p.add_argument("--repeats", type=int, help="round-robin repetitions (default 7, --quick 3)")
    p.add_argument("--warmup", type=int, help="warm-up steps per configuration (default 2, --quick 1)")
    p.add_argument(
        "--threads",
        type=int,
        help="set torch's and numexpr's thread counts (the whole run at that count: no one-thread pass)",
    )
    p.add_argument(
        "--no-one-thread",
        action="store_true",
        help="skip the one-thread pass: by default, after the run, roundpipe's default backend and "
        "torch's fastest path are timed again with every thread pool at one thread (as each rank "
        f"of a torchrun launch, which sets OMP_NUM_THREADS=1), on {' and '.join(SUMMARY_WORKLOADS)}, "
        "for the summary's one-thread column; skipped anyway with --threads or on one thread",
    )
    p.add_argument("--json", metavar="PATH", help="write all results (every sample) as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="draw a chart (needs matplotlib: the 'plot' extra)")
    p.add_argument(
        "--first-use",
        action="store_true",
        help="instead: time import roundpipe.optim, and the first step of the demo's model with an "
        "empty (cold) and a filled (warm) kernel cache, each in fresh subprocesses",
    )
    p.add_argument(
        "--partners",
        nargs="?",
        const="bfloat16",
        choices=tuple(partners.DTYPES),
        help="instead: fp32 masters paired with bfloat16 (the default) or float16 partners; time the "
        "default backend's fused step against the composition (widen the grads, step, round back), "
        "and torch's composition, after checking fused equals the composition bit for bit",
    )
    p.add_argument(
        "--amp",
        action="store_true",
        help="with --partners: the whole optimizer phase of mixed-precision training, loss scaling "
        "(float16) and clipping, folded into the fused step against the composition",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        type=_option,
        metavar="NAME.KEY=VALUE",
        help="an optimizer's hyperparameter for this run, over the bench's (e.g. SGD.momentum=0: plain "
        "SGD; the bench's SGD has momentum 0.9); repeatable",
    )
    p.add_argument(
        "--model",
        choices=("default", "small"),
        default="default",
        help="--first-use: the demo's model to step (default: default; small: tiny, for tests)",
    )
    return p


def _check_args(p, args):
    """What argparse cannot check alone: combinations and ranges (``p.error`` exits)."""
    eight = [n for n in args.optimizers if n in EIGHTBIT_OPTIMIZERS]
    if eight and (args.partners or args.first_use or args.plot):
        p.error(f"{', '.join(eight)}: timed in the normal mode, without --partners, --first-use or --plot")
    if args.partners:
        if args.first_use:
            p.error("--partners and --first-use are two different runs: give one")
        others = [w for w in args.workloads if w not in partners.WORKLOADS]
        if others:
            p.error(f"--partners times {', '.join(partners.WORKLOADS)}, not {', '.join(others)}")
        if args.backends != [rp_backends.DEFAULT]:
            p.error(f"--partners times the default backend ({rp_backends.DEFAULT}): drop --backends")
        if args.plot:
            p.error("--plot draws the normal mode's times; --partners has its own table")
        staged = [n for n in args.optimizers if is_staged(n)]
        if staged:
            p.error(f"--partners times the elementwise optimizers, not {', '.join(staged)}")
    elif args.amp:
        p.error("--amp times the optimizer phase around paired masters: give --partners too")
    for b in args.backends:
        try:
            rp_backends.resolve(b)
        except ImportError as e:  # fast:numba where numba cannot be imported
            p.error(f"--backends {b}: {e}")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.busy < 0:
        p.error("--busy must be at least 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if args.plot and args.first_use:
        p.error("--plot draws the workloads' times; --first-use has none")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install -e '.[plot]'), or drop --plot"
        )


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
