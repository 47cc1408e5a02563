"""A spec program lowered to the statements of one loop iteration, kept as records (local,
expression, the locals it reads) until ``codegen`` writes them out; and, for a program with a
``sqrt``, the passes of a chunk (which records each pass runs).

Names of the generated locals (each kind has its own prefix, then the tensor's row, so no two
kinds can collide and a spec's names cannot collide with them):

* ``view<r>_<tensor>``: the tensor's elements (of the slice, or of the chunk);
* ``val<r>_<tensor>_<n>``: the tensor's ``n``-th value in this iteration (0: as read);
* ``let<n>_<name>``: a ``let``; ``tmp<n>``: a sub-expression used more than once;
* ``arg<k>``: the argument of the ``k``-th sqrt, whose root the expression reads as
  ``roots<k>[i]`` (taken for the whole chunk between passes, see ``codegen``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...spec.core import is_factor_product
from ...spec.ir import Assign, Let
from ..formulas import Lowering


def local_name(prefix: str, row: int, name: str) -> str:
    """``<prefix><row>_<name>``, or ``<prefix><row>`` where ``name`` is no identifier."""
    return f"{prefix}{row}_{name}" if name.isidentifier() else f"{prefix}{row}"


class Code(str):
    """Kernel source of an expression, and the locals it reads (``uses``)."""

    def __new__(cls, text: str, uses=()):
        code = super().__new__(cls, text)
        code.uses = frozenset(uses)
        return code


def uses_of(code) -> frozenset:
    """The locals ``code`` reads (none for a scalar's or a constant's name)."""
    return getattr(code, "uses", frozenset())


@dataclass(frozen=True)
class Record:
    """One statement of an iteration: ``local = expr``; ``uses``: the locals ``expr`` reads."""

    local: str
    expr: str
    uses: frozenset

    @property
    def line(self) -> str:
        return f"{self.local} = {self.expr}"


class KernelLowering(Lowering):
    """The shared formulas (formulas.py) in numba's dialect: the records of one iteration."""

    def __init__(self, program, variant, fused, low=None, grad_rounding=None):
        super().__init__(program, variant, fused, low)
        # a widened program's own 16-bit gradient: its factor products rounded to this dtype
        # (spec.core.is_factor_product), by ``round_<dtype>``
        self.grad_rounding = grad_rounding
        self.uses_grad_rounding = False
        self.uses_fma = False
        self.uses_round = False  # a low-precision program's rounding intrinsic
        self.uses_bits = False  # its ``bits_<dtype>`` intrinsic (a target that is an operand)
        self.uses_nan = False  # its ``*_nan`` conversions (a NaN other than the conversion's)
        self.uses_tail = False  # whether a formula selects on the item's ``tail`` flag
        self.bits: dict[str, str] = {}  # a low-precision target's value -> the local of its bits
        self.rows = {name: r for r, name in enumerate(program.tensors)}
        self.views = {name: local_name("view", r, name) for r, name in enumerate(program.tensors)}
        self.current: dict[str, Code] = {}  # input tensor -> local holding its current value
        self.versions: dict[str, int] = {}
        self.loads: list[str] = []  # input tensors read before they are first assigned
        self.lets: dict[str, Code] = {}  # let name -> local
        self.records: list[Record] = []
        self.sqrt_cuts: list[int] = []  # per sqrt, in order: len(records) once its argument is bound
        self.ntemp = 0
        for st in program.statements:
            self.statement(st)

    def value(self, name: str, version: int) -> Code:
        local = local_name("val", self.rows[name], name) + f"_{version}"
        return Code(local, {local})

    def fmt(self, template, *parts):
        text = template.format(*parts)
        return Code(text, frozenset().union(*(uses_of(p) for p in parts)))

    # -- the dialect ---------------------------------------------------------------------------
    def tensor(self, name: str) -> Code:
        if name in self.lets:
            return self.lets[name]
        if name not in self.current:
            self.loads.append(name)
            self.versions[name] = 0
            self.current[name] = self.value(name, 0)
        return self.current[name]

    def select(self, cond, a, b):
        return self.fmt("({} if {} else {})", a, cond, b)

    def either(self, x, y):
        return self.fmt("({} or {})", x, y)

    def sqrt(self, x):
        # the argument is bound here (a pass stores it); the root is read from the chunk's
        # buffer, which torch's routine (or its emulation) fills between passes
        k = len(self.sqrt_cuts)
        self.records.append(Record(f"arg{k}", x, uses_of(x)))
        self.sqrt_cuts.append(len(self.records))
        return Code(f"roots{k}[i]")

    def correct_sqrt(self, x):
        return self.fmt("np.sqrt({})", x)

    def fma(self, a, b, c):
        self.uses_fma = True
        return self.fmt("fma({}, {}, {})", a, b, c)

    def narrow(self, x, op="round"):
        # float32 -> the dtype -> float32, integer operations on the bits (conversions.py)
        nan = self._nan_argument(op)
        if nan is None:  # the conversion's own NaN (bfloat16: 0xffff; float16: kept)
            self.uses_round = True
            code = self.fmt("round_{}({})", self.low.name, x)
        else:
            self.uses_nan = True
            code = self.fmt("round_{}_nan({}, {})", self.low.name, x, nan)
        code.narrowed = x  # (an assignment's last rounding gives the bits it stores: statement)
        code.nan = nan
        return code

    def _nan_argument(self, op):
        """The ``nan`` argument of a ``*_nan`` conversion for torch's ``op`` (its 16-bit NaN,
        -1: kept), in the body and the tail; None where the plain conversion gives it."""
        native = 0xFFFF if self.low.name == "bfloat16" else "kept"
        body, tail = self.low.nan(op)
        if body == tail == native:
            return None
        arg = {k: str(-1 if k == "kept" else k) for k in (body, tail)}
        if body == tail:
            return arg[body]
        return self.fmt("({} if {} else {})", arg[tail], self.in_tail(), arg[body])

    def in_tail(self):
        # the item's flag (an item lies in torch's scalar tail or not at all: layout.partition)
        self.uses_tail = True
        return Code("tail")

    def bind(self, code):
        if code.isidentifier():
            return code
        self.ntemp += 1
        local = f"tmp{self.ntemp}"
        self.records.append(Record(local, code, uses_of(code)))
        return Code(local, {local})

    # -- statements ----------------------------------------------------------------------------
    def statement(self, st):
        code = self(st.expr)
        if self.grad_rounding is not None and is_factor_product(st):
            self.uses_grad_rounding = True
            code = self.fmt("round_{}({})", self.grad_rounding, code)
        if isinstance(st, Let):
            name = local_name("let", len(self.lets), st.name)
            local = Code(name, {name})
            self.lets[st.name] = local
        elif isinstance(st, Assign):
            self.versions[st.target] = self.versions.get(st.target, 0) + 1
            local = self.value(st.target, self.versions[st.target])
            self.current[st.target] = local
            inner = getattr(code, "narrowed", None)
            if inner is not None:
                # the bits once, stored as they are, and the value they hold for what follows
                nan = getattr(code, "nan", None)
                dtype = self.low.name
                narrow = f"narrow_{dtype}({inner})" if nan is None else f"narrow_{dtype}_nan({inner}, {nan})"
                bits = self._bits(st.target, local, narrow, uses_of(inner))
                code = Code(f"widen_{dtype}({bits})", {bits})
            elif self.low is not None:
                # an operand of the dtype (neg, abs where they keep a NaN): stored as its bits are
                self.uses_bits = True
                self._bits(st.target, local, f"bits_{self.low.name}({code})", uses_of(code))
        else:
            raise TypeError(f"not a statement: {st!r}")
        self.records.append(Record(str(local), code, uses_of(code)))

    def _bits(self, target, local, expr, uses) -> str:
        """A local for the bits ``expr`` computes of ``target``'s value ``local``, which the
        store writes as they are."""
        bits = local_name("bits", self.rows[target], target) + f"_{self.versions[target]}"
        self.records.append(Record(bits, expr, uses))
        self.bits[str(local)] = bits
        return bits


@dataclass(frozen=True)
class Pass:
    """One loop over a chunk: the inputs it loads and the records it runs, in order."""

    loads: list
    records: list


def sqrt_passes(lowering: KernelLowering, targets, late=()) -> tuple[list, list]:
    """``(early, passes)`` for a chunk of a program with a ``sqrt``.

    ``passes[k]`` (``k`` < the number of roots) binds the ``k``-th root's argument ``arg<k>``;
    the last pass computes what the targets' final values need. Every pass runs only the
    records its outputs depend on (a backward slice). ``early``: the targets whose final value
    pass 0 computes, which pass 0 stores (Adam's moments); later passes read those back (the
    chunk is in cache) instead of recomputing them from the inputs. A target whose original
    value a later pass still needs is not stored early, nor any of ``late``.
    """
    records = lowering.records
    defs = {rec.local: rec for rec in records}
    cut0 = lowering.sqrt_cuts[0]
    in_first = {rec.local for rec in records[:cut0]}
    early = [t for t in targets if lowering.current[t] in in_first and t not in late]
    originals = {lowering.value(t, 0): t for t in lowering.loads}

    def backward_slice(outputs, upto, free) -> Pass:
        allowed = {rec.local for rec in records[:upto]}
        need, stack = set(), list(outputs)
        while stack:
            name = stack.pop()
            if name in need or name in free:
                continue
            need.add(name)
            if name in defs and name in allowed:
                stack.extend(defs[name].uses)
        loads = sorted((originals[n] for n in need if n in originals), key=lowering.loads.index)
        return Pass(loads, [rec for rec in records[:upto] if rec.local in need])

    while True:
        free = {lowering.current[t] for t in early}
        passes = [backward_slice(["arg0", *(lowering.current[t] for t in early)], cut0, set())]
        for k, cut in enumerate(lowering.sqrt_cuts[1:], start=1):
            passes.append(backward_slice([f"arg{k}"], cut, free))
        finals = [lowering.current[t] for t in targets if t not in early]
        passes.append(backward_slice(finals, len(records), free))
        clobbered = {t for p in passes[1:] for t in p.loads if t in early}
        if not clobbered:
            return early, passes
        early = [t for t in early if t not in clobbered]
