"""Timing: the round-robin loop over configurations, the memory-bandwidth probe, ``--busy``
workers and the thread settings."""

from __future__ import annotations

import contextlib
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

import roundpipe.optim.threads as rp_threads

from .traffic import workload_bytes
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


@contextmanager
def one_thread():
    """Inside the block, every pool a step or torch's paths run on at one thread, as each rank
    of a ``torchrun`` launch (which sets ``OMP_NUM_THREADS=1``): torch's intra-op pool,
    numexpr's, and roundpipe's step (``set_num_threads(1)``, over ``ROUNDPIPE_OPTIM_NUM_THREADS``
    too); yields the counts each then reports, and restores all three on exit."""
    torch_before, rp_before = torch.get_num_threads(), rp_threads.num_threads_setting()
    torch.set_num_threads(1)
    numexpr_before = numexpr.set_num_threads(1)  # returns the previous count
    rp_threads.set_num_threads(1)
    try:
        yield {
            "torch": torch.get_num_threads(),
            "numexpr": numexpr.get_num_threads(),
            "roundpipe": rp_threads.get_num_threads(),
        }
    finally:
        rp_threads.set_num_threads(rp_before)
        numexpr.set_num_threads(numexpr_before)
        torch.set_num_threads(torch_before)


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
    bytes_per_element: float  # an int for an elementwise optimizer; a staged one: a weighted mean
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
    state_bytes_per_element: float | None = None  # optimizer state bytes / parameter elements
    callout_ms: dict = field(default_factory=dict)  # config -> median ms inside torch's call-out
    callout_samples_ms: dict = field(default_factory=dict)
    rest_ms: dict = field(default_factory=dict)  # config -> median ms of the step outside it


def state_bytes(state) -> int:
    """The bytes of every tensor in an optimizer's ``state`` (0-d ``step`` tensors included)."""
    return sum(
        v.numel() * v.element_size()
        for per_param in state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


# torch's call-outs a step makes whose time the bench reports apart from the rest: Muon's
# Newton-Schulz orthogonalisation (its bfloat16 matmuls), the same function in torch's for-loop
# and in roundpipe's step (``spec/muon.py`` calls it through the module, as torch does)
CALLOUTS = {"Muon": ("torch.optim._muon", "_zeropower_via_newtonschulz")}


class CallTimer:
    """While entered, ``module.attr`` is wrapped to add its wall time to ``elapsed``."""

    def __init__(self, module: str, attr: str):
        import importlib

        self.module, self.attr, self.elapsed = importlib.import_module(module), attr, 0.0

    def __enter__(self):
        self.real = real = getattr(self.module, self.attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.elapsed += time.perf_counter() - t0

        setattr(self.module, self.attr, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.attr, self.real)


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
    nbytes = workload_bytes(name, [tuple(p.shape) for p in base_params])
    row = Row(name, *nbytes, numel, tensors=len(base_params), per_param=per_param)
    callout = CallTimer(*CALLOUTS[name]) if name in CALLOUTS else contextlib.nullcontext()
    with callout:
        round_robin(row, name, configs, make, warmup, repeats, wl, before, callout)
    return row


def round_robin(row, name, configs, make, warmup, repeats, wl, before, callout):
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
    inside = {c: [] for c in order}  # seconds in the call-out during each timed step
    timer = callout if isinstance(callout, CallTimer) else None
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for k in range(len(order)):
                config = order[(r + k) % len(order)]
                if before is not None:
                    before()
                if timer is not None:
                    timer.elapsed = 0.0
                samples[config].append(timed_step(live[config]))
                if timer is not None:
                    inside[config].append(timer.elapsed)
    finally:
        gc.enable()
    if order:  # the state a step leaves, in the first configuration (roundpipe's, if it ran)
        row.state_bytes_per_element = state_bytes(live[order[0]].state) / max(row.numel, 1)
    live.clear()
    gc.collect()
    for config, ts in samples.items():
        row.samples_ms[config] = [t * 1e3 for t in ts]
        row.median_ms[config] = statistics.median(ts) * 1e3
        row.min_ms[config] = min(ts) * 1e3
        if timer is not None:
            row.callout_samples_ms[config] = [t * 1e3 for t in inside[config]]
            row.callout_ms[config] = statistics.median(inside[config]) * 1e3
            rest = [a - b for a, b in zip(ts, inside[config], strict=True)]
            row.rest_ms[config] = statistics.median(rest) * 1e3


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
