"""Which engine the default backend (``fast``) runs, and whether it fell back to the torch
engine, for the bench's header and the demo (``backends.get("fast").engine()``)."""

from __future__ import annotations

import logging

from roundpipe.optim import backends as rp_backends
from roundpipe.optim.backends.fast import DEFAULT_ENGINE, ENGINE_ENV_VAR, engine_setting

LOGGER = "roundpipe.optim"  # where the fast backend logs each fallback (and warns)


class FallbackWatch(logging.Handler):
    """Within the block, collects the warnings the fast backend logs when a step falls back
    from the numba engine to the torch engine (a kernel that did not compile, numba missing)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "torch engine" in msg:
            first = msg.splitlines()[0]
            if first not in self.messages:
                self.messages.append(first)

    def __enter__(self):
        logging.getLogger(LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(LOGGER).removeHandler(self)
        return False


def fast_engine(fallbacks=()) -> dict:
    """``{"engine", "fell_back", "why", "text"}``: the engine plain ``fast`` runs now, whether
    that is a fallback from numba, and a one-line description. ``fallbacks``: the messages a
    ``FallbackWatch`` collected (a program whose kernel did not compile runs on torch)."""
    backend = rp_backends.get("fast")
    engine = backend.engine()
    _, chosen = engine_setting()
    why = None
    if chosen:
        text = f"fast runs the {engine} engine ({ENGINE_ENV_VAR} chooses it)"
    elif engine != DEFAULT_ENGINE:
        try:
            backend.numba_engine()
        except ImportError as err:
            why = str(err)
        text = f"fast FELL BACK to the torch engine (same bits, slower): {why or 'numba is unavailable'}"
    else:
        import numba

        text = f"fast runs the numba engine (numba {numba.__version__})"
    if fallbacks and engine == DEFAULT_ENGINE:
        why = "; ".join(fallbacks)
        text += f"; some steps FELL BACK to the torch engine: {why}"
    fell_back = not chosen and (engine != DEFAULT_ENGINE or bool(fallbacks))
    return {"engine": engine, "fell_back": fell_back, "why": why, "text": text}
