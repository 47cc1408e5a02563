"""The ``fast`` backend: a spec program over many parameters, in place, on one of three engines.

* ``numba`` (``numba_engine/``, the default): every tensor of the step in one compiled
  parallel pass, no gather or scatter, bit for bit torch.optim's for-loop. Where numba cannot be
  imported, or cannot compile a program, plain ``fast`` runs the ``torch`` engine instead and
  warns once, naming the cause and the fix (``fast:numba`` raises instead);
* ``torch`` (``torch_engine.py``): no compiler. Parameters below ``SMALL_NUMEL`` elements are
  gathered into one flat buffer per input (one ``torch._foreach_copy_`` each), the program runs
  on the flat buffers, and the targets are scattered back; larger parameters are stepped where
  they live. The program's torch ops run with ``out=`` into cache-sized scratch slots over
  cache-sized chunks, bit for bit the for-loop, the chunks shared out to roundpipe's own
  threads (``threads.py``) while torch's intra-op pool is held at one thread: one parallel
  region per step;
* ``numexpr`` (``numexpr_engine.py``): the same batching, one fused numexpr expression per
  ``assign`` on zero-copy numpy views, by numexpr's own pool. Not bit for bit (numexpr has no
  fused multiply-add and a correctly rounded sqrt).

Every result is written back into the caller's own tensors: nothing a step updates is ever
replaced. ``ROUNDPIPE_OPTIM_ENGINE`` (or the backend names ``fast:numba``, ``fast:torch``,
``fast:numexpr``) selects the engine.

When to pick which: ``fast`` always, unless numba is not available for the platform (then
``fast:torch``: the same bits, slower, most of all on many small tensors: docs/benchmarks.md),
or to compare with numexpr's fused expressions (``fast:numexpr``).

Shared between threads: the compiled programs (``_torch_programs``, ``_numexpr_programs``,
the numba engine's kernels) are immutable once built and built under a lock; a torch program's
scratch slots are per thread; numexpr runs under one process-wide lock (numexpr's own pool
allows one evaluation at a time, and a compiled expression must not run in two threads at
once); the engine choice and the fallback record are written under ``self._lock``.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings

import torch

from .. import threads
from ..backend_api import Backend
from ..spec.ir import Call, walk
from ..tensors import LOW_PRECISION, contiguous_run
from . import CompileCache, composed, cut_at_remainder, numba_engine, segments, torch_engine
from .formulas import lerp_variant, lerp_weights, scalar_env
from .numba_engine import blockwise as numba_blockwise
from .numba_engine import staged as numba_staged
from .numba_engine import staged_probes
from .reference import run_staged

logger = logging.getLogger("roundpipe.optim")

ENGINE_ENV_VAR = "ROUNDPIPE_OPTIM_ENGINE"
ENGINES = ("numba", "torch", "numexpr")
DEFAULT_ENGINE = "numba"
FALLBACK_ENGINE = "torch"

# Parameters with fewer elements than this are batched into flat buffers (torch and numexpr
# engines; the step plan creates their state in flat buffers for every engine).
SMALL_NUMEL = 1 << 16
_NO_CACHE: dict = {}


@functools.lru_cache(maxsize=256)
def _arithmetic_inputs(program) -> tuple:
    """The tensors a staged pass reads in its arithmetic: not the ones it writes, not the
    gradient (a partner's is read widened)."""
    return tuple(t for t in program.tensors if t not in program.targets and t != "grad")


@functools.lru_cache(maxsize=256)
def _staged_compilable(program) -> bool:
    """Whether the numba engine's staged passes can run ``program``: not an 8-bit state's
    blockwise pass, and no ``sqrt`` (torch's is MKL's routine, which those passes do not call;
    the 8-bit family's 32-bit updates take one)."""
    calls = (n for st in program.statements for n in walk(st.expr) if isinstance(n, Call))
    return not program.blockwise and all(c.fn != "sqrt" for c in calls)


def staged_fusion(program, fused, tensors):
    """The fused multiply-adds of a staged pass: the engine's, or, where the pass reads a
    low-precision tensor in its arithmetic (Muon's bfloat16 update), what ``torch_mixed_fusion``
    measured for ``add`` (None: unknown, the pass runs torch's ops). A partner's low-precision
    gradient does not count: it is read widened, the fp32 master gradient torch steps."""
    fused = fused if type(fused) is frozenset else frozenset(fused)
    read = _arithmetic_inputs(program)
    if not tensors or all([tensors[0][t].dtype is torch.float32 for t in read]):
        return fused
    mixed = staged_probes.torch_mixed_fusion()
    if mixed is None:
        return None
    return (fused | {"add"}) if mixed else (fused - {"add"})


def engine_setting(engine: str | None = None) -> tuple[str, bool]:
    """``(engine, chosen)``: the engine to run, and whether the user chose it (by name or by
    ``ROUNDPIPE_OPTIM_ENGINE``; a chosen ``numba`` never falls back)."""
    name = engine or threads.getenv(ENGINE_ENV_VAR)
    if not name:
        return DEFAULT_ENGINE, False
    if name not in ENGINES:
        raise ValueError(f"{ENGINE_ENV_VAR}={name!r} is not one of {ENGINES}")
    return name, True


class _Workspace:
    """Flat buffers for a batch of small parameters.

    A column whose tensors already lie back to back in one buffer (the state the step plan
    keeps in flat buffers, see ``plan/state.py``, or parameters a framework flattened) is stepped
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


class FastBackend(Backend):
    """See the module docstring; ``engine``: fixed engine (None: the environment, the default)."""

    # the torch and numexpr engines batch small parameters, stepping their flat state in place
    flat_state_below = SMALL_NUMEL

    def __init__(self, engine: str | None = None):
        if engine is not None:
            engine_setting(engine)
        self.name = "fast" if engine is None else f"fast:{engine}"
        self._engine = engine
        self._logged: set = set()  # debug-log record, unlocked: a race logs twice at worst
        self._lock = threading.Lock()
        self._numba = None  # the NumbaEngine, once made
        self._numba_error = None  # why it cannot be made (an ImportError)
        self._failed: dict = {}  # program -> why its kernel cannot be compiled
        self._warned: set = set()
        if engine == "numba":
            self.numba_engine()  # without numba, fast:numba raises ImportError when chosen

    def check_settings(self):
        engine_setting(self._engine)
        threads.get_num_threads()

    # -- engines ----------------------------------------------------------------------------
    def numba_engine(self):
        """The numba engine (ImportError when numba cannot be imported; remembered)."""
        if self._numba is None and self._numba_error is None:
            with self._lock:
                if self._numba is None and self._numba_error is None:
                    try:
                        self._numba = numba_engine.NumbaEngine()
                    except ImportError as err:
                        self._numba_error = err
        if self._numba_error is not None:
            raise self._numba_error
        return self._numba

    def engine(self, program=None) -> str:
        """The engine this backend runs ``program`` on now (after any fallback)."""
        engine, chosen = engine_setting(self._engine)
        if engine != "numba" or chosen:
            return engine
        try:
            self.numba_engine()
        except ImportError:
            return FALLBACK_ENGINE
        return FALLBACK_ENGINE if program in self._failed else engine

    def gradient_sums(self, grads, order: float):
        """The numba engine's one read-only pass (``numba_engine.norms``); None on another
        engine, or for gradients the pass cannot read."""
        if self.engine() != "numba" or not numba_engine.norms_supported(grads):
            return None
        if float(order) == float("inf") and any(g.numel() == 0 for g in grads):
            return None  # torch's inf-norm raises on an empty tensor: let it
        return numba_engine.gradient_sums(grads, order)

    @property
    def exact(self) -> bool:
        engine = self.engine()
        if engine == "numba":
            return self.numba_engine().exact
        return engine == "torch"

    def exact_for(self, dtype) -> bool:
        engine = self.engine()
        if engine == "numba":
            return self.numba_engine().exact_for(dtype)
        return engine == "torch"

    def executor(self, engine, program, variant, values, nthreads):
        """``execute(units)``: run the program in place on each unit (name -> same-shaped tensor)."""
        if engine == "numexpr":
            # imported here, not with this module: numexpr starts its thread pool at import, which
            # every process stepping on another engine would carry to its exit for nothing
            from . import numexpr_engine

            prog = _numexpr_programs.get(
                (program, variant), lambda: numexpr_engine.compile_program(program, variant)
            )
            env = scalar_env(values, lerp_weights(program))
            return lambda units: prog.run_units(units, env, nthreads)
        if engine == "torch":
            prog = _torch_programs.get(program, lambda: torch_engine.compile_program(program))
            return lambda units: prog.run_parallel(units, values, nthreads)
        raise ValueError(f"unknown engine {engine!r}")

    def _fall_back(self, program, err, what):
        """Record that ``program`` runs on the torch engine, and warn once per cause."""
        with self._lock:
            if program is not None:
                self._failed[program] = err
            cause = f"{type(err).__name__}: {err}"
            if cause in self._warned:
                return
            self._warned.add(cause)
        if program is None:  # numba cannot be imported
            fix = f"to step at full speed, {numba_engine.INSTALL_HINT}"
        else:
            fix = "please report it with the program below; set backend='fast:torch' to silence this"
        msg = (
            f"roundpipe.optim backend='fast': the numba engine {what} ({cause}); stepping with the "
            f"torch engine instead (the same results bit for bit, slower). Fix: {fix}."
        )
        if program is not None:
            msg += f"\nprogram:\n{program}"
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=5)

    # -- running ----------------------------------------------------------------------------
    def prepare(self, program, scalars, columns, cache):
        """Everything needed to run ``program`` on ``columns``; returns the launch (see
        ``backends``). Nothing is written here."""
        engine, chosen = engine_setting(self._engine)
        if engine == "numba":
            try:
                numba = self._numba or self.numba_engine()
            except ImportError as err:
                if chosen:
                    raise
                self._fall_back(None, err, "cannot be imported")
            else:
                if program not in self._failed:
                    try:
                        return numba.prepare(program, scalars, columns, cache.setdefault("numba", {}))
                    except numba_engine.KernelCompileError as err:
                        if chosen:
                            raise
                        self._fall_back(program, err.__cause__ or err, "cannot compile a kernel")
            engine = FALLBACK_ENGINE
        return composed(
            lambda *a: cut_at_remainder(lambda *b: self._prepare_batched(engine, *b), *a),
            program,
            scalars,
            columns,
            cache.setdefault(engine, {}),
        )

    def prepare_staged(self, program, scalars, tensors, cache=None):
        """A staged step's pass: compiled on the numba engine (``numba_engine.staged``) where its
        probes found torch's reduction order and fused multiply-adds reproduced; torch's own ops
        (``reference.run_staged``: the same bits) on the other engines, for the 8-bit optimizers'
        blockwise passes, and elsewhere."""
        if numba_blockwise.compiles(program) and self.engine(program) == "numba":
            engine = self.numba_engine()
            nthreads = min(threads.get_num_threads(), engine.max_threads)
            kept = None if cache is None else cache.setdefault("numba", {})  # (replay_handle's)
            launch = numba_blockwise.prepare(
                program, scalars, tensors, engine.fused, engine.sqrt_kind, engine.sqrt_routine, nthreads, kept
            )
            if launch is not None:
                return launch
            self._log_staged_once(program, None, None)
        elif not _staged_compilable(program):
            self._log_staged_once(program, None, None)
        elif self.engine(program) == "numba":
            fused = staged_fusion(program, self.numba_engine().fused, tensors)
            order = staged_probes.torch_reductions() if program.reductions else (8, (False, True))
            if fused is not None and order is not None:
                # (numba's pool has at most NUMBA_NUM_THREADS threads: asking for more raises)
                nthreads = min(threads.get_num_threads(), self.numba_engine().max_threads)
                launch = numba_staged.prepare(
                    program, scalars, tensors, fused, *order, nthreads, run_staged, cache
                )
                if launch is not None:
                    return launch
            self._log_staged_once(program, fused, order)
        return functools.partial(run_staged, program, scalars, tensors)

    def _log_staged_once(self, program, fused, order):
        if logger.isEnabledFor(logging.DEBUG) and ("staged", program) not in self._logged:
            self._logged.add(("staged", program))
            logger.debug(
                "backend=fast: a staged pass runs torch's ops (reductions reproduced: %s, "
                "mixed-dtype fused multiply-adds known: %s):\n%s",
                order is not None,
                fused is not None,
                program,
            )

    def replay_handle(self, program, cache):
        """The numba engine's record of its launch (``numba_engine.engine.LaunchRecord``; for a
        staged step's blockwise pass ``numba_engine.blockwise.BlockwiseRecord``); the other
        engines do not replay (their prepare costs little beside their launch)."""
        return cache.get("numba", _NO_CACHE).get("replay")

    def rebind(self, handle, scalars, grads):
        if engine_setting(self._engine)[0] != "numba":
            return None
        return handle.rebind(self._numba, scalars, grads)

    def _prepare_batched(self, engine, program, scalars, columns, cache):
        if engine == "numexpr" and program.storage:
            raise TypeError(
                "roundpipe.optim backend='fast:numexpr' does not take state_dtype or stochastic_rounding "
                "(its expressions read and write float32 arrays only); use backend='fast' (numba) or "
                "'fast:torch'"
            )
        if engine == "numexpr" and columns["param"] and columns["param"][0].dtype in LOW_PRECISION:
            raise TypeError(
                f"roundpipe.optim backend='fast:numexpr' does not step {columns['param'][0].dtype} "
                "parameters (numexpr computes in float32 or float64 only, and cannot round each op "
                "to their dtype as torch does); use backend='fast' (numba) or 'fast:torch'"
            )
        nthreads = threads.get_num_threads()
        weights = lerp_weights(program)
        n = len(columns["param"])
        launches = []
        for k, (values, start, stop) in enumerate(segments(scalars, n)):
            cols = columns if (start, stop) == (0, n) else {m: c[start:stop] for m, c in columns.items()}
            variant = lerp_variant(values, weights)
            if logger.isEnabledFor(logging.DEBUG):
                self._log_once(program, engine, nthreads, cols)
            execute = self.executor(engine, program, variant, values, nthreads)
            launches.append(self._batched(program, cols, execute, cache.setdefault((engine, k), {})))

        def launch():
            for one in launches:
                one()

        return launch

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

    def _batched(self, program, columns, execute, cache):
        """The launch of ``execute`` over ``columns``: small parameters through flat buffers
        (allocated here, before the step writes anything), large ones where they live."""
        names = list(columns)
        params = columns["param"]
        batching = cache.get("batching")  # which parameters are batched as small
        if batching is None or batching[0] is not params:
            numels = [p.numel() for p in params]
            # bfloat16 and float16 tensors are never gathered: torch's last elements of each
            # tensor round otherwise (its scalar tail, low_precision.py); nor are parameters
            # rounded stochastically (their random bits are their own elements')
            below = SMALL_NUMEL if not params or params[0].dtype is torch.float32 else 0
            below = 0 if "sr_ids" in columns else below
            small = [i for i, n in enumerate(numels) if 0 < n < below]
            large = [i for i, n in enumerate(numels) if n >= below]
            if len(small) == 1:
                large, small = sorted(large + small), []
            batching = cache["batching"] = (params, small, large, numels)
            cache.pop("ws", None)
        _, small, large, numels = batching
        units = [{name: columns[name][i] for name in names} for i in large]
        if not small:
            return lambda: execute(units)
        all_small = len(small) == len(params)
        subsets = cache.setdefault("members", {})  # name -> (column, its small members)
        members = {}
        for name in names:
            column = columns[name]
            hit = subsets.get(name)
            if all_small:
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
        scattered = [name for name in program.targets if ws.direct[name] is None]
        units.append(ws.flat)

        def launch():
            for name in gathered:
                torch._foreach_copy_(ws.views[name], members[name])
            execute(units)
            for name in scattered:
                torch._foreach_copy_(members[name], ws.views[name])

        return launch
