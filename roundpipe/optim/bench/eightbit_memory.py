"""The peak memory a steady-state step adds, for the 8-bit rows (``eightbit``, which imports this
module): each column in a fresh subprocess (which makes its optimizer with ``eightbit_columns``),
so that one column's allocations (and its library's import) cannot hide or inflate another's.

The child builds the workload's tensors and the optimizer, takes ``WARMUP`` steps (state
created, torchao's step compiled), then for each of ``STEPS`` steps: resident memory before
(``VmRSS``), the high-water mark reset (``/proc/self/clear_refs``, Linux 4.0+), the step, the
high-water mark after (``VmHWM``). The largest growth over those steps is the column's peak.

Why not ``ru_maxrss``: it is the same high-water mark, but for the process's whole life and
never reset, so building the tensors and the warm-up steps (a first step allocates the state)
set it before the step worth measuring. Why not ``tracemalloc``: it sees Python's allocations
only, not torch's, numba's or bitsandbytes' C++ buffers. The child runs with glibc's mmap
threshold fixed (``MALLOC_MMAP_THRESHOLD_``; fixing it also turns off glibc's raising it after
each free): every block of 128 KiB or more is mapped for the allocation and unmapped when freed,
so a temporary cannot sit in the heap between steps, already resident, and escape the count.
The counters are in pages and may lag by a few hundred KiB per thread: on a workload of a
million elements that is a few tenths of a byte per parameter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

METHOD = (
    "the resident set's high-water mark during one steady-state step above the resident set "
    "before it, in a subprocess per column (the largest of 3 steps after 2 warm-up ones; "
    "/proc/self/clear_refs resets the mark, blocks of 128 KiB and up are unmapped when freed) / parameters"
)
WARMUP, STEPS = 2, 3
MMAP_THRESHOLD = 128 * 1024  # glibc's own default, fixed (see the module docstring)
_CHILD = "from roundpipe.optim.bench.eightbit_memory import child; child()"


def supported() -> str | None:
    """None where the high-water mark can be reset here, else why not."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux's /proc/self/clear_refs ({sys.platform})"
    if not os.access("/proc/self/clear_refs", os.W_OK):
        return "/proc/self/clear_refs is not writable here"
    return None


def measure(
    config: str, name: str, shapes, threads: int, timeout: float = 600
) -> tuple[int | None, str | None]:
    """``(peak bytes, None)``: the most a steady-state step of ``config`` (an ``eightbit`` column)
    raised the resident set over tensors of ``shapes``, at ``threads`` torch threads; or
    ``(None, why)``."""
    why = supported()
    if why:
        return None, why
    job = {"config": config, "optimizer": name, "shapes": [list(s) for s in shapes], "threads": threads}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, f"the measuring subprocess took over {timeout:.0f} s"
    if done.returncode != 0:
        return None, f"the measuring subprocess failed: {done.stderr.strip().splitlines()[-1:]}"
    res = json.loads(done.stdout.strip().splitlines()[-1])
    return max(res["extra_bytes"]), None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child() -> None:
    """The subprocess: reads its job (JSON) from stdin, prints ``{"extra_bytes": [...]}``."""
    import gc
    import warnings

    import torch

    from . import eightbit_columns
    from .workloads import Workload, clone_params, make_workload

    job = json.load(sys.stdin)
    torch.set_num_threads(job["threads"])
    warnings.simplefilter("ignore")
    wl = Workload("memory", "", tuple(tuple(s) for s in job["shapes"]))
    params = clone_params(*make_workload(wl))
    opt = eightbit_columns.make(job["config"], job["optimizer"], params)
    for _ in range(WARMUP):
        opt.step()
    extra = []
    for _ in range(STEPS):
        gc.collect()
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        opt.step()
        extra.append((_status_kib("VmHWM") - before) * 1024)
    print(json.dumps({"extra_bytes": extra}), flush=True)
