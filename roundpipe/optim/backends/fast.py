"""The ``fast`` backend: a spec program over many parameters, in place, no compiler needed.

Parameters below ``SMALL_NUMEL`` elements are gathered into one flat buffer per input (one
``torch._foreach_copy_`` each), the program runs once on the flat buffers, and the targets are
scattered back; larger parameters are stepped where they live. Every result is written back
into the caller's own tensors: nothing a step updates is ever replaced.

The program runs on one of two engines:

* ``torch`` (``torch_engine.py``, the default): the program's torch ops with ``out=`` into a
  few cache-sized scratch slots, over cache-sized chunks, bit for bit torch.optim's for-loop.
  The chunks are shared out to ``roundpipe.optim.get_num_threads()`` threads of roundpipe's
  own pool (``threads.py``), each taking the next chunk when done with one, while torch's
  intra-op pool is held at one thread: one parallel region per step, not one per op and chunk
  (thousands, each waiting for its slowest thread, which on a busy machine cost seconds);
* ``numexpr`` (``numexpr_engine.py``, the design card's): one fused numexpr expression per
  ``assign``, evaluated with ``out=`` the target on zero-copy numpy views of whole tensors
  (faster than chunk by chunk, see ``run_units``), by numexpr's own thread pool (a compiled
  numexpr expression must not run in two threads at once: it crashes).

``ROUNDPIPE_OPTIM_ENGINE`` (or the backend names ``fast:torch``, ``fast:numexpr``,
``fast:auto``) selects the engine. ``auto`` times both engines on the same synthetic tensors
once per machine, program and thread count, and remembers the choice on disk
(``<cache>/engines.json``, next to the native kernels), so two runs on one machine take the
same engine (and give the same bits). The default is ``torch``: on the 2-core EPYC this project
is developed on, numexpr is compute-bound (about 2 cycles per element per operation; the PyPI
wheel has no VML) and the torch engine was faster for every optimizer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import threading
import time

import torch

from .. import threads
from ..plan import contiguous_run
from . import CompileCache, numexpr_engine, segments, torch_engine
from .formulas import lerp_variant, lerp_weights, scalar_env

logger = logging.getLogger("roundpipe.optim")

ENGINE_ENV_VAR = "ROUNDPIPE_OPTIM_ENGINE"
ENGINES = ("auto", "numexpr", "torch")
DEFAULT_ENGINE = "torch"

# Parameters with fewer elements than this are batched into flat buffers.
SMALL_NUMEL = 1 << 16
CALIBRATION_NUMEL = 1 << 20


def engine_setting(engine: str | None = None) -> str:
    name = engine or os.environ.get(ENGINE_ENV_VAR) or DEFAULT_ENGINE
    if name not in ENGINES:
        raise ValueError(f"{ENGINE_ENV_VAR}={name!r} is not one of {ENGINES}")
    return name


class _Workspace:
    """Flat buffers for a batch of small parameters.

    A column whose tensors already lie back to back in one buffer (the state the step plan
    keeps in flat buffers, see ``plan.py``, or parameters a framework flattened) is stepped
    there directly (``direct``); the others get a buffer of their own (``flat``), filled and
    emptied with one ``torch._foreach_copy_`` each per step (``views``).
    """

    def __init__(self, names, members, numels):
        total = sum(numels)
        self.names = names
        self.flat, self.views, self.direct, self.sources = {}, {}, {}, {}
        self.direct_names = []
        for name in names:
            direct = contiguous_run(members[name])
            self.direct[name] = direct
            self.sources[name] = members[name]
            if direct is not None:
                self.flat[name] = direct
                self.direct_names.append(name)
            else:
                buf = torch.empty(total)
                self.flat[name] = buf
                self.views[name] = [
                    v.view(t.shape) for v, t in zip(buf.split(numels), members[name], strict=True)
                ]


_torch_programs = CompileCache()
_numexpr_programs = CompileCache()


class FastBackend:
    """See the module docstring; ``engine``: fixed engine (None: the environment, the default)."""

    # the step plan keeps the state of small parameters in flat buffers (plan.adopt_flat_state)
    flat_state_below = SMALL_NUMEL

    def __init__(self, engine: str | None = None):
        if engine is not None:
            engine_setting(engine)
        self.name = "fast" if engine is None else f"fast:{engine}"
        self._engine = engine
        self._logged: set = set()

    def check_settings(self):
        """Raise now, before a step modifies anything, if the environment's settings are bad."""
        engine_setting(self._engine)
        threads.get_num_threads()

    # -- engines ----------------------------------------------------------------------------
    def engine(self, program, variant, nthreads) -> str:
        """The engine for a program variant: the setting, or with ``auto`` the remembered choice."""
        setting = engine_setting(self._engine)
        if setting != "auto":
            return setting
        return _auto_choice(program, variant, nthreads)

    def executor(self, engine, program, variant, values, nthreads):
        """``execute(units)``: run the program in place on each unit (name -> same-shaped tensor)."""
        if engine == "numexpr":
            prog = _numexpr_programs.get(
                (program, variant), lambda: numexpr_engine.compile_program(program, variant)
            )
            env = scalar_env(values, lerp_weights(program))
            return lambda units: prog.run_units(units, env, nthreads)
        if engine == "torch":
            prog = _torch_programs.get(program, lambda: torch_engine.compile_program(program))
            return lambda units: prog.run_parallel(units, values, nthreads)
        raise ValueError(f"unknown engine {engine!r}")

    # -- running ----------------------------------------------------------------------------
    def run(self, program, scalars, columns, cache=None):
        """Run ``program`` in place on every parameter of ``columns`` (see ``backends``)."""
        cache = {} if cache is None else cache
        nthreads = threads.get_num_threads()
        weights = lerp_weights(program)
        n = len(columns["param"])
        for k, (values, start, stop) in enumerate(segments(scalars, n)):
            cols = columns if (start, stop) == (0, n) else {m: c[start:stop] for m, c in columns.items()}
            variant = lerp_variant(values, weights)
            engine = self.engine(program, variant, nthreads)
            if logger.isEnabledFor(logging.DEBUG):
                self._log_once(program, engine, nthreads, cols)
            execute = self.executor(engine, program, variant, values, nthreads)
            self._run_batched(program, cols, execute, cache.setdefault(k, {}))

    def _log_once(self, program, engine, nthreads, columns):
        key = (program, engine, nthreads)
        if key in self._logged:
            return
        self._logged.add(key)
        numels = [t.numel() for t in columns["param"]]
        logger.debug(
            "backend=%s engine=%s threads=%d: %d-statement program, %d parameters (%d batched as small)",
            self.name,
            engine,
            nthreads,
            len(program.statements),
            len(numels),
            sum(n < SMALL_NUMEL for n in numels),
        )

    def _run_batched(self, program, columns, execute, cache):
        names = list(columns)
        params = columns["param"]
        plan = cache.get("plan")
        if plan is None or plan[0] is not params:
            numels = [p.numel() for p in params]
            small = [i for i, n in enumerate(numels) if 0 < n < SMALL_NUMEL]
            large = [i for i, n in enumerate(numels) if n >= SMALL_NUMEL]
            if len(small) == 1:
                large, small = sorted(large + small), []
            plan = cache["plan"] = (params, small, large, numels)
            cache.pop("ws", None)
        _, small, large, numels = plan
        units = [{name: columns[name][i] for name in names} for i in large]
        if not small:
            execute(units)
            return
        whole = len(small) == len(params)
        subsets = cache.setdefault("members", {})  # name -> (column, its small members)
        members = {}
        for name in names:
            column = columns[name]
            hit = subsets.get(name)
            if whole:
                members[name] = column
            elif hit is not None and hit[0] is column:
                members[name] = hit[1]
            else:
                members[name] = [column[i] for i in small]
                subsets[name] = (column, members[name])
        ws = cache.get("ws")
        if ws is None or ws.names != names or any(ws.sources[n] is not members[n] for n in ws.direct_names):
            ws = cache["ws"] = _Workspace(names, members, [numels[i] for i in small])
        gathered = [name for name in names if ws.direct[name] is None]
        for name in gathered:
            torch._foreach_copy_(ws.views[name], members[name])
        units.append(ws.flat)
        execute(units)
        for name in program.targets:
            if ws.direct[name] is None:
                torch._foreach_copy_(members[name], ws.views[name])


# ---------------------------------------------------------------------------------------------
# auto: measured once per machine, program and thread count, remembered on disk

_choices: dict = {}
_choices_lock = threading.Lock()


def _choice_file() -> str:
    from .native import cache_dir  # the cache directory's rules live there (numba not needed)

    return os.path.join(os.path.dirname(cache_dir()), "engines.json")


def _choice_key(program, variant, nthreads) -> str:
    machine = f"{platform.machine()} {platform.processor()} {os.cpu_count()}"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            machine += next((line for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    import numexpr

    versions = f"torch {torch.__version__} numexpr {numexpr.__version__}"
    text = f"{program}\n{variant}\n{nthreads}\n{machine}\n{versions}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _auto_choice(program, variant, nthreads) -> str:
    key = _choice_key(program, variant, nthreads)
    hit = _choices.get(key)
    if hit is not None:
        return hit
    with _choices_lock:
        path = _choice_file()
        try:
            with open(path, encoding="utf-8") as f:
                _choices.update(json.load(f))
        except (OSError, ValueError):
            pass
        hit = _choices.get(key)
        source = "remembered in " + path
        if hit is None:
            hit, source = _calibrate(program, variant, nthreads), "measured"
            _choices[key] = hit
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(_choices, f, indent=0, sort_keys=True)
                os.replace(tmp, path)
                source += ", saved to " + path
            except OSError as err:
                source += f", not saved ({err})"
    logger.debug("engine=auto for a %d-statement program: %s (%s)", len(program.statements), hit, source)
    return hit


def _calibrate(program, variant, nthreads) -> str:
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.rand(CALIBRATION_NUMEL, generator=gen).add_(0.5) for n in program.tensors}
    values = {s: 0.1 for s in program.scalars}
    for w, small in zip(lerp_weights(program), variant, strict=True):
        values[w] = 0.1 if small else 0.9
    backend = FastBackend()
    runs = {e: backend.executor(e, program, variant, values, nthreads) for e in ("numexpr", "torch")}
    times = {k: [] for k in runs}
    for fn in runs.values():
        fn([tensors])  # warm up
    for _ in range(3):
        for k, fn in runs.items():
            t0 = time.perf_counter()
            fn([tensors])
            times[k].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v) for k, v in times.items()}
    choice = min(medians, key=medians.get)
    logger.debug(
        "calibrated on %d elements, %d threads: numexpr %.2f ms, torch %.2f ms -> %s",
        CALIBRATION_NUMEL,
        nthreads,
        medians["numexpr"] * 1e3,
        medians["torch"] * 1e3,
        choice,
    )
    return choice
