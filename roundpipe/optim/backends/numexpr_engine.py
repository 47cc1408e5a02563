"""The numexpr engine of the ``fast`` backend: compiles a spec program to numexpr expressions.

The compiler is a straight pipeline:

1. ``plan_lets``   decides, for each ``let``, whether it can be substituted into the
   statements that use it (nothing it reads is written in between) or must be materialised
   into a scratch buffer.
2. ``lower``       turns each expression into a numexpr string: tensors, scalars and
   constants become named float32 variables (numexpr upcasts float literals to float64), the
   torch-named functions become the float32 formulas torch's kernels use, in torch's rounding
   order.
3. ``compile_program`` builds one ``numexpr.NumExpr`` per ``assign`` (and per materialised
   ``let``), once per program and lerp variant (``fast.py`` caches it).
4. ``CompiledProgram.run`` binds zero-copy numpy views of the tensors and calls each
   compiled expression with ``out=`` the target's own memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numexpr.necompiler import NumExpr, getExprNames

from ..spec.ir import Assign, Bin, Call, Const, Let, Scalar, Tensor, walk

_F32 = np.float32


def tensor_var(name: str) -> str:
    return "t_" + name


def scalar_var(name: str) -> str:
    return "s_" + name


def lerp_complement_var(name: str) -> str:
    return "s_" + name + "__1m"


def const_var(value: float) -> str:
    # a stable, valid identifier for a float32 constant
    bits = np.array(value, dtype=_F32).view(np.uint32).item()
    return f"c_{bits:08x}"


# ---------------------------------------------------------------------------------------------
# 1. lets: substitute or materialise


def _reads(expr, let_reads):
    """Input tensors an expression reads, looking through substituted lets."""
    out = set()
    for node in walk(expr):
        if isinstance(node, Tensor):
            out |= let_reads.get(node.name, {node.name})
    return out


def plan_lets(program):
    """Return the set of let names that must be materialised into scratch buffers.

    A let can be substituted into a later statement only when no tensor it reads was assigned
    between its definition and that use (an assign that *uses* it reads the old values before
    writing, so the using statement itself may write them).
    """
    stmts = program.statements
    let_reads: dict[str, set] = {}
    materialise: set = set()
    for i, st in enumerate(stmts):
        if not isinstance(st, Let):
            continue
        reads = _reads(st.expr, let_reads)
        written = set()
        for later in stmts[i + 1 :]:
            uses = any(isinstance(n, Tensor) and n.name == st.name for n in walk(later.expr))
            if uses and written & reads:
                materialise.add(st.name)
                break
            if isinstance(later, Assign):
                written.add(later.target)
        # a materialised let is a snapshot: whoever uses it reads only its scratch buffer
        let_reads[st.name] = {st.name} if st.name in materialise else reads
    return materialise


# ---------------------------------------------------------------------------------------------
# 2. lowering to numexpr strings


class _Lowering:
    def __init__(self, lerp_small: dict, materialised: set):
        self.lerp_small = lerp_small  # scalar name -> bool: abs(weight) < 0.5
        self.materialised = materialised
        self.inline: dict[str, str] = {}  # let name -> numexpr string
        self.consts: dict[str, float] = {}

    def const(self, value: float) -> str:
        name = const_var(value)
        self.consts[name] = value
        return name

    def is_const(self, e, value):
        return isinstance(e, Const) and e.value == value

    def __call__(self, e) -> str:
        if isinstance(e, Tensor):
            if e.name in self.inline:
                return self.inline[e.name]
            if e.name in self.materialised:
                return "l_" + e.name
            return tensor_var(e.name)
        if isinstance(e, Scalar):
            return scalar_var(e.name)
        if isinstance(e, Const):
            return self.const(e.value)
        if isinstance(e, Bin):
            if e.op == "/" and not e.a.is_tensor():
                # torch computes number / tensor as reciprocal(tensor) * number
                return f"(({self.const(1.0)} / {self(e.b)}) * {self(e.a)})"
            return f"({self(e.a)} {e.op} {self(e.b)})"
        return getattr(self, "fn_" + e.fn)(*e.args)

    # -- torch's float32 formulas, in torch's evaluation order --------------------------------
    def fn_neg(self, x):
        return f"(-{self(x)})"

    def fn_sqrt(self, x):
        return f"sqrt({self(x)})"

    def fn_abs(self, x):
        return f"abs({self(x)})"

    def fn_sign(self, x):
        # torch.sign: (0 < x) - (x < 0); NaN gives 0. (numexpr's sign() computes in double.)
        x, zero, one, minus = self(x), self.const(0.0), self.const(1.0), self.const(-1.0)
        return f"where({x} > {zero}, {one}, where({x} < {zero}, {minus}, {zero}))"

    def fn_maximum(self, a, b):
        # torch.maximum propagates NaN from either side; numexpr's maximum() is double only
        a, b = self(a), self(b)
        return f"where(({a} > {b}) | ({a} != {a}), {a}, {b})"

    def fn_where(self, c, a, b):
        return f"where({self(c)}, {self(a)}, {self(b)})"

    def fn_clamp(self, x, lo, hi):
        # torch.clamp = min(max(x, lo), hi), NaN propagating
        x, lo, hi = self(x), self(lo), self(hi)
        low = f"where({x} < {lo}, {lo}, {x})"
        return f"where({low} > {hi}, {hi}, {low})"

    def _scaled(self, scale, x):
        if self.is_const(scale, 1.0):
            return self(x)
        return f"({self(scale)} * {self(x)})"

    def fn_add(self, a, b, alpha):
        if self.is_const(alpha, -1.0):
            return f"({self(a)} - {self(b)})"
        return f"({self(a)} + {self._scaled(alpha, b)})"

    def fn_addcmul(self, a, b, c, value):
        return f"({self(a)} + ({self._scaled(value, b)} * {self(c)}))"

    def fn_addcdiv(self, a, b, c, value):
        return f"({self(a)} + ({self._scaled(value, b)} / {self(c)}))"

    def fn_lerp(self, a, b, w):
        # ATen's lerp: small weights go from the start, large ones back from the end
        a, b = self(a), self(b)
        if self.lerp_small[w.name]:
            return f"({a} + ({scalar_var(w.name)} * ({b} - {a})))"
        return f"({b} - (({b} - {a}) * {lerp_complement_var(w.name)}))"


def lerp_weights(program):
    names = []
    for st in program.statements:
        for node in walk(st.expr):
            if isinstance(node, Call) and node.fn == "lerp" and node.args[2].name not in names:
                names.append(node.args[2].name)
    return tuple(names)


# ---------------------------------------------------------------------------------------------
# 3. compilation


@dataclass
class _Eval:
    out: str  # tensor_var(target) or "l_<let>"
    source: str
    args: tuple  # argument names in call order
    func: object
    uses_vml: bool


def as_numpy(t) -> np.ndarray:
    """A zero-copy numpy view of a real float32 tensor (never a copy)."""
    return t.detach().numpy()


def scalar_env(scalars: dict, weights=()) -> dict:
    """numexpr variables for the step's scalars: float32 values (never float64 literals)."""
    env = {scalar_var(k): _F32(v) for k, v in scalars.items()}
    for w in weights:
        env[lerp_complement_var(w)] = _F32(1.0) - env[scalar_var(w)]
    return env


def lerp_variant(scalars: dict, weights) -> tuple:
    """Which of ATen's two lerp formulas each weight takes: ``abs(weight) < 0.5`` in float32."""
    return tuple(bool(abs(_F32(scalars[w])) < _F32(0.5)) for w in weights)


@dataclass
class CompiledProgram:
    program: object
    evals: list
    scratch: tuple  # materialised let names
    consts: dict  # name -> float32 value

    def run(self, tensors: dict, env: dict):
        """Evaluate in place. ``tensors``: name -> real float32 tensor; ``env``: scalar_env()."""
        env = {**env, **self.consts}
        for name, t in tensors.items():
            env[tensor_var(name)] = as_numpy(t)
        shape = env["t_param"].shape
        for name in self.scratch:
            env["l_" + name] = np.empty(shape, dtype=_F32)
        for ev in self.evals:
            ev.func(
                *[env[a] for a in ev.args],
                out=env[ev.out],
                order="K",
                casting="safe",
                ex_uses_vml=ev.uses_vml,
            )


def _compile_expr(out, source):
    names, uses_vml = getExprNames(source, {})
    func = NumExpr(source, signature=[(n, float) for n in names])
    return _Eval(out, source, tuple(names), func, uses_vml)


def compile_program(program, variant: tuple) -> CompiledProgram:
    """Compile ``program`` for a lerp variant (see ``lerp_variant``)."""
    materialised = plan_lets(program)
    low = _Lowering(dict(zip(lerp_weights(program), variant, strict=True)), materialised)
    evals = []
    for st in program.statements:
        source = low(st.expr)
        if isinstance(st, Let):
            if st.name in materialised:
                evals.append(_compile_expr("l_" + st.name, source))
            else:
                low.inline[st.name] = source
        else:
            evals.append(_compile_expr(tensor_var(st.target), source))
    consts = {k: _F32(v) for k, v in low.consts.items()}
    return CompiledProgram(program, evals, tuple(sorted(materialised)), consts)
