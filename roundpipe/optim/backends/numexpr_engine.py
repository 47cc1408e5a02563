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

import threading
from dataclasses import dataclass

import numexpr
import numpy as np
from numexpr.necompiler import NumExpr, getExprNames

from ..spec.ir import Assign, Let, Tensor, walk
from .formulas import Lowering, lerp_variant, lerp_weights, scalar_env

__all__ = ["compile_program", "plan_lets", "lerp_variant", "lerp_weights", "scalar_env"]

_F32 = np.float32


def tensor_var(name: str) -> str:
    return "t_" + name


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
# 2. lowering to numexpr strings: the shared formulas (formulas.py) in numexpr's dialect


class _Lowering(Lowering):
    def __init__(self, program, variant, materialised: set):
        super().__init__(program, variant)  # numexpr has no fused multiply-add
        self.materialised = materialised
        self.inline: dict[str, str] = {}  # let name -> numexpr string

    def tensor(self, name):
        if name in self.inline:
            return self.inline[name]
        if name in self.materialised:
            return "l_" + name
        return tensor_var(name)

    def select(self, cond, a, b):
        return f"where({cond}, {a}, {b})"  # numexpr's maximum()/sign() would compute in double

    def either(self, x, y):
        return f"({x}) | ({y})"

    def sqrt(self, x):
        return f"sqrt({x})"

    def correct_sqrt(self, x):
        return f"sqrt({x})"


# ---------------------------------------------------------------------------------------------
# 3. compilation


@dataclass
class _Eval:
    out: str  # tensor_var(target) or "l_<let>"
    source: str
    args: tuple  # argument names in call order
    func: object
    uses_vml: bool


# One numexpr evaluation at a time in this process: numexpr's pool allows only one anyway, its
# thread count is process-wide, and a compiled expression must not run in two threads at once.
_LOCK = threading.Lock()


def as_numpy(t) -> np.ndarray:
    """A zero-copy numpy view of a real float32 tensor (never a copy)."""
    return t.detach().numpy()


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

    def run_units(self, units, env: dict, nthreads: int):
        """Run in place on every unit (name -> same-shaped tensors), one pass per statement over
        the whole unit, on numexpr's pool of ``nthreads``. numexpr already works block by block
        (4 Ki elements) inside each expression, so running the program chunk by chunk would only
        add calls and pool wake-ups (it measured slower: docs/benchmarks.md).
        """
        with _LOCK:  # numexpr's thread count and its compiled expressions are process-wide
            if numexpr.get_num_threads() != nthreads:
                numexpr.set_num_threads(nthreads)
            for unit in units:
                self.run(unit, env)


def _compile_expr(out, source):
    names, uses_vml = getExprNames(source, {})
    func = NumExpr(source, signature=[(n, float) for n in names])
    return _Eval(out, source, tuple(names), func, uses_vml)


def compile_program(program, variant: tuple) -> CompiledProgram:
    """Compile ``program`` for a lerp variant (see ``lerp_variant``)."""
    materialised = plan_lets(program)
    low = _Lowering(program, variant, materialised)
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
