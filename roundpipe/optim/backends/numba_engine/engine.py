"""The engine: a step's launches prepared (kernels compiled, the address table and the layout
built, the scalars' rows written) and run; and the record of the last launch, which a replay
repeats (``LaunchRecord``).

Everything that can fail happens in ``prepare``, before a step writes anything; the launch it
returns only runs the kernels. A launch's table lives in the step plan's cache of one
optimizer, so it is never shared between threads.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from ... import threads
from ...tensors import LOW_PRECISION
from .. import pairing_of, segments
from ..formulas import lerp_variant, lerp_weights, scalar_env
from ..low_precision import rounding
from .config import PARALLEL_MIN_NUMEL, import_numba
from .kernels import NumbaKernel, compile_kernel, keep_torch_threads, sqrt_kind
from .layout import AddressTable
from .probes import torch_fusion, torch_sqrt

logger = logging.getLogger("roundpipe.optim")

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_F32_ONE = np.float32(1.0)


class KernelCompileError(RuntimeError):
    """A program's kernel could not be generated or compiled (the cause is chained)."""


class NumbaEngine:
    """Runs spec programs as compiled kernels (``fast``'s default engine)."""

    name = "numba"

    def __init__(self):
        self._numba = import_numba()
        self.fused, fusion_exact = torch_fusion()
        self.sqrt_routine, self.sqrt_what, sqrt_exact = torch_sqrt()
        self.sqrt_kind = sqrt_kind()
        # bit for bit torch.optim's for-loop for every program
        self.exact = fusion_exact and sqrt_exact
        logger.debug(
            "numba engine: numba %s, threading layer asked for %s, fused multiply-adds in %s, sqrt %s (%s)",
            self._numba.__version__,
            self._numba.config.THREADING_LAYER,
            sorted(self.fused),
            self.sqrt_what,
            self.sqrt_kind,
        )

    def kernel(self, program, variant, dtype_names=("float32", None), low=None, stored=()) -> NumbaKernel:
        return compile_kernel(program, variant, self.fused, self.sqrt_kind, dtype_names, low, stored)

    def exact_for(self, dtype) -> bool:
        """Whether its kernels are bit for bit torch's for-loop on parameters of ``dtype``
        (bfloat16, float16: where ``low_precision.rounding`` found torch's formulas)."""
        return rounding(dtype).exact if dtype in LOW_PRECISION else self.exact

    def prepare(self, program, scalars, columns, cache):
        """Everything a launch over ``columns`` needs (kernels compiled, the address table, the
        scalars' rows, the layout), or an exception; returns ``launch()``, which only runs the
        kernels. See ``backend_api``."""
        params = columns["param"]
        weights = lerp_weights(program)
        by_variant: dict = {}
        for values, start, stop in segments(scalars, len(params)):
            by_variant.setdefault(lerp_variant(values, weights), []).append((values, start, stop))
        # (a program stored widened computes in float32 whatever its tensors' dtypes)
        low = None if program.storage else _low(params)
        dtype_names = _dtype_names(columns) if low is None else ("float32", None)
        stored = _stored(program, columns)
        table = self._table(program, columns, cache)
        if table.total == 0:
            table.release_volatile()
            return _nothing
        nthreads = self._threads(table.total)
        torch_threads = torch.get_num_threads()  # (where the for-loop's tails are)
        calls = []
        compiled = cache.setdefault("compiled", {})  # (variant, parallel) -> (kernel, dispatcher)
        for variant, parts in by_variant.items():
            hit = compiled.get((variant, nthreads > 1))
            try:
                kernel = hit[0] if hit else self.kernel(program, variant, dtype_names, low, stored)
                rows, scalar_rows = self._rows(kernel, parts, len(params), weights, cache)
                if hit is None:
                    with keep_torch_threads():  # a first parallel call starts numba's pool
                        dispatcher = kernel.ensure_compiled(nthreads > 1, table.addresses, scalar_rows)
                    hit = compiled[(variant, nthreads > 1)] = (kernel, dispatcher)
                    if nthreads > 1:
                        _log_threading_once()
            except Exception as err:  # not KeyboardInterrupt: that propagates as itself
                raise KernelCompileError(f"cannot compile the kernel of this program: {err}") from err
            calls.append((hit[1], table.layout(nthreads, rows, hit[0].tails(torch_threads)), scalar_rows))
        launch = _launcher(self._numba, nthreads, calls, table, self.sqrt_routine)
        if len(calls) == 1 and type(scalars) is dict:
            record = self._record(weights, variant, nthreads, table, hit[0], calls[0], launch)
            cache["replay"] = record
            if hit[0].source.tails:
                record.torch_threads = torch_threads
        else:
            cache.pop("replay", None)
        return launch

    def run(self, program, scalars, columns, cache=None):
        """``prepare`` then launch (for tools and tests)."""
        self.prepare(program, scalars, columns, {} if cache is None else cache)()

    @staticmethod
    def _table(program, columns, cache) -> AddressTable:
        """The launch's address table (kept in ``cache`` while the parameters are the same),
        with every column's row up to date."""
        params = columns["param"]
        grad_dtype, partner_dtype = pairing_of(columns)
        names = (*program.tensors, "partner") if partner_dtype is not None else program.tensors
        if "sr_ids" in columns:  # each parameter's id, in the row after the tensors'
            names = (*names, "sr_ids")
        table = cache.get("table")
        if table is None or table.names != names or table.params is not params:
            if program.storage:  # each tensor of its own dtype
                dtypes = {n: columns[n][0].dtype for n in names if n != "sr_ids" and len(columns[n])}
            elif _low(params) is not None:  # every tensor of the parameter's dtype
                dtypes = dict.fromkeys(names, params[0].dtype)
            else:
                dtypes = {"grad": grad_dtype, "partner": partner_dtype}
            table = cache["table"] = AddressTable(names, params, dtypes)
        for r, name in enumerate(names):
            table.update(r, columns[name])
        return table

    def _record(self, weights, variant, nthreads, table, kernel, call, launch):
        """What the next step needs to repeat this launch (one kernel call) with new scalars
        and gradients: its ``direct_call`` is, on one thread, the serial kernel's call itself
        (its gradient row is refreshed in place), else the launch."""
        if nthreads == 1:
            dispatcher, layout, scalar_rows = call
            direct_call = functools.partial(
                dispatcher, 1, layout, table.addresses, scalar_rows, self.sqrt_routine
            )
        else:
            direct_call = launch
        return LaunchRecord(weights, variant, nthreads, table, kernel, call[2], direct_call)

    @staticmethod
    def _rows(kernel, parts, n, weights, cache):
        """``(rows, scalar_rows)``: each parameter's row (-1: in no segment) and the rows, one
        per segment of scalars."""
        if len(parts) == 1 and parts[0][1] == 0 and parts[0][2] == n:
            rows = cache.get("all_row_0")
            if rows is None or len(rows) != n:
                rows = cache["all_row_0"] = np.zeros(n, dtype=np.int64)
            scalar_rows = np.asarray([kernel.scalar_row(scalar_env(parts[0][0], weights))], dtype=np.float32)
            return rows, scalar_rows
        rows = np.full(n, -1, dtype=np.int64)
        scalar_rows = []
        for k, (values, start, stop) in enumerate(parts):
            rows[start:stop] = k
            scalar_rows.append(kernel.scalar_row(scalar_env(values, weights)))
        return rows, np.asarray(scalar_rows, dtype=np.float32)

    @property
    def max_threads(self) -> int:
        """The most threads a kernel can run on (numba's pool: ``NUMBA_NUM_THREADS``)."""
        return self._numba.config.NUMBA_NUM_THREADS

    def _threads(self, total: int) -> int:
        n = min(threads.get_num_threads(), self._numba.config.NUMBA_NUM_THREADS, total // PARALLEL_MIN_NUMEL)
        return max(1, n)


_logged_threading = []  # (process-wide; a race logs twice at worst)


def _log_threading_once():
    """Say in the debug log, once a process, which threading layer and OpenMP runtime run the
    parallel kernels (their pool has just started)."""
    if not _logged_threading and logger.isEnabledFor(logging.DEBUG):
        _logged_threading.append(True)
        logger.debug("numba engine: parallel kernels on %s", threads.threading_report()["summary"])


def _low(params):
    """The ``low_precision.Rounding`` of bfloat16 or float16 parameters (None: float32)."""
    if params and params[0].dtype in LOW_PRECISION:
        found = rounding(params[0].dtype)
        if found.dtype not in _logged_rounding and logger.isEnabledFor(logging.DEBUG):
            _logged_rounding.add(found.dtype)
            logger.debug(
                "numba engine: %s parameters, each op rounded as torch's kernels round it: %s (%s)",
                found.name,
                found.what,
                "bit for bit torch" if found.exact else "not every formula known: within assert_close",
            )
        return found
    return None


_logged_rounding: set = set()  # (process-wide; a race logs twice at worst)


def _stored(program, columns) -> tuple:
    """A program stored widened: ``(tensor, dtype name)`` of each of its 16-bit columns, as
    ``codegen.generate`` takes them (``()`` for another program)."""
    if not program.storage:
        return ()
    return tuple(
        (n, _DTYPE_NAMES[c[0].dtype])
        for n, c in columns.items()
        if n != "sr_ids" and len(c) and c[0].dtype in LOW_PRECISION
    )


def _dtype_names(columns) -> tuple:
    """``(grad dtype, partner dtype or None)`` by name, as ``codegen.generate`` takes them."""
    grad_dtype, partner_dtype = pairing_of(columns)
    return _DTYPE_NAMES[grad_dtype], None if partner_dtype is None else _DTYPE_NAMES[partner_dtype]


def _launcher(numba, nthreads, calls, table, sqrt_routine):
    """The launch: each ``(dispatcher, layout, scalar_rows)`` of ``calls`` run on ``nthreads``."""
    addresses = table.addresses
    release = table.release_volatile
    if nthreads == 1:
        # the serial kernels: numba's pool (and with it the OpenMP thread count) is not touched
        def launch():
            try:
                for dispatcher, layout, scalar_rows in calls:
                    dispatcher(1, layout, addresses, scalar_rows, sqrt_routine)
            finally:
                release()

        return launch
    get_torch_threads = torch.get_num_threads

    def launch():
        torch_threads = get_torch_threads()
        try:
            if numba.get_num_threads() != nthreads:
                numba.set_num_threads(nthreads)  # thread-local in numba
            for dispatcher, layout, scalar_rows in calls:
                dispatcher(nthreads, layout, addresses, scalar_rows, sqrt_routine)
        finally:
            release()
            if get_torch_threads() != torch_threads:  # see keep_torch_threads
                torch.set_num_threads(torch_threads)

    return launch


def _nothing():
    pass


_VARIANTS: dict = {}


class LaunchRecord:
    """The last launch of one program over one segment of scalars, kept for a replay (in the
    plan's cache, so one optimizer's: never shared between threads): the handle the fast
    backend's ``replay_handle`` gives. When the lerp variant and the thread count are the same,
    a replayed step writes its scalars into ``scalar_rows`` and its gradients' addresses."""

    # (what rebind reads first, together: fewer cache lines)
    __slots__ = (
        "weights",
        "variant",
        "nthreads",
        "torch_threads",
        "total",
        "names",
        "complements",
        "grad_addresses",
        "scalar_rows",
        "direct_call",
    )

    def __init__(self, weights, variant, nthreads, table, kernel, scalar_rows, direct_call):
        self.weights = weights
        self.variant = _VARIANTS.setdefault(variant, variant)  # shared: one object less to read
        self.nthreads = nthreads
        # a kernel whose formulas take torch's tails apart: torch's thread count they were cut for
        self.torch_threads = None
        self.scalar_rows = scalar_rows
        # rebind's launch: the kernel's call without the table's bookkeeping (a step of
        # one small parameter pays for every object it touches: they are out of cache by the
        # time the next step of the same optimizer comes)
        self.direct_call = direct_call
        self.grad_addresses = table.addresses[table.grad_row] if table.grad_row is not None else None
        self.total = table.total
        # the row's scalars (scalar_env's variables, in the kernel's order)
        self.names, self.complements = kernel.row_layout(weights)

    def rebind(self, engine, scalars, grads):
        """The launch with new scalars and gradients (a ``Checked`` column), or None when it
        needs another kernel or thread count (the full prepare runs)."""
        row = self._scalar_row(engine, scalars)
        if row is None:
            return None
        # (not kept in the table: its launch would drop the reference again)
        self.grad_addresses[:] = [t.data_ptr() for t in grads]
        self.scalar_rows[0, : len(row)] = row
        return self.direct_call

    def _scalar_row(self, engine, scalars):
        """This step's row of scalars, or None when it needs another kernel or thread count.
        (The previous step's launch has run: a plan steps in one thread.)"""
        weights = self.weights
        if weights and lerp_variant(scalars, weights) != self.variant:
            return None
        if engine._threads(self.total) != self.nthreads:
            return None
        if self.torch_threads is not None and torch.get_num_threads() != self.torch_threads:
            return None
        # what scalar_env() and scalar_row() compute, without their dicts (KeyError: a scalar is
        # missing, as there); float32 on assignment to ``scalar_rows``, as scalar_env's
        row = [0.0 if n is None else scalars[n] for n in self.names]
        for pos, w in self.complements:
            row[pos] = np.float32(scalars[w]) - _F32_ONE
        return row
