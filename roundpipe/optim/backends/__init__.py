"""Backends: interpreters and compilers of the spec (``roundpipe.optim.spec``).

``reference`` runs a program with plain torch ops (``reference.py``); ``fast`` compiles it to
numexpr expressions evaluated in place on zero-copy numpy views (``fast.py``); ``native``
compiles it with numba into one parallel loop per program (``native.py``; needs the optional
``numba``: ``pip install "roundpipe[native]"``).

The backend is chosen per optimizer with ``backend=``; when that is not given, the environment
variable ``ROUNDPIPE_OPTIM_BACKEND`` decides, and ``"fast"`` is the default.
"""

from __future__ import annotations

import os

ENV_VAR = "ROUNDPIPE_OPTIM_BACKEND"
DEFAULT = "fast"
NAMES = ("fast", "reference", "native")

_instances: dict = {}


def resolve(name: str | None) -> str:
    """The backend name to use for ``backend=name`` (None: the environment, then the default)."""
    source = "backend"
    if name is None:
        name = os.environ.get(ENV_VAR) or DEFAULT
        source = ENV_VAR
    if name not in NAMES:
        valid = ", ".join(repr(n) for n in NAMES)
        raise ValueError(f"unknown roundpipe.optim backend {name!r} (from {source}); valid: {valid}")
    if name == "native":
        get(name)  # without numba this raises ImportError now, when the optimizer is constructed
    return name


def get(name: str):
    """The (shared, stateless apart from caches) backend object for a resolved name."""
    backend = _instances.get(name)
    if backend is None:
        if name == "fast":
            from .fast import FastBackend

            backend = FastBackend()
        elif name == "reference":
            from .reference import ReferenceBackend

            backend = ReferenceBackend()
        elif name == "native":
            from .native import NativeBackend

            backend = NativeBackend()
        else:
            raise ValueError(name)
        _instances[name] = backend
    return backend
