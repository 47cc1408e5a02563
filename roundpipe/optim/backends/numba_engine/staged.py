"""The passes of a staged step (``spec/staged.py``: Adafactor, Muon) on the numba engine:
``prepare`` compiles a pass's kernel (``staged_source``) once per variant, lays its parameters
out (``staged_layout``) and returns the launch, which a later step of the same tensors rebinds
(``_Launch``). What the kernels must reproduce is probed in ``staged_probes``.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ...spec.ir import Reduce
from .. import CompileCache
from ..formulas import lerp_variant, lerp_weights
from . import config
from .config import PARALLEL_MIN_NUMEL, ROOT_INTRINSICS, import_numba
from .kernels import jit_module, keep_torch_threads
from .probes import find_root_kind
from .staged_layout import column_norms_reproduced, matrix_dims, pack_scalar_rows, thread_schedule, work_items
from .staged_source import clamped_quotients, floor_variant, generate

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


_kernels = CompileCache()
_compiled: set = set()  # the dispatchers called once (compiled or loaded), by identity
_parallel: set = set()  # the parallel ones


def compile_pass(program, variant, fused, dtypes, lanes, order, floors=()):
    """``(dispatcher, scalar names, constants)`` for a pass; compiled once per process (and
    kept in the disk cache, as the engine's kernels are)."""
    root = root_kind()
    key = (program, variant, fused, tuple(dtypes.values()), lanes, order, floors, root)
    return _kernels.get(key, lambda: _compile(program, variant, fused, dtypes, lanes, order, floors, root))


def _compile(program, variant, fused, dtypes, lanes, order, floors, root):
    source, names, consts = generate(program, variant, fused, dtypes, lanes, order, floors, root)
    parallel, serial, _ = jit_module(import_numba(), "roundpipe_staged_", source)
    _parallel.add(parallel)
    return (parallel, serial), names, consts


_root = None
_root_lock = threading.Lock()


def root_kind() -> str:
    """How this process's staged kernels take ``rsqrt`` (``config.ROOT_KINDS``): ``divider``
    unless ``config.EXACT_ROOT``, then probed once (``probes.find_root_kind``) with a kernel that
    runs each candidate's intrinsic alone."""
    global _root
    if _root is None:
        with _root_lock:
            if _root is None:
                _root = find_root_kind(_run_root) if config.EXACT_ROOT else "divider"
    return _root


def _run_root(kind, x, out):
    """Runs ``kind``'s exact rsqrt on the float32 tensor ``x`` into ``out`` (in chunks as the
    kernels take them, the last one short)."""
    intrinsic = ROOT_INTRINSICS[kind]
    # (jit_module wants both kernels; only the serial one is compiled)
    kernels = [
        [
            "",
            "",
            f"def kernel_{name}(src, dst, n):",
            "    for start in range(0, n, 512):",
            f"        {intrinsic}(src + 4 * start, dst + 4 * start, min(512, n - start))",
        ]
        for name in ("parallel", "serial")
    ]
    header = [
        f"# exact rsqrt probe of {__name__}, root {kind}",
        f"from {__package__}.exact_root import {intrinsic}",
    ]
    source = "\n".join([*header, *kernels[0], *kernels[1], ""])
    _, serial, _ = jit_module(import_numba(), "roundpipe_root_", source)
    serial(x.data_ptr(), out.data_ptr(), x.numel())


_LAYOUTS_KEPT = 16  # a launch's cache keeps a few layouts (the last steps' shapes)


def _layout(program, dispatchers, members, tensors, shaped, nthreads, cache):
    """``(dispatcher, items, addresses, dims)`` of a launch over ``members``, kept in the
    launch's ``cache`` (the step plan's, per pass) by the addresses and shapes of every tensor
    but the gradients, whose addresses are written in afresh (a new gradient each step is the
    rule): a step that repeats the last one skips building them, which is most of what a step
    of one small parameter costs."""
    names = program.tensors
    fixed = [r for r, t in enumerate(names) if t != "grad"]
    ptrs = tuple([tensors[k][names[r]].data_ptr() for r in fixed for k in members])
    shapes = tuple([tensors[k][shaped].shape for k in members])
    key = (dispatchers, nthreads, ptrs, shapes)
    hit = cache.get(key)
    if hit is None:
        addresses = np.asarray(
            [[tensors[k][t].data_ptr() for k in members] for t in names], dtype=np.int64
        ).reshape(len(names), len(members))
        dims = np.asarray([matrix_dims(tensors[k][shaped]) for k in members], dtype=np.int64).reshape(-1, 3)
        numel = sum(tensors[k][shaped].numel() for k in members)
        # (a reducing pass shares out whole parameters; either way a thread must get enough
        # elements to be worth waking, which on a busy machine means waiting for a core)
        share = numel // PARALLEL_MIN_NUMEL
        if program.reductions:
            share = min(len(members), share)
        dispatcher = dispatchers[0] if min(nthreads, share) > 1 else dispatchers[1]
        if program.reductions:
            items = thread_schedule(dims, nthreads if dispatcher is dispatchers[0] else 1)
        else:
            items = work_items(dims)
        if len(cache) >= _LAYOUTS_KEPT:
            cache.clear()
        hit = cache[key] = (dispatcher, items, addresses, dims)
    elif "grad" in names:
        hit[2][names.index("grad")] = [tensors[k]["grad"].data_ptr() for k in members]
    return hit


_abouts: dict = {}


def _about(program) -> tuple:
    """``(shaped, column_norms, reductions, lerp weights, floors)`` of a pass's program: the first
    tensor of the parameter's shape, whether it takes column norms, its ``(name, dim)`` norms in
    order, ``lerp_weights`` and ``clamped_quotients`` (one lookup a launch)."""
    hit = _abouts.get(program)
    if hit is None:
        shaped = next(t for t in program.tensors if t not in dict(program.kinds))
        reduces = tuple((st.name, st.dim) for st in program.statements if isinstance(st, Reduce))
        column_norms = any(dim == -2 for _, dim in reduces)
        hit = (shaped, column_norms, reduces, lerp_weights(program), clamped_quotients(program))
        _abouts[program] = hit
    return hit


def prepare(program, scalars, tensors, fused, lanes, order, nthreads, fallback=None, cache=None):
    """The launch of a pass (``Backend.prepare_staged``) on the numba engine. Parameters whose
    tensors it cannot read (not contiguous, dtypes that differ between parameters) or whose
    reductions it does not reproduce (``column_norms_reproduced``) run
    ``fallback(program, scalars, tensors)`` (torch's ops) in the same launch; without one, such
    a pass is refused (None). ``cache``: the pass's own dict, kept by the caller between steps:
    ``variants`` (per kernel variant its kernel, layouts and norm buffers) and ``replay`` (the
    last launch, where a repeat can rebind it: ``_Launch``)."""
    numba = import_numba()
    cache = {} if cache is None else cache
    if not tensors:
        return list
    replay = cache.get("replay")
    if replay is not None and replay.rebind(scalars, tensors, (fused, lanes, order, nthreads)):
        return replay
    names = program.tensors
    first = tensors[0]
    dtypes = {t: _DTYPES.get(first[t].dtype) for t in names}
    kinds = tuple(first[t].dtype for t in names)
    shaped, column_norms, reduces, weights, floors = _about(program)
    ours, others = [], []
    for k, ts in enumerate(tensors):
        column = [ts[t] for t in names]
        ok = (
            tuple([t.dtype for t in column]) == kinds
            and all([t.is_contiguous() for t in column])
            and (not column_norms or column_norms_reproduced(matrix_dims(ts[shaped])))
        )
        (ours if ok else others).append(k)
    if None in dtypes.values():
        ours, others = [], list(range(len(tensors)))
    if others and fallback is None:
        return None
    by_variant: dict = {}
    if weights or floors:
        for k in ours:
            key = (lerp_variant(scalars[k], weights), floor_variant(scalars[k], floors))
            by_variant.setdefault(key, []).append(k)
    elif ours:
        by_variant[((), ())] = ours
    calls, outs = [], [dict() for _ in tensors]
    wholes = []  # (buffer, reduction name, members): whole-tensor norms, as floats after the launch
    variants = cache.setdefault("variants", {})  # a kernel's variant -> what its launches keep
    for variant, members in by_variant.items():
        launch_cache = variants.get(variant)
        kernel_key = (fused, kinds, lanes, order)
        if launch_cache is None or launch_cache["kernel key"] != kernel_key:
            launch_cache = variants[variant] = {"kernel key": kernel_key, "layouts": {}}
            lerps, normal_floors = variant
            launch_cache["kernel"] = compile_pass(program, lerps, fused, dtypes, lanes, order, normal_floors)
        dispatchers, row_names, consts = launch_cache["kernel"]
        dispatcher, items, addresses, dims = _layout(
            program, dispatchers, members, tensors, shaped, nthreads, launch_cache["layouts"]
        )
        scalar_rows = pack_scalar_rows(row_names, consts, [scalars[k] for k in members])
        out_ptrs = np.zeros((len(program.reductions), len(members)), dtype=np.int64)
        for r, (name, dim) in enumerate(reduces):
            if dim is None:
                # whole-tensor norms, read back as floats after the launch: a buffer kept with the
                # launch's cache (a step's passes run one after another)
                buffer = launch_cache.get(("norms", r))
                if buffer is None or len(buffer) != len(members):
                    buffer = launch_cache[("norms", r)] = np.empty(len(members), dtype=np.float32)
                at = buffer.__array_interface__["data"][0]
                out_ptrs[r] = at if len(members) == 1 else at + 4 * np.arange(len(members), dtype=np.int64)
                wholes.append((buffer, name, members))
                continue
            for c, k in enumerate(members):
                t = tensors[k][shaped]
                if dim == -1:
                    out = torch.empty((*t.shape[:-1], 1), dtype=torch.float32)
                else:
                    out = torch.zeros((*t.shape[:-2], 1, t.shape[-1]), dtype=torch.float32)
                out_ptrs[r, c] = out.data_ptr()
                outs[k][name] = out
        calls.append((dispatcher, items, addresses, dims, scalar_rows, out_ptrs))
    for dispatcher, items, addresses, _dims, scalar_rows, out_ptrs in calls:
        if dispatcher not in _compiled:  # compile (or load) now: a launch cannot fail later
            with keep_torch_threads():  # (a first parallel call starts numba's pool)
                dispatcher(items[:0], addresses, np.zeros((0, 3), np.int64), scalar_rows, out_ptrs)
            _compiled.add(dispatcher)
    launch = _Launch(numba, nthreads, calls, wholes, outs, others, fallback, program, scalars, tensors)
    cache.pop("replay", None)
    if len(by_variant) == 1 and not others and all(dim is None for _, dim in reduces):
        (variant,) = by_variant
        row_layout = variants[variant]["kernel"][1:]  # (row names, constants)
        launch.replayable(program, variant, (fused, lanes, order, nthreads), kinds, tensors, row_layout)
        cache["replay"] = launch
    return launch


class _Launch:
    """A prepared pass: ``launch()`` runs it and returns each parameter's reductions.

    One that a later step can repeat (one kernel for every parameter, whole-tensor norms only:
    Adafactor's vectors, Muon's first pass) is kept in the launch's cache; the next ``prepare``
    then only checks that the same tensors come in (the same objects at the same addresses, new
    gradients of the same dtype, contiguous) and that every parameter takes the same kernel, and
    writes the new scalars and gradient addresses in (``rebind``): a step of a one-parameter
    optimizer was mostly this bookkeeping."""

    def __init__(self, numba, nthreads, calls, wholes, outs, others, fallback, program, scalars, tensors):
        self.numba, self.nthreads, self.calls, self.wholes = numba, nthreads, calls, wholes
        self.outs, self.others, self.fallback, self.program = outs, others, fallback, program
        self.rest = [scalars[k] for k in others], [tensors[k] for k in others]
        self.parallel = any(call[0] in _parallel for call in calls)
        self.key = None

    def replayable(self, program, variant, key, kinds, tensors, row_layout):
        names = program.tensors
        self.key, self.variant, self.size, self.row_layout = key, variant, len(tensors), row_layout
        self.weights, self.floors = _about(program)[3:]
        self.grad = names.index("grad") if "grad" in names else None
        self.grad_dtype = kinds[self.grad] if self.grad is not None else None
        self.fixed = [n for n in names if n != "grad"]
        # the tensors a repeat must be handed again, and where their data was
        self.held = [[ts[n] for n in self.fixed] for ts in tensors]
        self.ptrs = [[t.data_ptr() for t in column] for column in self.held]

    def rebind(self, scalars, tensors, key) -> bool:
        """Take this step's scalars and gradients, if the launch repeats (see the class)."""
        if key != self.key or len(tensors) != self.size:
            return False
        fixed, weights, floors, variant = self.fixed, self.weights, self.floors, self.variant
        for ts, held, ptrs, sc in zip(tensors, self.held, self.ptrs, scalars, strict=True):
            for n, t, ptr in zip(fixed, held, ptrs, strict=True):
                if ts[n] is not t or t.data_ptr() != ptr:
                    return False
            if (weights or floors) and (lerp_variant(sc, weights), floor_variant(sc, floors)) != variant:
                return False
        dispatcher, items, addresses, dims, _rows, out_ptrs = self.calls[0]
        if self.grad is not None:
            grads = [ts["grad"] for ts in tensors]
            if not all([g.dtype is self.grad_dtype and g.is_contiguous() for g in grads]):
                return False
            if len(grads) == 1:
                addresses[self.grad, 0] = grads[0].data_ptr()
            else:
                addresses[self.grad] = [g.data_ptr() for g in grads]
        rows = pack_scalar_rows(*self.row_layout, scalars)
        self.calls[0] = (dispatcher, items, addresses, dims, rows, out_ptrs)
        self.outs = [{} for _ in tensors]
        return True

    def __call__(self):
        calls = self.calls
        if self.parallel:
            torch_threads = torch.get_num_threads()
            try:
                if self.numba.get_num_threads() != self.nthreads:
                    self.numba.set_num_threads(self.nthreads)
                for dispatcher, items, addresses, dims, scalar_rows, out_ptrs in calls:
                    dispatcher(items, addresses, dims, scalar_rows, out_ptrs)
            finally:
                if torch.get_num_threads() != torch_threads:  # numba's pool sets OpenMP's count
                    torch.set_num_threads(torch_threads)
        else:
            for dispatcher, items, addresses, dims, scalar_rows, out_ptrs in calls:
                dispatcher(items, addresses, dims, scalar_rows, out_ptrs)
        results = self.outs
        for buffer, name, members in self.wholes:
            for k, value in zip(members, buffer.tolist(), strict=True):
                results[k][name] = value
        if self.others:
            for k, reduced in zip(self.others, self.fallback(self.program, *self.rest), strict=True):
                results[k] = reduced
        return results


def as_tensor(norm) -> torch.Tensor:
    """A reduction as a float32 tensor (a whole-tensor norm comes back as a float)."""
    return norm if isinstance(norm, torch.Tensor) else torch.tensor(norm, dtype=torch.float32)
