"""The little language the optimizer specs are written in.

An optimizer step is a *program*: an ordered list of elementwise statements over the
parameter, its gradient and its state tensors. Three kinds of statement exist:

* ``let``    names a temporary (``grad = grad + weight_decay * param``). torch never mutates
  ``p.grad``, so this is a temporary, not a write.
* ``assign`` writes a tensor (a state entry or the parameter) in place. Later statements see
  the new value.
* ``norm``   reduces an elementwise value: ``torch.norm(value, dim=dim, keepdim=True)`` over the
  whole tensor (``dim=None``), its rows (``-1``) or its columns (``-2``), in torch's float32
  order. A reduction ends what a program can say about it: its result is an output of the
  program (``Program.reductions``), read by the Python between the programs of a staged step
  (``spec/staged.py``), never by a later statement of the same program.
* ``quantize`` writes an 8-bit state (``codebooks.py``): a value's blocks of ``BLOCK`` elements
  each as one byte per element (its ``codes`` input) and the block's largest magnitude (its
  ``blocks`` input), by a ``codebook``; ``dequantize(codes, blocks, codebook)`` reads one back.

An input may be *broadcast* (its kind in ``Program.kinds``): a factor of a matrix (``rows``, shape
``(..., m, 1)``; ``cols``, ``(..., 1, n)``; ``matrices``, ``(..., 1, 1)``) read at each element
of the ``(..., m, n)`` parameter as torch's broadcasting reads it. Broadcast inputs are read-only.
An 8-bit state's inputs have kinds of their own: ``codes`` (uint8, the parameter's elements),
``blocks`` (float32, one per block) and ``codebook`` (256 float32); they appear only in
``dequantize`` and ``quantize``.

Expressions are trees of :class:`Expr` nodes. Arithmetic uses Python operators, and a few
named functions mirror the torch ops the torch source uses (``addcmul``, ``addcdiv``,
``lerp``, ``maximum`` ...), so that a spec reads like ``torch/optim/*.py`` and the rounding
order of every float32 operation is the one torch uses. Per-step scalars (bias corrections,
step sizes) are *not* computed here: they are named :class:`Scalar` leaves whose values the
spec's ``scalars`` function computes in Python double precision, exactly as torch does.

Backends are interpreters or compilers of this IR (``backend_api.Backend``):
``backends/reference.py`` runs it with torch ops, one tensor at a time; ``backends/fast.py``
hands it to one of three engines: ``numba_engine/`` (the default) compiles it into one parallel
kernel over every tensor of a step, ``torch_engine.py`` into a list of torch ``out=`` ops over
cache-sized chunks, ``numexpr_engine.py`` into numexpr expressions. A program is validated when
it is built, so a typo in a spec fails the test suite, not a user's run.
"""

from __future__ import annotations

from dataclasses import dataclass

from .modes import StepMode

__all__ = [
    "Expr",
    "Tensor",
    "Scalar",
    "Const",
    "Bin",
    "Call",
    "Let",
    "Assign",
    "Reduce",
    "Quantize",
    "Program",
    "ProgramBuilder",
    "in_remainder",
    "add",
    "addcmul",
    "addcdiv",
    "lerp",
    "maximum",
    "sqrt",
    "sqrt_rn",
    "rsqrt",
    "clamp_min",
    "abs_",
    "sign",
    "where",
    "clamp",
    "dequantize",
    "FUNCTIONS",
]


class Expr:
    """Base class of expression nodes. Operators build new nodes."""

    __slots__ = ()

    def __add__(self, other):
        return Bin("+", self, _wrap(other))

    def __radd__(self, other):
        return Bin("+", _wrap(other), self)

    def __sub__(self, other):
        return Bin("-", self, _wrap(other))

    def __rsub__(self, other):
        return Bin("-", _wrap(other), self)

    def __mul__(self, other):
        return Bin("*", self, _wrap(other))

    def __rmul__(self, other):
        return Bin("*", _wrap(other), self)

    def __truediv__(self, other):
        return Bin("/", self, _wrap(other))

    def __rtruediv__(self, other):
        return Bin("/", _wrap(other), self)

    def __neg__(self):
        return Call("neg", (self,))

    # Comparisons build boolean expressions, usable only as the condition of ``where``.
    def __gt__(self, other):
        return Bin(">", self, _wrap(other))

    def __lt__(self, other):
        return Bin("<", self, _wrap(other))

    def __ge__(self, other):
        return Bin(">=", self, _wrap(other))

    def __le__(self, other):
        return Bin("<=", self, _wrap(other))

    def is_tensor(self) -> bool:
        """True when the value is elementwise (depends on at least one tensor)."""
        raise NotImplementedError


@dataclass(frozen=True, eq=True)
class Tensor(Expr):
    """A tensor: ``param``, ``grad``, a state entry, or a ``let`` temporary."""

    name: str

    def is_tensor(self):
        return True


@dataclass(frozen=True, eq=True)
class Scalar(Expr):
    """A per-step scalar computed by the spec's ``scalars`` function (a float32 in the op)."""

    name: str

    def is_tensor(self):
        return False


@dataclass(frozen=True, eq=True)
class Const(Expr):
    """A literal number, applied as a float32 like a Python number in a torch op."""

    value: float

    def is_tensor(self):
        return False


BINARY_OPS = ("+", "-", "*", "/", ">", "<", ">=", "<=")
COMPARISONS = (">", "<", ">=", "<=")


@dataclass(frozen=True, eq=True)
class Bin(Expr):
    op: str
    a: Expr
    b: Expr

    def is_tensor(self):
        return self.a.is_tensor() or self.b.is_tensor()


# name -> number of arguments. Each mirrors the torch op of the same name on float32 tensors;
# the positions of scalar-only arguments are listed in SCALAR_ARGS.
FUNCTIONS = {
    "neg": 1,  # -x
    "sqrt": 1,  # torch.sqrt
    "sqrt_rn": 1,  # the correctly rounded root: the fused kernels' Vec::sqrt (torch.sqrt may not be)
    "rsqrt": 1,  # torch.rsqrt: 1 / sqrt(x), each rounded (ATen's kernel, not a VML routine)
    "abs": 1,  # torch.abs
    "sign": 1,  # torch.sign: NaN -> 0
    "maximum": 2,  # torch.maximum: NaN propagates from either side
    "where": 3,  # torch.where(cond, a, b)
    "clamp": 3,  # torch.clamp(x, lo, hi), lo and hi scalars
    "clamp_min": 2,  # torch.clamp(x, min=lo), lo a scalar
    "add": 3,  # torch.add(a, b, alpha=s) = a + s*b
    "addcmul": 4,  # torch.addcmul(a, b, c, value=s) = a + s*b*c
    "addcdiv": 4,  # torch.addcdiv(a, b, c, value=s) = a + s*b/c
    "lerp": 3,  # torch.lerp(a, b, w), w a scalar: torch's two-branch formula
    "dequantize": 3,  # codebook[codes] * absmax of the element's block (codebooks.py)
    # torch's fused kernels: the second argument in each tensor's last numel %
    # Program.remainder_step elements (their scalar remainder), the first elsewhere
    "remainder": 2,
}
SCALAR_ARGS = {
    "clamp": (1, 2),
    "clamp_min": (1,),
    "add": (2,),
    "addcmul": (3,),
    "addcdiv": (3,),
    "lerp": (2,),
}


@dataclass(frozen=True, eq=True)
class Call(Expr):
    fn: str
    args: tuple

    def is_tensor(self):
        return any(a.is_tensor() for a in self.args)


def _wrap(x) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return Const(float(x))
    raise TypeError(f"cannot use {x!r} ({type(x).__name__}) in an optimizer program")


def add(a, b, alpha) -> Expr:
    """``torch.add(a, b, alpha=alpha)``: ``a + alpha * b``."""
    return Call("add", (_wrap(a), _wrap(b), _wrap(alpha)))


def addcmul(a, b, c, value) -> Expr:
    """``torch.addcmul(a, b, c, value=value)``: ``a + (value * b) * c``."""
    return Call("addcmul", (_wrap(a), _wrap(b), _wrap(c), _wrap(value)))


def addcdiv(a, b, c, value) -> Expr:
    """``torch.addcdiv(a, b, c, value=value)``: ``a + (value * b) / c``."""
    return Call("addcdiv", (_wrap(a), _wrap(b), _wrap(c), _wrap(value)))


def lerp(a, b, weight) -> Expr:
    """``torch.lerp(a, b, weight)`` with a scalar weight."""
    return Call("lerp", (_wrap(a), _wrap(b), _wrap(weight)))


def maximum(a, b) -> Expr:
    """``torch.maximum(a, b)``: NaN in either argument gives NaN."""
    return Call("maximum", (_wrap(a), _wrap(b)))


def sqrt(x) -> Expr:
    return Call("sqrt", (_wrap(x),))


def sqrt_rn(x) -> Expr:
    """The correctly rounded square root, as torch's fused kernels take it (``Vec::sqrt``, the
    instruction), where ``torch.sqrt`` of float32 runs MKL's routine (``sqrt``)."""
    return Call("sqrt_rn", (_wrap(x),))


def rsqrt(x) -> Expr:
    """``torch.rsqrt(x)``: ``1 / sqrt(x)`` with a correctly rounded root, then the division."""
    return Call("rsqrt", (_wrap(x),))


def clamp_min(x, lo) -> Expr:
    """``torch.clamp(x, min=lo)`` with a scalar bound; NaN propagates."""
    return Call("clamp_min", (_wrap(x), _wrap(lo)))


def abs_(x) -> Expr:
    return Call("abs", (_wrap(x),))


def sign(x) -> Expr:
    """``torch.sign(x)``: -1, 0 or 1; NaN gives 0 (as torch's CPU kernel does)."""
    return Call("sign", (_wrap(x),))


def in_remainder(body, tail) -> Expr:
    """What a fused kernel computes in its vector loops (``body``) and in its scalar remainder
    (``tail``), which contracts otherwise: the last ``numel % step`` elements of each tensor,
    ``step`` the program's ``remainder_step`` (``variants.with_remainder``; 0: ``body`` everywhere)."""
    return Call("remainder", (_wrap(body), _wrap(tail)))


def dequantize(codes, blocks, codebook) -> Expr:
    """An 8-bit state's value: ``codebook[codes] * blocks[element // BLOCK]`` (float32)."""
    return Call("dequantize", (_wrap(codes), _wrap(blocks), _wrap(codebook)))


def where(cond, a, b) -> Expr:
    return Call("where", (_wrap(cond), _wrap(a), _wrap(b)))


def clamp(x, lo, hi) -> Expr:
    """``torch.clamp(x, lo, hi)`` with scalar bounds; NaN propagates."""
    return Call("clamp", (_wrap(x), _wrap(lo), _wrap(hi)))


@dataclass(frozen=True)
class Let:
    name: str
    expr: Expr


@dataclass(frozen=True)
class Assign:
    target: str
    expr: Expr


REDUCE_DIMS = (None, -1, -2)
BROADCAST_KINDS = ("rows", "cols", "matrices")
QUANTIZED_KINDS = ("codes", "blocks", "codebook")  # an 8-bit state's inputs, in dequantize's order


@dataclass(frozen=True)
class Reduce:
    """``name = torch.norm(expr, dim=dim, keepdim=True)`` (``dim`` one of ``REDUCE_DIMS``)."""

    name: str
    expr: Expr
    dim: int | None = None


@dataclass(frozen=True)
class Quantize:
    """``codes``/``blocks`` (inputs of those kinds) := ``expr`` quantized blockwise by ``codebook``
    (``codebooks.py``): each block's absmax, then each element's code."""

    codes: str
    blocks: str
    codebook: str
    expr: Expr

    @property
    def target(self) -> str:
        return self.codes


Statement = Let | Assign | Reduce | Quantize


def walk(expr: Expr):
    """Yield every node of an expression tree, parents before children."""
    yield expr
    if isinstance(expr, Bin):
        yield from walk(expr.a)
        yield from walk(expr.b)
    elif isinstance(expr, Call):
        for a in expr.args:
            yield from walk(a)


@dataclass(frozen=True)
class Program:
    """A validated, ordered list of statements.

    ``tensors`` are the names bound from outside (``param``, ``grad``, state entries), in a
    stable order; ``scalars`` the scalar names the ``scalars`` function must provide;
    ``targets`` the tensors the program writes.
    """

    statements: tuple
    tensors: tuple
    scalars: tuple
    targets: tuple
    reductions: tuple = ()  # the names of its ``norm`` statements, in order
    kinds: tuple = ()  # (input, kind) of its inputs of a kind: broadcast or quantized
    # how its tensors are read and stored (``variants.stored``): a ``modes.StepMode``
    storage: StepMode = StepMode.TORCH
    # its ``remainder`` calls' step (``variants.with_remainder``); 0: they take their body everywhere
    remainder_step: int = 0

    @property
    def blockwise(self) -> bool:
        """Whether it writes an 8-bit state (a ``quantize`` statement)."""
        return any(isinstance(st, Quantize) for st in self.statements)

    def __hash__(self):
        # computed once: programs key every compile cache, and a step looks them up (hashing
        # the statement trees each time was a sizeable part of a small step: docs/benchmarks.md)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.statements, self.tensors, self.scalars, self.targets, self.kinds, self.storage))
            object.__setattr__(self, "_hash", h)
        return h

    def __str__(self):
        lines = []
        for st in self.statements:
            if isinstance(st, Reduce):
                lines.append(f"red {st.name} = norm({format_expr(st.expr)}, dim={st.dim})")
                continue
            if isinstance(st, Quantize):
                lines.append(f"q8  {st.codes}, {st.blocks} = quantize({format_expr(st.expr)}, {st.codebook})")
                continue
            kw = "let" if isinstance(st, Let) else "   "
            name = st.name if isinstance(st, Let) else st.target
            lines.append(f"{kw} {name} = {format_expr(st.expr)}")
        if self.storage:
            lines.append(f"(storage: {self.storage})")
        return "\n".join(lines)


def format_expr(e: Expr) -> str:
    if isinstance(e, Tensor):
        return e.name
    if isinstance(e, Scalar):
        return "$" + e.name
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Bin):
        return f"({format_expr(e.a)} {e.op} {format_expr(e.b)})"
    return f"{e.fn}(" + ", ".join(format_expr(a) for a in e.args) + ")"


class _ScalarNamespace:
    """``b.s.beta2`` is ``Scalar('beta2')``."""

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return Scalar(name)


class ProgramBuilder:
    """Collects statements; ``build()`` validates them into a :class:`Program`.

    ``inputs`` are the tensor names the program may read and write: ``param``, ``grad`` and
    the state entries the optimizer keeps. ``grad`` is read-only (torch never writes p.grad).
    """

    def __init__(self, inputs, kinds=None):
        self.inputs = tuple(inputs)
        self.kinds = dict(kinds or {})
        self.statements: list = []
        self.s = _ScalarNamespace()
        self._lets: dict[str, int] = {}
        self._aliases: dict[str, Tensor] = {}

    def tensor(self, name: str) -> Tensor:
        if name not in self.inputs:
            raise KeyError(f"{name!r} is not an input of this program: {self.inputs}")
        return self._aliases.get(name) or Tensor(name)

    def alias(self, name: str, value: Tensor) -> None:
        """Make ``tensor(name)`` return ``value`` (a let) from now on: what the spec reads as its
        input is then computed from it (the gradient as loss scaling and clipping leave it)."""
        self.tensor(name)
        self._aliases[name] = value

    def let(self, name: str, expr) -> Tensor:
        """Name a temporary; re-using a name shadows the earlier one (like ``grad = ...``)."""
        n = self._lets.get(name, 0)
        self._lets[name] = n + 1
        unique = f"{name}_{n}" if n else name
        if unique in self.inputs:
            unique = f"{name}_t{n}"
        self.statements.append(Let(unique, _wrap(expr)))
        return Tensor(unique)

    def assign(self, target: Tensor, expr) -> Tensor:
        self.statements.append(Assign(target.name, _wrap(expr)))
        return target

    def quantize(self, codes: Tensor, blocks: Tensor, codebook: Tensor, expr) -> None:
        """Write ``expr`` into the 8-bit state ``codes``/``blocks`` by ``codebook``."""
        self.statements.append(Quantize(codes.name, blocks.name, codebook.name, _wrap(expr)))

    def norm(self, name: str, expr, dim: int | None = None) -> str:
        """``torch.norm(expr, dim=dim, keepdim=True)``: an output of the program, ``name``."""
        self.statements.append(Reduce(name, _wrap(expr), dim))
        return name

    def build(self) -> Program:
        return validate(self.statements, self.inputs, self.kinds)


def _check_conditions(expr, st, as_value):
    """Comparisons are booleans: allowed only as the condition of ``where``."""
    if isinstance(expr, Bin) and expr.op in COMPARISONS and as_value:
        raise ValueError(f"comparison {format_expr(expr)} used as a value in {st}; use where()")
    if isinstance(expr, Bin):
        _check_conditions(expr.a, st, True)
        _check_conditions(expr.b, st, True)
    elif isinstance(expr, Call):
        for i, a in enumerate(expr.args):
            _check_conditions(a, st, not (expr.fn == "where" and i == 0))


def validate(statements, inputs, kinds=None) -> Program:
    """Check a statement list and derive the program's interface."""
    inputs = tuple(inputs)
    kinds = dict(kinds or {})
    for name, kind in kinds.items():
        if name not in inputs or kind not in (*BROADCAST_KINDS, *QUANTIZED_KINDS):
            raise ValueError(
                f"input {name!r}: not an input, or kind {kind!r} not in {BROADCAST_KINDS + QUANTIZED_KINDS}"
            )
    defined = set(inputs)
    reductions: list[str] = []
    lets: set[str] = set()
    used_tensors: list[str] = []
    scalars: list[str] = []
    targets: list[str] = []
    for st in statements:
        expr = st.expr
        _check_conditions(expr, st, as_value=True)
        if not expr.is_tensor():
            raise ValueError(f"statement {st} computes a scalar: do scalar math in scalars()")
        _check_quantized(expr, kinds, st)
        for node in walk(expr):
            if isinstance(node, Tensor):
                if node.name not in defined:
                    raise NameError(f"{node.name!r} used before it is defined in {st}")
                if node.name in inputs and node.name not in used_tensors:
                    used_tensors.append(node.name)
            elif isinstance(node, Scalar):
                if node.name not in scalars:
                    scalars.append(node.name)
            elif isinstance(node, Bin):
                if node.op not in BINARY_OPS:
                    raise ValueError(f"unknown operator {node.op!r}")
                if not (node.a.is_tensor() or node.b.is_tensor()):
                    raise ValueError(
                        f"scalar-only subexpression {format_expr(node)} in {st}: "
                        "compute it in scalars() in double precision, as torch does"
                    )
            elif isinstance(node, Call):
                if FUNCTIONS.get(node.fn) != len(node.args):
                    raise ValueError(f"unknown function or wrong arity: {node.fn}")
                for i in SCALAR_ARGS.get(node.fn, ()):
                    if node.args[i].is_tensor():
                        raise ValueError(f"argument {i} of {node.fn} must be a scalar in {st}")
                if node.fn == "lerp" and not isinstance(node.args[2], Scalar):
                    raise ValueError(f"lerp's weight must be a named scalar in {st}")
                if node.fn == "where" and not (
                    isinstance(node.args[0], Bin) and node.args[0].op in COMPARISONS
                ):
                    raise ValueError(f"where() needs a comparison as its condition in {st}")
            elif not isinstance(node, Const):
                raise TypeError(f"unknown node {node!r}")
        if isinstance(st, Let):
            if st.name in defined or st.name in reductions:
                raise ValueError(f"let {st.name!r} redefines a name")
            defined.add(st.name)
            lets.add(st.name)
        elif isinstance(st, Reduce):
            if st.dim not in REDUCE_DIMS or st.name in defined or st.name in reductions:
                raise ValueError(f"norm {st.name!r}: dim {st.dim!r} not in {REDUCE_DIMS}, or a name reused")
            reductions.append(st.name)
        elif isinstance(st, (Assign, Quantize)):
            written = _written(st, inputs, kinds)
            read = (st.codebook,) if isinstance(st, Quantize) else ()
            used_tensors += [n for n in (*read, *written) if n not in used_tensors]
            targets += [n for n in written if n not in targets]
        else:
            raise TypeError(f"unknown statement {st!r}")
    order = [n for n in inputs if n in used_tensors]
    used_kinds = tuple((n, kinds[n]) for n in order if n in kinds)
    return Program(
        tuple(statements), tuple(order), tuple(scalars), tuple(targets), tuple(reductions), used_kinds
    )


def _written(st, inputs, kinds) -> tuple:
    """The inputs an ``assign`` or ``quantize`` writes, checked."""
    if isinstance(st, Assign):
        if st.target not in inputs or st.target == "grad" or st.target in kinds:
            raise ValueError(f"cannot assign to {st.target!r}: not a writable input")
        return (st.target,)
    named = (st.codes, st.blocks, st.codebook)
    if tuple(kinds.get(n) for n in named) != QUANTIZED_KINDS:
        raise ValueError(f"quantize into {named}: needs inputs of kinds {QUANTIZED_KINDS}")
    return (st.codes, st.blocks)


def _check_quantized(expr, kinds, st) -> None:
    """An 8-bit state's inputs appear only as ``dequantize``'s arguments, in its order."""
    if isinstance(expr, Call) and expr.fn == "dequantize":
        found = tuple(kinds.get(a.name) if isinstance(a, Tensor) else None for a in expr.args)
        if found != QUANTIZED_KINDS:
            raise ValueError(f"dequantize needs inputs of kinds {QUANTIZED_KINDS} in {st}")
        return
    if isinstance(expr, Tensor) and kinds.get(expr.name) in QUANTIZED_KINDS:
        raise ValueError(f"{expr.name!r} ({kinds[expr.name]}) read outside dequantize in {st}")
    for child in (expr.a, expr.b) if isinstance(expr, Bin) else getattr(expr, "args", ()):
        _check_quantized(child, kinds, st)
