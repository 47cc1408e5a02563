"""Backends: interpreters and compilers of the spec (``roundpipe.optim.spec``), and their registry.

Every backend subclasses ``Backend`` (``backend_api.py``: the interface the step plan calls,
``prepare`` required, replay and one-pass gradient sums optional). A step prepares every launch
before it writes anything, so a failure anywhere leaves the optimizer exactly as it was
(``plan/launches.py``). Pairings (``masters.py``): a backend that does not fuse a launch's
low-precision gradients and partners runs ``composed``: widen, the program, round back.

The names (``backend=``, or ``ROUNDPIPE_OPTIM_BACKEND``; the default is ``"fast"``):

* ``fast`` (``fast.py``, the default): the fast backend's default engine, ``numba``
  (``numba_engine/``: one compiled parallel pass over every tensor of a step, bit for bit
  torch.optim's for-loop). Where numba cannot be imported or a kernel cannot be compiled, the
  step runs the ``torch`` engine instead, with one warning naming the cause.
  ``ROUNDPIPE_OPTIM_ENGINE`` picks another engine for plain ``fast``;
* ``fast:numba``, ``fast:torch``, ``fast:numexpr``: one engine, no fallback. ``torch``
  (``torch_engine.py``): chunked torch ops on roundpipe's threads, bit for bit the for-loop, no
  compiler; ``numexpr`` (``numexpr_engine.py``): fused numexpr expressions on
  zero-copy numpy views, not bit for bit (no fused multiply-add, correctly rounded sqrt);
* ``reference`` (``reference.py``): plain torch ops, one tensor at a time, for debugging;
* ``native``: the old name of ``fast:numba`` (roundpipe 0.1), still accepted.
"""

from __future__ import annotations

import importlib
import os
import threading

from ..backend_api import Backend  # noqa: F401 (the interface, re-exported for backend authors)
from ..tensors import Checked

ENV_VAR = "ROUNDPIPE_OPTIM_BACKEND"
DEFAULT = "fast"
# name -> (module, factory name, keyword arguments)
REGISTRY = {
    "fast": ("fast", "FastBackend", {}),
    "fast:numba": ("fast", "FastBackend", {"engine": "numba"}),
    "fast:torch": ("fast", "FastBackend", {"engine": "torch"}),
    "fast:numexpr": ("fast", "FastBackend", {"engine": "numexpr"}),
    "reference": ("reference", "ReferenceBackend", {}),
}
ALIASES = {"native": "fast:numba"}  # roundpipe 0.1's name
NAMES = tuple(REGISTRY)

_instances: dict = {}
_lock = threading.Lock()


def resolve(name: str | None) -> str:
    """The backend name to use for ``backend=name`` (None: the environment, then the default)."""
    source = "backend"
    if name is None:
        name = os.environ.get(ENV_VAR) or DEFAULT
        source = ENV_VAR
    name = ALIASES.get(name, name)
    if name not in REGISTRY:
        valid = ", ".join(repr(n) for n in NAMES)
        raise ValueError(f"unknown roundpipe.optim backend {name!r} (from {source}); valid: {valid}")
    get(name)  # a backend that cannot load (fast:numba without numba) raises ImportError now
    return name


def get(name: str) -> Backend:
    """The shared backend object for a resolved name (stateless apart from compile caches,
    which are immutable once built)."""
    name = ALIASES.get(name, name)
    backend = _instances.get(name)
    if backend is None:
        module, factory, kwargs = REGISTRY[name]
        with _lock:
            backend = _instances.get(name)
            if backend is None:
                mod = importlib.import_module(f"{__name__}.{module}")
                backend = _instances[name] = getattr(mod, factory)(**kwargs)
    return backend


class CompileCache:
    """Compiled forms of programs, keyed by content (a ``Program`` hashes by its statements),
    built at most once per key and process, thread-safe."""

    def __init__(self):
        self._entries: dict = {}
        self._lock = threading.Lock()

    def get(self, key, build):
        hit = self._entries.get(key)
        if hit is None:
            with self._lock:
                hit = self._entries.get(key)
                if hit is None:
                    hit = self._entries[key] = build()
        return hit

    def values(self):
        return list(self._entries.values())

    def clear(self):
        with self._lock:
            self._entries.clear()


def pairing_of(columns):
    """``(the gradients' dtype, the partners' dtype or None)`` of a launch's columns."""
    import torch

    grads = columns.get("grad")
    partners = columns.get("partner")
    grad_dtype = grads[0].dtype if grads else torch.float32
    return grad_dtype, (partners[0].dtype if partners else None)


def composed(prepare, program, scalars, columns, cache):
    """``prepare``'s launch of ``program`` with the columns' pairing done by composition:
    low-precision gradients widened into float32 buffers (allocated here, kept in ``cache``),
    the launch, then each partner written with ``copy_`` from its parameter. Columns without a
    pairing go to ``prepare`` as they are."""
    import torch

    partners = columns.get("partner")
    grads = columns.get("grad")
    # (a bfloat16 parameter's own gradient is bfloat16 too: no pairing, nothing to widen; a
    # program stored widened widens it itself)
    low = bool(grads) and grads[0].dtype is not columns.get("param", grads)[0].dtype
    if partners is None and not low:
        return prepare(program, scalars, columns, cache)
    cols = {k: v for k, v in columns.items() if k != "partner"}
    wide = None
    if low:
        numels = [g.numel() for g in grads]
        hit = cache.get("widened")
        if hit is None or hit[0] != numels:
            flat = torch.empty(sum(numels))
            views = Checked(v.view(g.shape) for v, g in zip(flat.split(numels), grads, strict=True))
            hit = cache["widened"] = (numels, views)
        wide = hit[1]
        cols["grad"] = wide
    launch = prepare(program, scalars, cols, cache.setdefault("composed", {}))
    params = columns["param"]
    foreach_copy = torch._foreach_copy_

    def run():
        if wide is not None:
            foreach_copy(wide, grads)
        launch()
        if partners is not None:
            foreach_copy(partners, params)

    return run


def cut_at_remainder(prepare, program, scalars, columns, cache):
    """``prepare``'s launch of ``program``, whose ``remainder`` calls (a fused kernel's scalar
    remainder: ``ir.in_remainder``) are cut apart for an engine that runs whole tensors: the
    program with their bodies on each tensor's elements before its last ``numel %
    remainder_step``, then with their tails on those (zero-copy 1-D views)."""
    from ..spec.variants import has_remainder, resolved

    step = program.remainder_step
    if not step:
        plain = resolved(program, False) if has_remainder(program) else program
        return prepare(plain, scalars, columns, cache)

    def part(t, tail):
        flat = t.view(-1)
        at = flat.numel() - flat.numel() % step
        return flat[at:] if tail else flat[:at]

    launches = []
    for tail in (False, True):
        cols = {n: Checked(part(t, tail) for t in col) for n, col in columns.items()}
        launches.append(
            prepare(resolved(program, tail), scalars, cols, cache.setdefault(("remainder", tail), {}))
        )

    def run():
        for one in launches:
            one()

    return run


def segments(scalars, n: int):
    """``run``'s ``scalars`` as a list of ``(scalars, start, stop)`` over ``n`` parameters."""
    if isinstance(scalars, dict):
        return [(scalars, 0, n)]
    out, start = [], 0
    for values, count in scalars:
        out.append((values, start, start + count))
        start += count
    if start != n:
        raise ValueError(f"scalar segments cover {start} parameters, the columns hold {n}")
    return out
