"""The passes of a staged step (``spec/staged.py``: Adafactor, Muon), compiled.

A pass program is either *elementwise* (it assigns; no ``norm``) or *reducing* (it has ``norm``
statements and assigns nothing). Each becomes one kernel over every parameter of the pass:

* an elementwise kernel runs ``items`` (a parameter's rows, or a piece of its one row) on every
  thread (``prange``), the inner loop along a row, so LLVM vectorizes it;
* a reducing kernel runs each parameter on one thread (``prange`` over parameters): torch's
  reductions are sequential in their lanes (``probes.torch_reductions``), and a result must not
  depend on the thread count. The whole-tensor norm accumulates ``lanes`` float32 sums over the
  elements in order, adds them up, then the last ``numel % lanes`` squares one by one; a row norm
  (``dim=-1``) the same along each row; a column norm (``dim=-2``) one sum per column down the
  rows. Each sum is then rooted (correctly rounded, as ``std::sqrt``).

Broadcast inputs are read at the element's row (``rows``), column (``cols``) or matrix
(``matrices``). Every formula is ``formulas.Lowering``'s (torch's rounding); ``rsqrt`` is
``1 / sqrt`` with a correctly rounded root, as ATen's kernel computes it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...spec.ir import Assign, Bin, Call, Let, Reduce, Scalar, Tensor, walk
from .. import CompileCache
from ..formulas import Lowering, lerp_variant, lerp_weights
from ..numba_engine.config import GENERATOR_VERSION, PARALLEL_MIN_NUMEL, import_numba
from ..numba_engine.kernels import jit_module, keep_torch_threads

_PACKAGE = "roundpipe.optim.backends.numba_engine"
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# an elementwise kernel's items: at least this many elements each, where a parameter has them
ITEM_NUMEL = 1 << 16


# the smallest normal float32: a quotient at least this large (or zero, infinite, NaN) is the
# same through a float64 reciprocal as through a float32 division (``clamped_quotients``)
_MIN_NORMAL = 2.0**-126


@functools.lru_cache(maxsize=256)
def clamped_quotients(program) -> tuple:
    """The scalar floors ``lo`` of the program's ``clamp_min(a / t, lo)``, ``t`` a broadcast input
    of one value per matrix (Adafactor's ``row_scale``), in order of first use.

    Where the launch's float32 ``lo`` is at least the smallest normal float32, such a quotient is
    computed as ``float32(float64(a) * (1 / float64(t)))``, the reciprocal taken once per row: a
    quotient of two float32 is never within 2**-49 (relative) of a float32 midpoint (its odd
    part would need 25 bits), further than the float64 product's error (2**-52), so every
    normal result, zero, infinity and NaN is the correctly rounded one; a subnormal one may
    differ, and the clamp takes both to ``lo``. Multiplying costs a fraction of a float32
    division, the pass's dearest operation after the root."""
    shapes = dict(program.shapes)
    floors = []
    for st in program.statements:
        for node in walk(st.expr):
            if isinstance(node, Call) and node.fn == "clamp_min" and _clamped_quotient(*node.args, shapes):
                if node.args[1].name not in floors:
                    floors.append(node.args[1].name)
    return tuple(floors)


def _clamped_quotient(x, lo, shapes) -> bool:
    """Whether ``clamp_min(x, lo)`` is ``clamp_min(a / t, scalar)``, ``t`` one value per matrix."""
    return (
        isinstance(lo, Scalar)
        and isinstance(x, Bin)
        and x.op == "/"
        and isinstance(x.b, Tensor)
        and shapes.get(x.b.name) == "matrices"
    )


def floor_variant(scalars: dict, floors) -> tuple:
    """Which of ``clamped_quotients``' floors are at least the smallest normal float32 (compared
    in float32, as the kernel reads them; a NaN is not)."""
    return tuple([bool(np.float32(scalars[f]) >= _MIN_NORMAL) for f in floors])


class _Dialect(Lowering):
    """Formulas as numba source over the element's locals (``names``)."""

    def __init__(self, program, variant, fused, floors=()):
        super().__init__(program, variant, fused)
        self.names: dict = {}
        self.uses_fma = False
        self.shapes = dict(program.shapes)
        self.normal_floors = {f for f, ok in zip(clamped_quotients(program), floors, strict=True) if ok}
        self.reciprocals: list = []  # broadcast inputs read as a float64 reciprocal, once per row

    def tensor(self, name):
        return self.names[name]

    def select(self, cond, a, b):
        return f"({a} if {cond} else {b})"

    def either(self, x, y):
        return f"(({x}) or ({y}))"

    def sqrt(self, x):
        raise NotImplementedError("torch.sqrt (MKL's routine) in a staged pass")

    def correct_sqrt(self, x):
        return f"np.sqrt({x})"

    def fma(self, a, b, c):
        self.uses_fma = True
        return f"fma({a}, {b}, {c})"

    def fn_clamp_min(self, x, lo):
        if not (_clamped_quotient(x, lo, self.shapes) and lo.name in self.normal_floors):
            return super().fn_clamp_min(x, lo)
        t = x.b.name
        if t not in self.reciprocals:
            self.reciprocals.append(t)
        q = f"np.float32(np.float64({self(x.a)}) * rcp_{t})"
        lo = self.scalar(lo.name)
        return self.select(f"{q} < {lo}", lo, q)


def _element_code(program, dialect, dtypes, index, loads):
    """Lines computing one element: loads (``loads``: tensor -> index expression), then the
    statements; ``(lines, stores, reduced)``, ``reduced`` mapping each norm to its value."""
    lines, stores, reduced = [], [], {}
    for t in program.tensors:
        var = f"x_{t}"
        element = f"v_{t}[{loads.get(t, index)}]"
        dtype = dtypes[t]
        lines.append(f"{var} = widen_{dtype}({element})" if dtype != "float32" else f"{var} = {element}")
        dialect.names[t] = var
    for n, st in enumerate(program.statements):
        code = dialect(st.expr)
        if isinstance(st, Let):
            var = f"l{n}_{st.name}"
            dialect.names[st.name] = var
        elif isinstance(st, Assign):
            var = f"a{n}_{st.target}"
            dialect.names[st.target] = var
        else:
            var = f"r{n}_{st.name}"
            reduced[st.name] = var
        lines.append(f"{var} = {code}")
    for t in program.targets:
        dtype = dtypes[t]
        value = dialect.names[t]
        stores.append(
            f"v_{t}[{loads.get(t, index)}] = " + (f"narrow_{dtype}({value})" if dtype != "float32" else value)
        )
    return lines, stores, reduced


def _indent(lines, depth):
    return ["    " * depth + line for line in lines]


def _views(program, shapes, dtypes):
    """Each tensor as a raw pointer: indexing one has no negative-index wraparound, which would
    keep LLVM from vectorizing the loops."""
    lines = []
    for k, t in enumerate(program.tensors):
        ptr = "f32ptr" if dtypes[t] == "float32" else "u16ptr"
        lines.append(f"v_{t} = {ptr}(addresses[{k}, p])")
    return lines


def _loads(shapes):
    where = {"rows": "r", "cols": "b * n + j", "matrices": "b"}
    return {t: where[kind] for t, kind in shapes.items()}


def _setup(names):
    return [
        "nb = dims[p, 0]",
        "m = dims[p, 1]",
        "n = dims[p, 2]",
        "rows = nb * m",
        *(f"{name} = scalar_rows[p, {k}]" for k, name in enumerate(names)),
    ]


def generate(program, variant, fused, dtypes, lanes=8, order=(False, True), floors=()):
    """``(source, row names, constants)`` of ``program``'s kernel, ``kernel(...)``; ``floors``:
    ``floor_variant`` of the launch's scalars."""
    dialect = _Dialect(program, variant, fused, floors)
    shapes = dict(program.shapes)
    loads = _loads(shapes)
    body, stores, reduced = _element_code(program, dialect, dtypes, "i", loads)
    names = (*sorted(dialect.scalars), *sorted(dialect.consts))
    views = _views(program, shapes, dtypes)
    # per row: the reciprocals of a matrix's broadcast values (``clamped_quotients``)
    per_row = [f"rcp_{t} = 1.0 / np.float64(v_{t}[{loads[t]}])" for t in dialect.reciprocals]
    if program.reductions:
        if program.targets:
            raise ValueError("a staged pass either assigns or reduces")
        kernel = _reducing(program, body, reduced, lanes, order, names, views, per_row)
    else:
        kernel = _elementwise(body, stores, names, views, per_row)
    low = sorted({d for d in dtypes.values() if d != "float32"})
    conversions = [f"{w}_{d}" for d in low for w in ("widen", "narrow")]
    lines = [
        f"# Generated by {_PACKAGE}.staged (do not edit), generator version {GENERATOR_VERSION}:",
        *(f"#   {line}" for line in str(program).splitlines()),
        f"# lerp variant {tuple(variant)!r}, normal floors {tuple(floors)!r}, "
        f"fused {sorted(dialect.fused)!r}, lanes {lanes}, "
        f"(column fma, tail fma) {order}, dtypes {sorted(dtypes.items())!r}",
        "import numpy as np",
        "from numba import prange",
        f"from {_PACKAGE}.intrinsics import f32ptr, u16ptr, fma, lane_add8, lane_add16, wide_vectors",
        *([f"from {_PACKAGE}.conversions import {', '.join(conversions)}"] if conversions else []),
        "",
        "",
        *kernel,
    ]
    # the same loop with range: a launch too small to share out runs without waking numba's pool
    serial = [
        line.replace("def kernel_parallel(", "def kernel_serial(").replace(" in prange(", " in range(")
        for line in kernel
    ]
    lines += ["", *serial]
    consts = tuple(np.float32(dialect.consts[c]) for c in sorted(dialect.consts))
    return "\n".join(lines) + "\n", tuple(sorted(dialect.scalars)), consts


def _elementwise(body, stores, names, views, per_row):
    """Items ``(p, r0, r1, j0, j1)``: rows ``[r0, r1)`` of parameter ``p``, columns ``[j0, j1)``."""
    return [
        "def kernel_parallel(items, addresses, dims, scalar_rows, outs):",
        "    for it in prange(items.shape[0]):",
        "        wide_vectors()",
        "        p = items[it, 0]",
        *_indent(_setup(names), 2),
        *_indent(views, 2),
        "        for r in range(items[it, 1], items[it, 2]):",
        "            b = r // m",
        *_indent(per_row, 3),
        "            for j in range(items[it, 3], items[it, 4]):",
        "                i = r * n + j",
        *_indent(body, 4),
        *_indent(stores, 4),
        "",
    ]


def _tail_step(acc, v, index, length, tail_fma):
    """The line adding the tail element ``index`` (of ``length``) to ``acc``: torch's tail loop
    is unrolled by four, and its last ``length % 4`` additions are fused where its kernels were
    built with FMA (``probes``: ``tail_fma``)."""
    if not tail_fma:
        return [f"{acc} = {acc} + ({v} * {v})"]
    return [
        f"if {index} >= 4 * ({length} // 4):",
        f"    {acc} = fma({v}, {v}, {acc})",
        "else:",
        f"    {acc} = {acc} + ({v} * {v})",
    ]


def _reducing(program, body, reduced, lanes, order, names, views, per_row):
    """One parameter a thread; the reductions in torch's order (see the module docstring).

    Where the lanes of the whole-tensor norm line up with each row's (rows a whole number of
    lanes long, or one row), a row is taken in blocks of ``BLOCK`` elements: a loop LLVM
    vectorizes computes each block's squares (and adds the column sums), then the lane sums
    take them in order. Elsewhere each element in turn (small matrices: ``(33, 17)``). A norm
    over one element is its absolute value, as torch's."""
    col_fma, tail_fma = order
    specs = [(st.name, st.dim) for st in program.statements if isinstance(st, Reduce)]
    init, square, lane_sums, tail, final, generic, row_start, row_finish, row_done = ([] for _ in range(9))
    for k, (name, dim) in enumerate(specs):
        v = reduced[name]
        sq = f"({v} * {v})"
        out = f"o{k}"
        init.append(f"{out} = f32ptr(outs[{k}, p])")
        if dim == -2:
            col = f"fma({v}, {v}, {out}[b * n + j])" if col_fma else f"{out}[b * n + j] + {sq}"
            # a column of one element: its absolute value, as torch's norm of one element
            for place in (square, tail, generic):
                place.append(f"{out}[b * n + j] = abs({v}) if m == 1 else {col}")
            final += ["if m != 1:", "    for c in range(nb * n):", f"        {out}[c] = np.sqrt({out}[c])"]
            continue
        acc = f"acc{k}" if dim is None else f"ra{k}"
        init += [f"{acc} = np.zeros({lanes}, np.float32)", f"sq{k} = np.empty(BLOCK, np.float32)"]
        square.append(f"sq{k}[q] = {sq}")
        lane_sums.append(f"lane_add{lanes}({acc}.ctypes.data, sq{k}.ctypes.data, count)")
        combine = [f"t{k} = {acc}[0]", f"for l in range(1, {lanes}):", f"    t{k} = t{k} + {acc}[l]"]
        if dim is None:
            init.append(f"tl{k} = np.zeros({lanes}, np.float32)")
            tail.append(f"tl{k}[j - cut] = {v}")
            generic += [
                "if i < fcut:",
                f"    {acc}[i % {lanes}] = {acc}[i % {lanes}] + {sq}",
                "else:",
                f"    tl{k}[i - fcut] = {v}",
            ]
            final += [
                *combine,
                "for q in range(total - fcut):",
                *_indent(_tail_step(f"t{k}", f"tl{k}[q]", "q", "(total - fcut)", tail_fma), 1),
                f"{out}[0] = abs(tl{k}[0]) if total == 1 else np.sqrt(t{k})",
            ]
        else:
            init += [f"rt{k} = np.float32(0.0)", f"rv{k} = np.float32(0.0)"]
            step = _tail_step(f"rt{k}", v, "(j - cut)", "(n - cut)", tail_fma)
            tail += [*step, f"rv{k} = {v}"]
            generic += [
                "if j < cut:",
                f"    {acc}[j % {lanes}] = {acc}[j % {lanes}] + {sq}",
                "else:",
                *_indent(step, 1),
                f"rv{k} = {v}",
            ]
            row_start += [f"for l in range({lanes}):", f"    {acc}[l] = np.float32(0.0)"]
            row_finish += [*combine, f"rt{k} = t{k}"]
            row_done.append(f"{out}[r] = abs(rv{k}) if n == 1 else np.sqrt(rt{k})")
    return [
        "BLOCK = 512",
        "",
        "",
        "def kernel_parallel(items, addresses, dims, scalar_rows, outs):",
        # items: one parameter (or -1, nothing) a row, each thread's share of rows holding the
        # parameters ``_schedule`` gave it
        "    for it in prange(items.shape[0]):",
        "      p = items[it, 0]",
        "      if p >= 0:",
        "       if True:",
        "        wide_vectors()",
        *_indent(_setup(names), 2),
        "        total = rows * n",
        f"        cut = n - n % {lanes}",
        f"        fcut = total - total % {lanes}",
        *_indent(views, 2),
        *_indent(init, 2),
        f"        aligned = n % {lanes} == 0 or rows == 1",
        "        for r in range(rows):",
        "            b = r // m",
        *_indent(per_row, 3),
        *_indent(row_start, 3),
        "            if aligned:",
        "                for start in range(0, cut, BLOCK):",
        "                    count = min(BLOCK, cut - start)",
        "                    for q in range(count):",
        "                        j = start + q",
        "                        i = r * n + j",
        *_indent(body, 6),
        *_indent(square, 6),
        *_indent(lane_sums, 5),
        *_indent(row_finish, 4),
        "                for j in range(cut, n):",
        "                    i = r * n + j",
        *_indent(body, 5),
        *_indent(tail, 5),
        "            else:",
        "                for j in range(n):",
        # a row's lanes are summed before its tail is added, as torch's loop does
        *(["                    if j == cut:"] + _indent(row_finish, 6) if row_finish else []),
        "                    i = r * n + j",
        *_indent(body, 5),
        *_indent(generic, 5),
        *(["                if cut == n:"] + _indent(row_finish, 5) if row_finish else []),
        *_indent(row_done, 3),
        *_indent(final, 2),
        "",
    ]


# -- compiling and launching ---------------------------------------------------------------------

_kernels = CompileCache()
_compiled: set = set()  # the dispatchers called once (compiled or loaded), by identity
_parallel: set = set()  # the parallel ones


def compile_pass(program, variant, fused, dtypes, lanes, order, floors=()):
    """``(dispatcher, scalar names, constants)`` for a pass; compiled once per process (and
    kept in the disk cache, as the engine's kernels are)."""
    key = (program, variant, fused, tuple(dtypes.values()), lanes, order, floors)
    return _kernels.get(key, lambda: _compile(program, variant, fused, dtypes, lanes, order, floors))


def _compile(program, variant, fused, dtypes, lanes, order, floors):
    source, names, consts = generate(program, variant, fused, dtypes, lanes, order, floors)
    parallel, serial, _ = jit_module(import_numba(), "roundpipe_staged_", source)
    _parallel.add(parallel)
    return (parallel, serial), names, consts


def matrix_dims(t) -> tuple:
    """``(matrices, rows, columns)`` of a parameter as a pass sees it: a tensor of two or more
    dimensions is a batch of matrices over its last two; anything else one row."""
    if t.dim() < 2:
        return 1, 1, t.numel()
    m, n = t.shape[-2], t.shape[-1]
    nb = 1
    for s in t.shape[:-2]:
        nb *= s
    return nb, m, n


def _items(dims) -> np.ndarray:
    """An elementwise kernel's items: ``(p, r0, r1, j0, j1)``, about ``ITEM_NUMEL`` elements."""
    items = []
    for p, (nb, m, n) in enumerate(dims):
        rows = nb * m
        if rows == 0 or n == 0:
            continue
        if rows == 1:
            step = max(ITEM_NUMEL, 16)
            items += [(p, 0, 1, j, min(n, j + step)) for j in range(0, n, step)]
        else:
            per = max(1, ITEM_NUMEL // n)
            items += [(p, r, min(rows, r + per), 0, n) for r in range(0, rows, per)]
    return np.asarray(items, dtype=np.int64).reshape(-1, 5)


def _schedule(dims, nthreads) -> np.ndarray:
    """A reducing kernel's items: the parameters spread over the threads by size (the largest
    first to the least loaded: each runs on one thread, its reductions being sequential), as
    ``nthreads`` equal runs of rows, padded with -1, since numba's parallel loop gives each
    thread an equal run of iterations."""
    sizes = [int(nb * m * n) for nb, m, n in dims]
    loads, shares = [0] * nthreads, [[] for _ in range(nthreads)]
    for p in sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True):
        th = loads.index(min(loads))
        loads[th] += sizes[p] + 1
        shares[th].append(p)
    width = max(len(share) for share in shares) if sizes else 0
    items = np.full((nthreads * width, 5), -1, dtype=np.int64)
    for th, share in enumerate(shares):
        items[th * width : th * width + len(share), 0] = share
    return items


_row_plans: dict = {}  # a kernel's scalar names -> (the scalars they read, the complements' columns)


def _scalar_rows(names, consts, scalars) -> np.ndarray:
    """The kernel's float32 rows of scalars (``names``: its ``s_*`` variables, a lerp weight's
    complement ``s_<w>__m1`` as ``float32(w) - 1``), then its constants, for each parameter."""
    plan = _row_plans.get((names, consts))
    if plan is None:
        columns = tuple((n[2:-4], True) if n.endswith("__m1") else (n[2:], False) for n in names)
        plan = _row_plans[(names, consts)] = (columns, [float(c) for c in consts])
    columns, tail = plan
    complements: dict = {}  # weight -> float32(weight) - 1, taken once per distinct weight

    def complement(w):
        c = complements.get(w)
        if c is None:
            c = complements[w] = float(np.float32(w) - np.float32(1.0))
        return c

    # (numpy rounds each Python float to the nearest float32, as torch casts a scalar)
    flat = [v for s in scalars for v in (*[complement(s[b]) if m1 else s[b] for b, m1 in columns], *tail)]
    return np.array(flat, dtype=np.float32).reshape(len(scalars), len(names) + len(consts))


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
            items = _schedule(dims, nthreads if dispatcher is dispatchers[0] else 1)
        else:
            items = _items(dims)
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
        shaped = next(t for t in program.tensors if t not in dict(program.shapes))
        reduces = tuple((st.name, st.dim) for st in program.statements if isinstance(st, Reduce))
        column_norms = any(dim == -2 for _, dim in reduces)
        hit = (shaped, column_norms, reduces, lerp_weights(program), clamped_quotients(program))
        _abouts[program] = hit
    return hit


def column_norms_reproduced(dims) -> bool:
    """Whether the column loop reproduces torch's column norm (``dim=-2``) of a parameter of
    ``dims``: a column vector's (``n == 1``, more than one row) is torch's lane-wise norm of a
    contiguous run, which it does not follow (such a parameter's pass runs torch's ops)."""
    nb, m, n = dims
    return n != 1 or m == 1


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
        scalar_rows = _scalar_rows(row_names, consts, [scalars[k] for k in members])
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
        rows = _scalar_rows(*self.row_layout, scalars)
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


# -- what the passes must reproduce, measured at first use ---------------------------------------

_orders: list = []
_mixed: list = []


def torch_reductions():
    """``(lanes, (column fma, tail fma))`` with which the kernels reproduce this torch's ``x.norm()``,
    ``torch.norm(x, dim=-1)`` and ``torch.norm(x, dim=-2)`` bit for bit on probe tensors
    (shapes with and without a tail, batches, sizes that split across torch's threads), or None
    where no form tried does (the passes then run torch's own ops)."""
    if not _orders:
        with keep_torch_threads():  # the probe's kernels start numba's pool: torch's count kept
            _orders.append(_measure_reductions())
    return _orders[0]


def as_tensor(norm) -> torch.Tensor:
    """A reduction as a float32 tensor (a whole-tensor norm comes back as a float)."""
    return norm if isinstance(norm, torch.Tensor) else torch.tensor(norm, dtype=torch.float32)


def _probe_program():
    from ...spec.ir import ProgramBuilder

    b = ProgramBuilder(["param"])
    x = b.tensor("param")
    b.norm("all", x)
    b.norm("rows", x, dim=-1)
    b.norm("cols", x, dim=-2)
    return b.build()


# the shapes whose reductions the kernels take (``column_norms_reproduced``): tails of whole-tensor and
# single-row norms, batches, columns of one, rows a whole number of lanes long
_PROBE_SHAPES = (
    (1, 5),
    (1, 9),
    (1, 1),
    (2, 16),
    (3, 1, 16),
    (2, 8, 24),
    (1, 4099),
    (5000, 16),
    (1, 13),
    (64, 40),
    (300, 7),
    (40, 3),
    (33, 17),
    (2, 3, 11),
    (1, 2),
    (4, 2),
    (2, 1, 3),
)


def _measure_reductions():
    gen = torch.Generator().manual_seed(0)
    probes = [torch.randn(s, generator=gen) * 3 for s in _PROBE_SHAPES]
    probes += [x * 1e-20 for x in probes[:8]]  # squares that underflow: one element is |x|
    probes.append(torch.randn(1, 1 << 20, generator=gen))  # a whole-tensor norm torch may split
    program = _probe_program()
    expected = [
        (x.norm(2), torch.norm(x, dim=-1, keepdim=True), torch.norm(x, dim=-2, keepdim=True)) for x in probes
    ]
    for lanes in (8, 16):
        for order in ((False, True), (False, False), (True, True), (True, False)):
            launch = prepare(program, [{}] * len(probes), [{"param": x} for x in probes], (), lanes, order, 1)
            if launch is None:  # a shape these kernels do not take
                continue
            got = launch()
            if all(
                torch.equal(as_tensor(g["all"]), e[0])
                and torch.equal(g["rows"], e[1])
                and torch.equal(g["cols"], e[2])
                for g, e in zip(got, expected, strict=True)
            ):
                return lanes, order
    return None


def torch_mixed_fusion():
    """Whether torch computes ``param.add_(other, alpha=a)`` with a bfloat16 ``other`` (Muon's
    update) as one fused multiply-add (True), two roundings (False), or neither (None)."""
    if not _mixed:
        gen = torch.Generator().manual_seed(1)
        p, b = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen).bfloat16()
        alpha = -0.0123456
        got = p.clone().add_(b, alpha=alpha).numpy()
        a, bw, pw = (np.float64(np.float32(alpha)), b.double().numpy(), p.double().numpy())
        fused = (a * bw + pw).astype(np.float32)
        twice = (pw + (a * bw).astype(np.float32)).astype(np.float32)
        _mixed.append(True if np.array_equal(got, fused) else False if np.array_equal(got, twice) else None)
    return _mixed[0]
