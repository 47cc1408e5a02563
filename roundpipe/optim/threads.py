"""The optimizer's thread count: one knob for every engine that runs during a step.

``roundpipe.optim.set_num_threads(n)`` (or ``ROUNDPIPE_OPTIM_NUM_THREADS``) sets how many
threads a step uses; by default it follows ``torch.get_num_threads()``. The numba engine
sets numba's pool to it, the numexpr engine numexpr's, and the torch engine runs its chunks on
``run_parallel``'s pool of Python threads while torch's own intra-op pool is held at one thread
(``torch_threads``: ``torch.set_num_threads``, then restored), so no two pools ever run more
threads than asked for. threadpoolctl reads and limits every OpenMP and BLAS pool in the
process; the bench uses it to report them. A step does not: a ``threadpool_limits`` block
rescans the loaded libraries, and even a kept controller costs many times the
``torch.set_num_threads`` pair (docs/benchmarks.md), which also sets the one OpenMP pool a step
would run (torch's libgomp). In a child process created by ``fork`` the count is 1 (GNU OpenMP
hangs in a forked child's parallel regions).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

ENV_VAR = "ROUNDPIPE_OPTIM_NUM_THREADS"
# process-wide (the user's setting): one int, replaced whole, read once per step
_num_threads: int | None = None

# os.environ's own dict and key encoding: a step reads its settings every time, and
# ``os.environ.get`` encodes the key and decodes the value anew on each read (docs/benchmarks.md)
_environ_data = getattr(os.environ, "_data", None)
_env_keys: dict = {}


def getenv(name: str) -> str | None:
    """``os.environ.get(name)``, cheaper (the settings a step reads are read every step, so
    that a change between steps takes effect at the next one)."""
    if _environ_data is None:
        return os.environ.get(name)
    key = _env_keys.get(name)
    if key is None:
        key = _env_keys[name] = os.environ.encodekey(name)
    raw = _environ_data.get(key)
    return None if raw is None else os.environ.decodevalue(raw)


def set_num_threads(n: int | None) -> None:
    """Use ``n`` threads in optimizer steps; ``None`` goes back to the default."""
    global _num_threads
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"number of threads must be a positive int or None, got {n!r}")
    _num_threads = n


def num_threads_setting() -> int | None:
    """What ``set_num_threads`` set (None: the default), to restore it later."""
    return _num_threads


def get_num_threads() -> int:
    """Threads an optimizer step uses: set_num_threads(), else the environment, else torch's."""
    if _num_threads is not None:
        return _num_threads
    env = getenv(ENV_VAR)
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{ENV_VAR}={env!r} is not a positive integer")
        return n
    return torch.get_num_threads()


def _after_fork_in_child():
    # GNU OpenMP cannot run a parallel region in a forked child of a process that ran one (the
    # child hangs); DataLoader workers and multiprocessing with fork step on one thread. The
    # pool's threads did not survive the fork either.
    global _num_threads, _pool
    _num_threads = 1
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def torch_threads(n: int):
    """Run torch's intra-op pool with ``n`` threads inside the block."""
    current = torch.get_num_threads()
    if current == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(current)


# Shared process-wide: the pool. It is replaced (under ``_pool_lock``) only by a wider one and
# never shut down: a thread that took the old one a moment earlier may still be submitting to
# it (shutting it down would make that submit raise). A replaced pool's idle threads exit once
# nothing refers to it any more (ThreadPoolExecutor's own weakref cleanup).
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="roundpipe-optim")
        return _pool


def run_parallel(work, fn, n: int) -> None:
    """Call ``fn(item)`` for every item of ``work`` on ``n`` threads, the caller one of them.

    One parallel region: each thread takes the next item when it is done with one (so a thread
    the OS has descheduled on a busy machine holds up only the item it has), and the call
    returns when all are done. The first exception raised by ``fn`` is re-raised.
    """
    n = min(n, len(work))
    if n <= 1:
        for item in work:
            fn(item)
        return
    items = iter(work)  # a list iterator: next() is atomic under the GIL

    def worker():
        for item in items:
            fn(item)

    pool = _get_pool(n - 1)  # this call's pool: a wider one may replace it meanwhile
    futures = [pool.submit(worker) for _ in range(n - 1)]
    error = None
    try:
        worker()
    except BaseException as e:  # let the others finish before raising
        error = e
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


# ---------------------------------------------------------------------------------------------
# Which OpenMP runtime runs the compiled engine's parallel regions (docs/numba-engine.md, "One pool")
#
# numba's OpenMP layer (``numba/np/ufunc/omppool``) names ``libgomp.so.1.0.0`` as its dependency;
# torch's wheel has already loaded its own libgomp (soname ``libgomp.so.1``), which the loader
# does not take for that name, so the system's libgomp gets mapped too. It does not run: torch
# loads its libgomp into the global scope (``libtorch_global_deps``, RTLD_GLOBAL), which the
# loader searches before a library's own dependencies, so omppool's ``GOMP_parallel``,
# ``omp_get_thread_num`` and the rest bind to torch's (LD_DEBUG=bindings: what bound where, in
# docs/numba-engine.md) and one pool of threads serves torch and the kernels. The
# second runtime is mapped, initialized (its constructor reads the environment) and, to
# threadpoolctl, a second "openmp" pool of its own that never starts a thread. These helpers
# say which is which, for the bench header and the engine's debug log.

_OPENMP_PREFIXES = ("libgomp", "libiomp", "libomp")


def openmp_runtimes() -> list:
    """The OpenMP runtime libraries mapped into this process (real paths, sorted; Linux's
    ``/proc/self/maps``; an empty list where it cannot be read)."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                name = os.path.basename(path)
                if path.startswith("/") and name.startswith(_OPENMP_PREFIXES) and ".so" in name:
                    found.add(os.path.realpath(path))
    except OSError:
        return []
    return sorted(found)


def _defining_file(symbol: str) -> str | None:
    """The file whose definition of ``symbol`` a library loaded now would bind to first (the
    global scope's: ``dlsym(RTLD_DEFAULT)``), or None."""
    import ctypes

    class _DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    try:
        libc = ctypes.CDLL(None)
        address = ctypes.cast(getattr(libc, symbol), ctypes.c_void_p).value
        dladdr = libc.dladdr
    except (AttributeError, OSError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not address or not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode(errors="replace"))


def threading_report() -> dict:
    """What runs a parallel step of the compiled engine, for the bench header and debug logs:
    ``layer`` (numba's threading layer once its pool has started, else None), ``openmp`` (the
    OpenMP runtimes mapped), ``gomp_parallel`` (the runtime whose ``GOMP_parallel`` numba's
    OpenMP layer calls: the global scope's, torch's when torch is imported first), and
    ``summary``, one line saying it. Reads state only: starts no pool, imports numba only if
    it is imported already."""
    import sys

    numba = sys.modules.get("numba")
    layer = None
    if numba is not None:
        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel launch yet
            layer = None
    runtimes = openmp_runtimes()
    gomp = _defining_file("GOMP_parallel")
    if layer is None:
        summary = "numba's pool not started"
    elif layer == "omp":
        summary = f"numba omp on {gomp or 'an unknown runtime'}"
    else:
        summary = f"numba {layer}"
    idle = [r for r in runtimes if r != gomp] if layer == "omp" and gomp else []
    if idle:
        summary += f" (also mapped, no threads: {', '.join(idle)})"
    summary += f"; OpenMP runtimes mapped: {len(runtimes)}"
    return {"layer": layer, "openmp": runtimes, "gomp_parallel": gomp, "summary": summary}
