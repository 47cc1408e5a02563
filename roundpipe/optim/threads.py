"""The optimizer's thread count: one knob for every engine that runs during a step.

``roundpipe.optim.set_num_threads(n)`` (or ``ROUNDPIPE_OPTIM_NUM_THREADS``) sets how many
threads a step uses; by default it follows ``torch.get_num_threads()``. The numexpr engine's
pool is set to it, and torch's intra-op pool is set to it for the duration of a step (then
restored), so the two never run more threads than asked for. In a child process created by
``fork`` the count is 1 (GNU OpenMP hangs in a forked child's parallel regions).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

ENV_VAR = "ROUNDPIPE_OPTIM_NUM_THREADS"
_num_threads: int | None = None


def set_num_threads(n: int | None) -> None:
    """Use ``n`` threads in optimizer steps; ``None`` goes back to the default."""
    global _num_threads
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"number of threads must be a positive int or None, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    """Threads an optimizer step uses: set_num_threads(), else the environment, else torch's."""
    if _num_threads is not None:
        return _num_threads
    env = os.environ.get(ENV_VAR)
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
    # child hangs); DataLoader workers and multiprocessing with fork step on one thread.
    global _num_threads
    _num_threads = 1


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
