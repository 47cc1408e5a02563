"""The ``fast`` backend: one spec program over many parameters, in place, with few calls.

Two engines execute a program on a set of same-shaped float32 tensors:

* ``numexpr`` (``numexpr_engine.py``): one fused, multi-threaded numexpr expression per
  ``assign``, evaluated with ``out=`` the target on zero-copy numpy views;
* ``torch`` (``torch_engine.py``): the program's torch ops with ``out=`` into a few scratch
  slots, over cache-sized chunks.

The default engine is ``torch``, chosen by measurement: on the 2-core EPYC this project is
developed on, numexpr is compute-bound (about 2 cycles per element per operation; the PyPI
wheel has no VML) and the torch engine was faster for every optimizer (4 x 16M Adam: about
100 ms against 280 ms). The torch engine is also bit-for-bit equal to torch.optim's for-loop,
and a fixed default keeps results reproducible from run to run. ``ROUNDPIPE_OPTIM_ENGINE``
selects ``numexpr``, or ``auto``: time both engines once per program variant and process on
the same synthetic 1 Mi-element tensors (interleaved, median of 3) and keep the faster.

Many small tensors are not stepped one by one (each call costs microseconds): the parameters
below ``SMALL_NUMEL`` elements are gathered into one flat buffer per input with a single
``torch._foreach_copy_``, the program runs once on the flat buffers, and the targets are
scattered back with another. Every result is written back into the caller's own tensors:
nothing a step updates is ever replaced.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time

import numexpr
import torch

from .. import threads
from . import numexpr_engine, torch_engine

logger = logging.getLogger("roundpipe.optim")

ENGINE_ENV_VAR = "ROUNDPIPE_OPTIM_ENGINE"
ENGINES = ("auto", "numexpr", "torch")

# Parameters with fewer elements than this are batched into flat buffers.
SMALL_NUMEL = 1 << 16
CALIBRATION_NUMEL = 1 << 20


DEFAULT_ENGINE = "torch"


def engine_setting() -> str:
    name = os.environ.get(ENGINE_ENV_VAR) or DEFAULT_ENGINE
    if name not in ENGINES:
        raise ValueError(f"{ENGINE_ENV_VAR}={name!r} is not one of {ENGINES}")
    return name


class _Workspace:
    """Flat buffers for a batch of small parameters, and their parameter-shaped views."""

    def __init__(self, names, shapes, numels):
        total = sum(numels)
        self.flat = {}
        self.views = {}
        for name in names:
            buf = torch.empty(total)
            self.flat[name] = buf
            self.views[name] = [v.view(s) for v, s in zip(buf.split(numels), shapes, strict=True)]


class FastBackend:
    name = "fast"
    # DTensor and other wrapper subclasses cannot be gathered into flat buffers or viewed as numpy
    tensor_subclasses = False

    def __init__(self):
        self._numexpr: dict = {}
        self._torch: dict = {}
        self._choice: dict = {}
        self._logged: set = set()
        self._lock = threading.Lock()

    def check_settings(self):
        """Raise now, before a step modifies anything, if the environment's settings are bad."""
        engine_setting()
        threads.get_num_threads()

    # -- compilation caches ----------------------------------------------------------------
    def _numexpr_program(self, program, variant):
        key = (id(program), variant)
        hit = self._numexpr.get(key)
        if hit is None or hit.program is not program:
            hit = numexpr_engine.compile_program(program, variant)
            with self._lock:
                self._numexpr[key] = hit
        return hit

    def _torch_program(self, program):
        hit = self._torch.get(id(program))
        if hit is None or hit[0] is not program:
            hit = (program, torch_engine.compile_program(program))
            with self._lock:
                self._torch[id(program)] = hit
        return hit[1]

    def engine(self, program, variant, scalars, nthreads) -> str:
        """The engine for a program variant: the setting, or with ``auto`` measured once."""
        setting = engine_setting()
        if setting != "auto":
            return setting
        key = (id(program), variant, nthreads)
        hit = self._choice.get(key)
        if hit is None or hit[0] is not program:
            hit = (program, self._calibrate(program, variant, scalars))
            with self._lock:
                self._choice[key] = hit
        return hit[1]

    def _calibrate(self, program, variant, scalars) -> str:
        gen = torch.Generator().manual_seed(0)
        tensors = {n: torch.rand(CALIBRATION_NUMEL, generator=gen).add_(0.5) for n in program.tensors}
        ne_prog = self._numexpr_program(program, variant)
        t_prog = self._torch_program(program)
        env = numexpr_engine.scalar_env(scalars, numexpr_engine.lerp_weights(program))
        runs = {
            "numexpr": lambda: ne_prog.run(tensors, env),
            "torch": lambda: t_prog.run(tensors, scalars),
        }
        times = {k: [] for k in runs}
        for fn in runs.values():
            fn()  # warm up
        for _ in range(3):
            for k, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        medians = {k: statistics.median(v) for k, v in times.items()}
        choice = min(medians, key=medians.get)
        logger.debug(
            "calibrated %d-statement program on %d elements: numexpr %.2f ms, torch %.2f ms -> %s",
            len(program.statements),
            CALIBRATION_NUMEL,
            medians["numexpr"] * 1e3,
            medians["torch"] * 1e3,
            choice,
        )
        return choice

    # -- running ---------------------------------------------------------------------------
    def run(self, program, scalars, columns, cache=None):
        """Run ``program`` with ``scalars`` on every parameter of ``columns``, in place.

        ``columns`` maps each of the program's tensor names to a list of real float32
        tensors, one per parameter; ``cache`` is a dict the caller keeps between steps (the
        flat workspaces for small parameters live there).
        """
        nthreads = threads.get_num_threads()
        weights = numexpr_engine.lerp_weights(program)
        variant = numexpr_engine.lerp_variant(scalars, weights)
        engine = self.engine(program, variant, scalars, nthreads)
        if logger.isEnabledFor(logging.DEBUG):
            self._log_once(program, engine, nthreads, columns)
        execute = self.executor(engine, program, variant, scalars, nthreads)
        with threads.torch_threads(nthreads):
            self._run_batched(program, columns, execute, cache if cache is not None else {})

    def _log_once(self, program, engine, nthreads, columns):
        key = (id(program), engine, nthreads)
        if key in self._logged:
            return
        self._logged.add(key)
        numels = [t.numel() for t in columns["param"]]
        small = sum(n < SMALL_NUMEL for n in numels)
        logger.debug(
            "backend=%s engine=%s threads=%d: %d-statement program, %d parameters (%d batched as small)",
            self.name,
            engine,
            nthreads,
            len(program.statements),
            len(numels),
            small,
        )

    def executor(self, engine, program, variant, scalars, nthreads):
        """A function that runs the program in place on one set of same-shaped tensors."""
        if engine == "numexpr":
            prog = self._numexpr_program(program, variant)
            env = numexpr_engine.scalar_env(scalars, numexpr_engine.lerp_weights(program))
            if numexpr.get_num_threads() != nthreads:
                numexpr.set_num_threads(nthreads)
            return lambda tensors: prog.run(tensors, env)
        if engine == "torch":
            prog = self._torch_program(program)
            return lambda tensors: prog.run(tensors, scalars)
        raise ValueError(f"unknown engine {engine!r}")

    def _run_batched(self, program, columns, execute, cache):
        names = list(columns)
        params = columns["param"]
        numels = [p.numel() for p in params]
        small = [i for i, n in enumerate(numels) if n < SMALL_NUMEL]  # empty ones cost nothing
        for i, n in enumerate(numels):
            if n >= SMALL_NUMEL:
                execute({name: columns[name][i] for name in names})
        if not small:
            return
        if len(small) == 1:
            i = small[0]
            if numels[i]:
                execute({name: columns[name][i] for name in names})
            return
        if len(small) == len(params):
            members = columns
        else:
            members = {name: [columns[name][i] for i in small] for name in names}
        shapes = tuple(t.shape for t in members["param"])
        key = (tuple(names), shapes)
        ws = cache.get(key)
        if ws is None:
            if len(cache) >= 8:
                cache.clear()
            ws = cache[key] = _Workspace(names, shapes, [numels[i] for i in small])
        for name in names:
            torch._foreach_copy_(ws.views[name], members[name])
        execute(ws.flat)
        for name in program.targets:
            torch._foreach_copy_(members[name], ws.views[name])
