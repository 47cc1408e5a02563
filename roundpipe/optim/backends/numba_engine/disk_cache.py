"""The on-disk kernel cache: each generated kernel module is written once to
``<cache_dir()>/<name>.py`` and imported from there, so numba's ``cache=True`` keeps its machine
code next to it (``__pycache__``) for the next process. Files are created atomically (a
temporary file linked into place), so processes compiling one kernel into one empty directory
at once never see a partial file. Where the directory cannot be written, a warning says so
(once per process) and modules are built in memory.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile
import types
import warnings

from .config import CACHE_ENV_VAR

logger = logging.getLogger("roundpipe.optim")

_warned_readonly = False  # process-wide, unlocked: a race can at worst warn twice


def cache_dir() -> str:
    """Where generated kernels and numba's machine code are cached: ``$ROUNDPIPE_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/roundpipe``, else ``~/.cache/roundpipe``; then ``numba``."""
    root = os.environ.get(CACHE_ENV_VAR)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "roundpipe")
    return os.path.join(root, "numba")


def warn_uncached(directory, err):
    """Warn, once per process, that kernels are compiled in memory (``directory`` is not
    writable)."""
    global _warned_readonly
    if _warned_readonly:
        return
    _warned_readonly = True
    msg = (
        f"roundpipe.optim's numba engine: cannot write its kernel cache in {directory!r} ({err}); "
        "compiling kernels in memory instead, so every process compiles them again. "
        f"Set {CACHE_ENV_VAR} to a writable directory to cache them."
    )
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _write_source(directory: str, path: str, source: str) -> None:
    """Create ``path`` with ``source`` unless it already holds exactly that (never rewrite it:
    numba's cache is keyed on the file's modification time)."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == source:
                return
        exists = True
    except FileNotFoundError:
        exists = False
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".py")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(source)
        if exists:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic create-if-absent: a concurrent writer wins cleanly
            except FileExistsError:
                pass
            except OSError:
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_module(name: str, source: str):
    """``(module, on_disk)``: the kernel module imported from the cache directory, or built in
    memory (``on_disk`` False) where that directory cannot be written."""
    directory = cache_dir()
    path = os.path.join(directory, name + ".py")
    try:
        _write_source(directory, path, source)
    except OSError as err:
        warn_uncached(directory, err)
    else:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module, True
    namespace = {"__name__": name}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return types.SimpleNamespace(**namespace), False
