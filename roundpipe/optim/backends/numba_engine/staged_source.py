"""The source of a staged step's pass kernel (``spec/staged.py``: Adafactor, Muon).

A pass program is either *elementwise* (it assigns; no ``norm``) or *reducing* (it has ``norm``
statements and assigns nothing). Each becomes one kernel over every parameter of the pass:

* an elementwise kernel runs ``items`` (a parameter's rows, or a piece of its one row) on every
  thread (``prange``), the inner loop along a row, so LLVM vectorizes it;
* a reducing kernel runs each parameter on one thread (``prange`` over parameters): torch's
  reductions are sequential in their lanes (``staged_probes.torch_reductions``), and a result must not
  depend on the thread count. The whole-tensor norm accumulates ``lanes`` float32 sums over the
  elements in order, adds them up, then the last ``numel % lanes`` squares one by one; a row norm
  (``dim=-1``) the same along each row; a column norm (``dim=-2``) one sum per column down the
  rows. Each sum is then rooted (correctly rounded, as ``std::sqrt``).

Broadcast inputs are read at the element's row (``rows``), column (``cols``) or matrix
(``matrices``). Every formula is ``formulas.Lowering``'s (torch's rounding); ``rsqrt`` is
``1 / sqrt`` with a correctly rounded root, as ATen's kernel computes it. ``staged`` compiles
and launches the kernels.
"""

from __future__ import annotations

import functools

import numpy as np

from ...spec.ir import Assign, Bin, Call, Let, Reduce, Scalar, Tensor, walk
from ..formulas import Lowering
from .config import GENERATOR_VERSION, ROOT_INTRINSICS

_PACKAGE = "roundpipe.optim.backends.numba_engine"

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
    kinds = dict(program.kinds)
    floors = []
    for st in program.statements:
        for node in walk(st.expr):
            if isinstance(node, Call) and node.fn == "clamp_min" and _clamped_quotient(*node.args, kinds):
                if node.args[1].name not in floors:
                    floors.append(node.args[1].name)
    return tuple(floors)


def _clamped_quotient(x, lo, kinds) -> bool:
    """Whether ``clamp_min(x, lo)`` is ``clamp_min(a / t, scalar)``, ``t`` one value per matrix."""
    return (
        isinstance(lo, Scalar)
        and isinstance(x, Bin)
        and x.op == "/"
        and isinstance(x.b, Tensor)
        and kinds.get(x.b.name) == "matrices"
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
        self.kinds = dict(program.kinds)
        self.normal_floors = {f for f, ok in zip(clamped_quotients(program), floors, strict=True) if ok}
        self.reciprocals: list = []  # broadcast inputs read as a float64 reciprocal, once per row
        # where ``rsqrt`` is taken for a chunk (``chunk_root``): ``argument`` binds its argument
        # (``self.root_arg``), ``root`` reads the chunk's result; ``inline`` divides by the root
        self.root_mode = "inline"
        self.root_arg = None

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

    def fn_rsqrt(self, x):
        if self.root_mode == "inline":
            return super().fn_rsqrt(x)
        if self.root_mode == "argument":
            self.root_arg = self(x)
            return self.const(0.0)  # (what it feeds is not stored: LLVM drops it)
        return "roots[q]"

    def fn_clamp_min(self, x, lo):
        if not (_clamped_quotient(x, lo, self.kinds) and lo.name in self.normal_floors):
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


def _views(program, kinds, dtypes):
    """Each tensor as a raw pointer: indexing one has no negative-index wraparound, which would
    keep LLVM from vectorizing the loops."""
    lines = []
    for k, t in enumerate(program.tensors):
        ptr = "f32ptr" if dtypes[t] == "float32" else "u16ptr"
        lines.append(f"v_{t} = {ptr}(addresses[{k}, p])")
    return lines


def _loads(kinds):
    where = {"rows": "r", "cols": "b * n + j", "matrices": "b"}
    return {t: where[kind] for t, kind in kinds.items()}


def _setup(names):
    return [
        "nb = dims[p, 0]",
        "m = dims[p, 1]",
        "n = dims[p, 2]",
        "rows = nb * m",
        *(f"{name} = scalar_rows[p, {k}]" for k, name in enumerate(names)),
    ]


def _rsqrts(program) -> int:
    """How many ``rsqrt`` the program takes."""
    return sum(isinstance(n, Call) and n.fn == "rsqrt" for st in program.statements for n in walk(st.expr))


def _chunk_root(program, dialect, dtypes, loads, root):
    """``(argument lines, call, root lines, stores)``: a chunk's loop binding the argument of the
    program's one ``rsqrt`` into ``roots``, the call taking them in place (``root``'s intrinsic),
    and the loop reading them; or None where the kernel divides by the root element by element
    (``root`` is ``divider``, or the program has no or several roots)."""
    if root == "divider" or _rsqrts(program) != 1:
        return None
    dialect.root_mode = "argument"
    argument, _, _ = _element_code(program, dialect, dtypes, "i", loads)
    argument.append(f"roots[q] = {dialect.root_arg}")
    dialect.root_mode = "root"
    body, stores, _ = _element_code(program, dialect, dtypes, "i", loads)
    dialect.root_mode = "inline"
    return argument, f"{ROOT_INTRINSICS[root]}(roots.ctypes.data, roots.ctypes.data, count)", body, stores


def generate(program, variant, fused, dtypes, lanes=8, order=(False, True), floors=(), root="divider"):
    """``(source, row names, constants)`` of ``program``'s kernel, ``kernel(...)``; ``floors``:
    ``floor_variant`` of the launch's scalars; ``root``: how ``rsqrt`` is taken
    (``config.ROOT_KINDS``)."""
    dialect = _Dialect(program, variant, fused, floors)
    kinds = dict(program.kinds)
    loads = _loads(kinds)
    chunks = _chunk_root(program, dialect, dtypes, loads, root)
    body, stores, reduced = _element_code(program, dialect, dtypes, "i", loads)
    names = (*sorted(dialect.scalars), *sorted(dialect.consts))
    views = _views(program, kinds, dtypes)
    # per row: the reciprocals of a matrix's broadcast values (``clamped_quotients``)
    per_row = [f"rcp_{t} = 1.0 / np.float64(v_{t}[{loads[t]}])" for t in dialect.reciprocals]
    if program.reductions:
        if program.targets:
            raise ValueError("a staged pass either assigns or reduces")
        kernel = _reducing(program, body, reduced, lanes, order, names, views, per_row, chunks)
    else:
        kernel = _elementwise(body, stores, names, views, per_row, chunks)
    low = sorted({d for d in dtypes.values() if d != "float32"})
    conversions = [f"{w}_{d}" for d in low for w in ("widen", "narrow")]
    lines = [
        # the header names ``staged``, the module that compiles the source: the same text keeps
        # the kernels already in the disk cache (keyed by the source's hash)
        f"# Generated by {_PACKAGE}.staged (do not edit), generator version {GENERATOR_VERSION}:",
        *(f"#   {line}" for line in str(program).splitlines()),
        f"# lerp variant {tuple(variant)!r}, normal floors {tuple(floors)!r}, "
        f"fused {sorted(dialect.fused)!r}, lanes {lanes}, "
        f"(column fma, tail fma) {order}, dtypes {sorted(dtypes.items())!r}"
        # (a divider's text as before the exact roots: the disk cache keeps its kernels)
        + ("" if chunks is None else f", root {root}"),
        "import numpy as np",
        "from numba import prange",
        f"from {_PACKAGE}.intrinsics import f32ptr, u16ptr, fma, lane_add8, lane_add16, wide_vectors",
        *([f"from {_PACKAGE}.conversions import {', '.join(conversions)}"] if conversions else []),
        *([f"from {_PACKAGE}.exact_root import {ROOT_INTRINSICS[root]}"] if chunks else []),
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


def _elementwise(body, stores, names, views, per_row, chunks=None):
    """Items ``(p, r0, r1, j0, j1)``: rows ``[r0, r1)`` of parameter ``p``, columns ``[j0, j1)``;
    with ``chunks`` (``_chunk_root``), a row's columns in chunks of ``CHUNK``."""
    head = [
        "def kernel_parallel(items, addresses, dims, scalar_rows, outs):",
        "    for it in prange(items.shape[0]):",
        "        wide_vectors()",
        "        p = items[it, 0]",
        *_indent(_setup(names), 2),
        *_indent(views, 2),
    ]
    if chunks is None:
        return [
            *head,
            "        for r in range(items[it, 1], items[it, 2]):",
            "            b = r // m",
            *_indent(per_row, 3),
            "            for j in range(items[it, 3], items[it, 4]):",
            "                i = r * n + j",
            *_indent(body, 4),
            *_indent(stores, 4),
            "",
        ]
    argument, call, body, stores = chunks
    return [
        "CHUNK = 512",
        "",
        "",
        *head,
        "        roots = np.empty(CHUNK, np.float32)",
        "        for r in range(items[it, 1], items[it, 2]):",
        "            b = r // m",
        *_indent(per_row, 3),
        "            for start in range(items[it, 3], items[it, 4], CHUNK):",
        "                count = min(CHUNK, items[it, 4] - start)",
        *_indent(_root_loops(argument, call, body + stores), 4),
        "",
    ]


def _root_loops(argument, call, body):
    """A chunk's two loops around the root's call (``_chunk_root``)."""
    loop = ["for q in range(count):", "    j = start + q", "    i = r * n + j"]
    return [*loop, *_indent(argument, 1), call, *loop, *_indent(body, 1)]


def _tail_step(acc, v, index, length, tail_fma):
    """The line adding the tail element ``index`` (of ``length``) to ``acc``: torch's tail loop
    is unrolled by four, and its last ``length % 4`` additions are fused where its kernels were
    built with FMA (``staged_probes``: ``tail_fma``)."""
    if not tail_fma:
        return [f"{acc} = {acc} + ({v} * {v})"]
    return [
        f"if {index} >= 4 * ({length} // 4):",
        f"    {acc} = fma({v}, {v}, {acc})",
        "else:",
        f"    {acc} = {acc} + ({v} * {v})",
    ]


def _reducing(program, body, reduced, lanes, order, names, views, per_row, chunks=None):
    """One parameter a thread; the reductions in torch's order (see the module docstring).

    Where the lanes of the whole-tensor norm line up with each row's (rows a whole number of
    lanes long, or one row), a row is taken in chunks of ``CHUNK`` elements: a loop LLVM
    vectorizes computes each chunk's squares (and adds the column sums), then the lane sums
    take them in order. Elsewhere each element in turn (small matrices: ``(33, 17)``). A norm
    over one element is its absolute value, as torch's. With ``chunks`` (``_chunk_root``), a
    chunk takes its roots at once."""
    g = _norm_lines(program, reduced, lanes, order)
    row_finish = g["row_finish"]
    loops = _squares_loops(body, g, chunks)
    return [
        "CHUNK = 512",
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
        *_indent(g["init"], 2),
        f"        aligned = n % {lanes} == 0 or rows == 1",
        "        for r in range(rows):",
        "            b = r // m",
        *_indent(per_row, 3),
        *_indent(g["row_start"], 3),
        "            if aligned:",
        "                for start in range(0, cut, CHUNK):",
        "                    count = min(CHUNK, cut - start)",
        *_indent(loops, 5),
        *_indent(g["lane_sums"], 5),
        *_indent(row_finish, 4),
        "                for j in range(cut, n):",
        "                    i = r * n + j",
        *_indent(body, 5),
        *_indent(g["tail"], 5),
        "            else:",
        "                for j in range(n):",
        # a row's lanes are summed before its tail is added, as torch's loop does
        *(["                    if j == cut:"] + _indent(row_finish, 6) if row_finish else []),
        "                    i = r * n + j",
        *_indent(body, 5),
        *_indent(g["generic"], 5),
        *(["                if cut == n:"] + _indent(row_finish, 5) if row_finish else []),
        *_indent(g["row_done"], 3),
        *_indent(g["final"], 2),
        "",
    ]


def _squares_loops(body, g, chunks):
    """The loops computing an aligned chunk's squares (``_reducing``)."""
    if chunks is None:
        loop = ["for q in range(count):", "    j = start + q", "    i = r * n + j"]
        return [*loop, *_indent(body + g["square"], 1)]
    g["init"].append("roots = np.empty(CHUNK, np.float32)")
    return _root_loops(chunks[0], chunks[1], chunks[2] + g["square"])


# the line groups of a reducing kernel, each spliced in at its place in ``_reducing``'s loops
_GROUPS = ("init", "square", "lane_sums", "tail", "final", "generic", "row_start", "row_finish", "row_done")


def _norm_lines(program, reduced, lanes, order) -> dict:
    """Each norm's lines (``reduced``: its value's variable), by group (``_GROUPS``), the norms
    in the program's order."""
    col_fma, tail_fma = order
    g = {group: [] for group in _GROUPS}
    specs = [(st.name, st.dim) for st in program.statements if isinstance(st, Reduce)]
    for k, (name, dim) in enumerate(specs):
        v = reduced[name]
        out = f"o{k}"
        g["init"].append(f"{out} = f32ptr(outs[{k}, p])")
        if dim == -2:
            _column_norm(g, v, out, col_fma)
        else:
            _lane_norm(g, k, v, out, dim, lanes, tail_fma)
    return g


def _column_norm(g, v, out, col_fma):
    """A column norm (``dim=-2``): one sum per column down the rows, rooted at the end."""
    sq = f"({v} * {v})"
    col = f"fma({v}, {v}, {out}[b * n + j])" if col_fma else f"{out}[b * n + j] + {sq}"
    # a column of one element: its absolute value, as torch's norm of one element
    for place in ("square", "tail", "generic"):
        g[place].append(f"{out}[b * n + j] = abs({v}) if m == 1 else {col}")
    g["final"] += ["if m != 1:", "    for c in range(nb * n):", f"        {out}[c] = np.sqrt({out}[c])"]


def _lane_norm(g, k, v, out, dim, lanes, tail_fma):
    """A whole-tensor norm (``dim`` None) or a row norm (``dim=-1``): ``lanes`` sums, added up,
    then the tail square by square."""
    sq = f"({v} * {v})"
    acc = f"acc{k}" if dim is None else f"ra{k}"
    g["init"] += [f"{acc} = np.zeros({lanes}, np.float32)", f"sq{k} = np.empty(CHUNK, np.float32)"]
    g["square"].append(f"sq{k}[q] = {sq}")
    g["lane_sums"].append(f"lane_add{lanes}({acc}.ctypes.data, sq{k}.ctypes.data, count)")
    combine = [f"t{k} = {acc}[0]", f"for l in range(1, {lanes}):", f"    t{k} = t{k} + {acc}[l]"]
    if dim is None:
        g["init"].append(f"tl{k} = np.zeros({lanes}, np.float32)")
        g["tail"].append(f"tl{k}[j - cut] = {v}")
        g["generic"] += [
            "if i < fcut:",
            f"    {acc}[i % {lanes}] = {acc}[i % {lanes}] + {sq}",
            "else:",
            f"    tl{k}[i - fcut] = {v}",
        ]
        g["final"] += [
            *combine,
            "for q in range(total - fcut):",
            *_indent(_tail_step(f"t{k}", f"tl{k}[q]", "q", "(total - fcut)", tail_fma), 1),
            f"{out}[0] = abs(tl{k}[0]) if total == 1 else np.sqrt(t{k})",
        ]
        return
    g["init"] += [f"rt{k} = np.float32(0.0)", f"rv{k} = np.float32(0.0)"]
    step = _tail_step(f"rt{k}", v, "(j - cut)", "(n - cut)", tail_fma)
    g["tail"] += [*step, f"rv{k} = {v}"]
    g["generic"] += [
        "if j < cut:",
        f"    {acc}[j % {lanes}] = {acc}[j % {lanes}] + {sq}",
        "else:",
        *_indent(step, 1),
        f"rv{k} = {v}",
    ]
    g["row_start"] += [f"for l in range({lanes}):", f"    {acc}[l] = np.float32(0.0)"]
    g["row_finish"] += [*combine, f"rt{k} = t{k}"]
    g["row_done"].append(f"{out}[r] = abs(rv{k}) if n == 1 else np.sqrt(rt{k})")
