"""Timing: the round-robin loop over configurations, the memory-bandwidth probe, ``--busy``
workers and the thread settings."""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numexpr
import torch

from .traffic import bytes_per_element
from .workloads import clone_params, make_optimizer


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# threads


def set_threads(n: int | None) -> None:
    """``--threads N``: torch's intra-op pool (which roundpipe follows) and numexpr's."""
    if n:
        torch.set_num_threads(n)
        numexpr.set_num_threads(n)


def thread_pools() -> list[str]:
    """The OpenMP and BLAS pools loaded in this process, as threadpoolctl reads them (torch's
    libgomp, numba's OpenMP layer, numpy's OpenBLAS): which ran and how wide, for the report."""
    from threadpoolctl import threadpool_info

    return [
        f"{i['internal_api']} {i['num_threads']} threads ({os.path.basename(i['filepath'])})"
        for i in threadpool_info()
    ]


# ---------------------------------------------------------------------------------------------
# the round-robin loop


@dataclass
class Row:
    optimizer: str
    bytes_per_element: int
    reads: tuple  # the tensors a step must read, and write (``traffic``)
    writes: tuple
    numel: int
    tensors: int = 0
    per_param: bool = False  # one optimizer per tensor: ``tensors`` step() calls per step
    median_ms: dict = field(default_factory=dict)  # config -> ms
    min_ms: dict = field(default_factory=dict)
    samples_ms: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # config -> message
    checks: dict = field(default_factory=dict)  # backend -> None or message
    norm_vs_torch: float | None = None  # --amp: the clip norm's relative difference from torch's


def timed_step(opt) -> float:
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def bench_one(
    name, configs, base_params, base_grads, warmup, repeats, wl, per_param=False, make=None, before=None
) -> Row:
    """Every configuration of optimizer ``name`` on fresh copies of the inputs: ``warmup`` steps
    each, then ``repeats`` round-robin rounds of one timed step each (the starting one rotates).
    ``make(config)``: what a configuration steps (anything with ``step()``); by default its
    optimizer (``make_optimizer``) over a copy of the inputs. ``before()``: run, untimed, right
    before every timed step (``--after-backward``: a forward and backward pass)."""
    if make is None:
        make = lambda config: make_optimizer(
            config, name, clone_params(base_params, base_grads), per_param=per_param
        )
    numel = sum(p.numel() for p in base_params)
    row = Row(name, *bytes_per_element(name), numel, tensors=len(base_params), per_param=per_param)
    live = {}
    for config in configs:
        try:
            opt = make(config)
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
                if before is not None:
                    before()
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


class ForwardBackward:
    """``--after-backward``: what a training loop runs before each step, a forward and backward
    pass on torch's threads (a 3-layer MLP, width 1024, batch 256; its own parameters, not the
    workload's), so each timed step starts where a training step's does: right after torch's
    parallel regions, with their threads just gone idle, and the caches full of activations."""

    def __init__(self, width: int = 1024, batch: int = 256):
        g = torch.Generator().manual_seed(7)
        self.weights = [
            torch.nn.Parameter(torch.randn(width, width, generator=g) / width**0.5) for _ in range(3)
        ]
        self.x = torch.randn(batch, width, generator=g)

    def __call__(self):
        h = self.x
        for w in self.weights:
            w.grad = None
            h = torch.relu(h @ w)
        h.square().mean().backward()


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
