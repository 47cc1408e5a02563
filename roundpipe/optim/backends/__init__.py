"""Backends: interpreters and compilers of the spec (``roundpipe.optim.spec``).

The whole interface a backend implements (duck-typed; ``Backend`` documents it):

.. code-block:: python

    class Backend:
        name: str                     # as passed to backend=
        def check_settings(self): ... # raise now, before a step writes anything, on bad settings
        def run(self, program, scalars, columns, cache=None): ...

``run`` executes ``program`` (``spec/ir.py``) in place on every parameter of ``columns``
(program tensor name -> list of real float32 CPU tensors, one per parameter, all contiguous).
``scalars`` is one dict of per-step scalars for every parameter, or a list of
``(scalars, count)`` segments that cover the parameters in order (parameters whose 0-d state
differs, e.g. a different ``step``, get different scalars). A column of type ``Checked`` has been validated by
the step plan; any other is checked by the backend that needs it. ``cache`` is a dict the step plan
keeps for this call site between steps (flat buffers, pointer tables); it is dropped whenever
the plan is rebuilt.

The backends are peers, each in its own module, loaded on first use:

* ``reference`` (``reference.py``): plain torch ops, one tensor at a time;
* ``fast`` (``fast.py``): no compiler; small tensors batched into flat buffers, run by an
  engine: ``torch`` (``torch_engine.py``, the default) or ``numexpr`` (``numexpr_engine.py``),
  or ``auto`` (measured once per machine and program, remembered on disk). ``fast:torch``,
  ``fast:numexpr`` and ``fast:auto`` name an engine; plain ``fast`` takes
  ``ROUNDPIPE_OPTIM_ENGINE`` or the default;
* ``native`` (``native.py``): numba, one parallel loop over every tensor of a step.

The backend is chosen per optimizer with ``backend=``; when that is not given, the environment
variable ``ROUNDPIPE_OPTIM_BACKEND`` decides, and ``"fast"`` is the default.
"""

from __future__ import annotations

import importlib
import os
import threading

ENV_VAR = "ROUNDPIPE_OPTIM_BACKEND"
DEFAULT = "fast"
# name -> (module, factory name, keyword arguments)
REGISTRY = {
    "fast": ("fast", "FastBackend", {}),
    "fast:torch": ("fast", "FastBackend", {"engine": "torch"}),
    "fast:numexpr": ("fast", "FastBackend", {"engine": "numexpr"}),
    "fast:auto": ("fast", "FastBackend", {"engine": "auto"}),
    "reference": ("reference", "ReferenceBackend", {}),
    "native": ("native", "NativeBackend", {}),
}
NAMES = tuple(REGISTRY)

_instances: dict = {}
_lock = threading.Lock()


def resolve(name: str | None) -> str:
    """The backend name to use for ``backend=name`` (None: the environment, then the default)."""
    source = "backend"
    if name is None:
        name = os.environ.get(ENV_VAR) or DEFAULT
        source = ENV_VAR
    if name not in REGISTRY:
        valid = ", ".join(repr(n) for n in NAMES)
        raise ValueError(f"unknown roundpipe.optim backend {name!r} (from {source}); valid: {valid}")
    get(name)  # a backend that cannot load (native without numba) raises ImportError now
    return name


def get(name: str):
    """The shared backend object for a resolved name (stateless apart from compile caches)."""
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


class Checked(list):
    """A column the step plan has validated (contiguous float32 CPU tensors of the parameters'
    sizes): a backend need not check it again."""

    __slots__ = ()


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
