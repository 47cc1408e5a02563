"""The one lowering of the IR's functions to torch's float32 formulas, for compiled engines.

``reference`` and the torch engine call torch ops (``torch_ops.py``). The compiled engines
(numexpr strings in ``numexpr_engine.py``, numba source in ``numba_engine/``) need each
function written out as arithmetic, in the order torch's CPU kernels round it. That is done
here, once; an engine subclasses :class:`Lowering` and supplies its *dialect*: how to name a
tensor, how to write a select, a logical or, a square root, whether a sub-expression used twice
must be bound to a local first, and how text is put together (``fmt``: the numba dialect also
records which locals an expression reads). The formulas:

* ``number / tensor`` is ``reciprocal(tensor) * number`` (torch's ``__rtruediv__``);
* ``sign``: ``(0 < x) - (x < 0)``, NaN gives 0; ``maximum``, ``clamp`` and ``clamp_min``
  propagate NaN; ``rsqrt`` is ``1 / sqrt(x)``, the root correctly rounded (ATen's kernel);
  ``sqrt_rn`` the correctly rounded root (the fused kernels');
* ``add(a, b, alpha)`` = ``a + alpha * b``; ``addcmul`` = ``a + (value * b) * c``;
  ``addcdiv`` = ``a + (value * b) / c``;
* ``lerp(a, b, w)``: ATen's two branches, ``a + w * (b - a)`` for ``|w| < 0.5``, else
  ``(w - 1) * (b - a) + b`` (the vectorized kernel's form; which branch is fixed per program
  *variant*, see ``lerp_variant``);
* where torch's vectorized kernel rounds ``a * b + c`` once (``fused``: some of ``add``,
  ``addcmul``, ``lerp``, measured by the numba engine's ``probes.torch_fusion``), the dialect's ``fma``.

Every scalar and constant is a named float32 variable: numexpr and numba would compute a
float literal in float64.

A program of bfloat16 or float16 tensors (``low``: the ``low_precision.Rounding`` of their
dtype) computes every op as the float32 formula and rounds its result to that dtype
(``narrow``), as torch's kernels do, where the op rounds: each tensor-valued node of the IR is
one torch op (``number / tensor`` two: the reciprocal is rounded too), save ``neg``, ``abs``,
``sign`` and ``maximum``, whose result is one of their operands. The scalars of ``+``, ``-``,
a comparison and ``add``'s alpha are rounded to the dtype first (torch converts them to the
tensor's dtype), the others stay float32; the root is the correctly rounded one; and where
torch's scalar tail computes an op otherwise than its vector body (``add`` with an alpha,
``maximum`` of opposite zeros, ``lerp``'s second branch's zeros: ``Rounding``), the formula
selects on ``in_tail()``, true in those elements. A NaN result is stored as torch's op stores it
(``Rounding.nan``: bfloat16's vector conversion gives 0xffff, its scalar tail 0x7fc0; ``maximum``
a NaN of its own; ``neg`` and ``abs`` flip bits): ``narrow`` takes the op.
"""

from __future__ import annotations

import functools

import numpy as np

from ..spec.ir import COMPARISONS, Bin, Call, Const, Scalar, Tensor, walk

_F32 = np.float32


def scalar_var(name: str) -> str:
    return "s_" + name


def lerp_complement_var(name: str) -> str:
    """The variable holding ``w - 1`` (float32; exactly ``-(1 - w)``) for a lerp weight ``w``."""
    return "s_" + name + "__m1"


def const_var(value: float) -> str:
    """A stable identifier for a float32 constant (its bits)."""
    bits = np.array(value, dtype=_F32).view(np.uint32).item()
    return f"c_{bits:08x}"


@functools.lru_cache(maxsize=1024)
def lerp_weights(program) -> tuple:
    """The scalar names used as lerp weights, in order of first use (remembered per program:
    a step asks every time)."""
    names = []
    for st in program.statements:
        for node in walk(st.expr):
            if isinstance(node, Call) and node.fn == "lerp" and node.args[2].name not in names:
                names.append(node.args[2].name)
    return tuple(names)


# A double rounds to a float32 below 0.5 exactly when it is below this: the midpoint between
# 0.5 and the float32 below it (0.5 - 2**-25), where rounding to nearest-even gives 0.5.
_BELOW_HALF_F32 = 0.5 - 2.0**-26


def lerp_variant(scalars: dict, weights) -> tuple:
    """Which of ATen's two lerp formulas each weight takes: ``abs(weight) < 0.5`` in float32
    (compared on the double, ``_BELOW_HALF_F32``: a NaN is not small, as in float32)."""
    return tuple([bool(abs(scalars[w]) < _BELOW_HALF_F32) for w in weights])


def scalar_env(scalars: dict, weights=()) -> dict:
    """The compiled engines' scalar variables: float32 values (never float64 literals)."""
    env = {scalar_var(k): _F32(v) for k, v in scalars.items()}
    for w in weights:
        env[lerp_complement_var(w)] = env[scalar_var(w)] - _F32(1.0)
    return env


# the functions whose result is one of their (representable) operands: never rounded, but where
# torch's 16-bit kernel stores its own NaN (``Rounding.nan``)
_EXACT = frozenset({"neg", "abs", "sign", "maximum"})
# the functions whose NaN a measured op stands for (``low_precision.NAN_OPS``)
_NAN_OP = {"clamp_min": "clamp", "sqrt_rn": "sqrt"}


class Lowering:
    """Expression -> source text. Subclasses define the dialect (the methods that raise).
    ``low``: the ``low_precision.Rounding`` of a bfloat16 or float16 program, else None."""

    def __init__(self, program, variant: tuple, fused=frozenset(), low=None):
        self.lerp_small = dict(zip(lerp_weights(program), variant, strict=True))
        self.low = low
        # a fused program's remainder (``ir.in_remainder``): selected on the item's tail flag
        self.remainder_step = getattr(program, "remainder_step", 0)
        self.fused = frozenset(fused) if low is None else low.fused
        self.scalars: list[str] = []  # scalar variables used, in order
        self.consts: dict[str, float] = {}  # constant variable -> value

    # -- the dialect -------------------------------------------------------------------------
    def tensor(self, name: str) -> str:
        raise NotImplementedError

    def select(self, cond: str, a: str, b: str) -> str:
        raise NotImplementedError

    def either(self, x: str, y: str) -> str:
        raise NotImplementedError

    def sqrt(self, x: str) -> str:
        raise NotImplementedError

    def correct_sqrt(self, x: str) -> str:
        """The correctly rounded square root (``rsqrt``'s: ATen computes ``1 / std::sqrt``)."""
        raise NotImplementedError

    def fma(self, a: str, b: str, c: str) -> str:
        """``a * b + c`` rounded once (only called for functions in ``fused``)."""
        raise NotImplementedError

    def narrow(self, x: str, op: str = "round") -> str:
        """``x`` (float32) rounded to the low-precision dtype, as float32 (``low`` programs);
        where it is NaN, the NaN torch's ``op`` stores (``Rounding.nan``) in the body or the
        tail."""
        raise NotImplementedError

    def in_tail(self) -> str:
        """A condition true in the elements torch's scalar tail computes (``low`` programs)."""
        raise NotImplementedError

    def bind(self, code: str) -> str:
        """A name for a sub-expression used more than once (default: repeat it)."""
        return code

    def fmt(self, template: str, *parts) -> str:
        """``template.format(*parts)``: every piece of text a formula puts together goes
        through here, so a dialect can follow what the pieces read (see numba's lowering)."""
        return template.format(*parts)

    # -- leaves -------------------------------------------------------------------------------
    def scalar(self, name: str) -> str:
        var = scalar_var(name)
        if var not in self.scalars:
            self.scalars.append(var)
        return var

    def const(self, value: float) -> str:
        name = const_var(value)
        self.consts[name] = value
        return name

    def __call__(self, e) -> str:
        if isinstance(e, Tensor):
            return self.tensor(e.name)
        if isinstance(e, Scalar):
            return self.scalar(e.name)
        if isinstance(e, Const):
            return self.const(e.value)
        if isinstance(e, Bin):
            code = self._binary(e)
            if self.low is None or e.op in COMPARISONS:
                return code
            return self.narrow(code)  # one torch op: its result in the dtype
        code = getattr(self, "fn_" + e.fn)(*e.args)
        if self.low is None or e.fn == "sign":
            return code
        op = _NAN_OP.get(e.fn, e.fn)
        if e.fn in _EXACT and self.low.nan(op) == ("kept", "kept"):
            return code  # an operand, its bits as they are
        # (an operand's value is its own narrowing: only a NaN can change, as torch's op has it)
        return self.narrow(code, op)

    def _binary(self, e):
        if e.op == "/" and not e.a.is_tensor():
            # torch computes number / tensor as reciprocal(tensor) * number (two ops)
            recip = self.fmt("({} / {})", self.const(1.0), self(e.b))
            return self.fmt("({} * {})", recip if self.low is None else self.narrow(recip), self(e.a))
        a, b = self(e.a), self(e.b)
        if self.low is not None and e.op in ("+", "-", *COMPARISONS):
            # the scalar converted to the tensor's dtype (add's other operand, a comparison's)
            a, b = (x if side.is_tensor() else self.narrow(x) for x, side in ((a, e.a), (b, e.b)))
        return self.fmt("({} {} {})", a, e.op, b)

    # -- torch's float32 formulas, in torch's rounding order ---------------------------------
    def fn_remainder(self, body, tail):
        if not self.remainder_step:
            return self(body)
        if self.low is not None:  # (its items' tail flags are torch's for-loop tails)
            raise ValueError("a fused kernel's remainder in a program rounded to 16 bits op by op")
        return self.select(self.in_tail(), self(tail), self(body))

    def fn_neg(self, x):
        return self.fmt("(-{})", self(x))

    def fn_sqrt(self, x):
        if self.low is not None:  # the float32 root, correctly rounded, then rounded once
            return self.correct_sqrt(self(x))
        return self.sqrt(self(x))

    def fn_sqrt_rn(self, x):
        return self.correct_sqrt(self(x))

    def fn_rsqrt(self, x):
        if self.low is not None:
            # (its scalar tail rounds otherwise than its body, unmeasured: only the staged specs,
            # which refuse 16-bit parameters, take it)
            raise NotImplementedError("rsqrt of a bfloat16 or float16 tensor is not modelled")
        return self.fmt("({} / {})", self.const(1.0), self.correct_sqrt(self(x)))

    def fn_abs(self, x):
        return self.fmt("abs({})", self(x))

    def fn_sign(self, x):
        x, zero = self.bind(self(x)), self.const(0.0)
        minus = self.select(self.fmt("{} < {}", x, zero), self.const(-1.0), zero)
        return self.select(self.fmt("{} > {}", x, zero), self.const(1.0), minus)

    def fn_maximum(self, a, b):
        a, b = self.bind(self(a)), self.bind(self(b))
        # the vectorized kernel's: b where they are equal (+0 and -0) or b is NaN (a NaN: a
        # 16-bit program's narrowing gives torch's, Rounding.nan)
        second = self.select(self.either(self.fmt("{} > {}", a, b), self.fmt("{} != {}", a, a)), a, b)
        if self.low is None or self.low.kind("maximum") == self.low.kind("maximum", tail=True):
            return second
        # the scalar loop's std::max: a where they are equal
        first = self.select(self.either(self.fmt("{} < {}", a, b), self.fmt("{} != {}", b, b)), b, a)
        body, tail = (first, second) if self.low.kind("maximum") == "first" else (second, first)
        return self.select(self.in_tail(), tail, body)

    def fn_where(self, c, a, b):
        return self.select(self(c), self(a), self(b))

    def fn_clamp(self, x, lo, hi):
        # min(max(x, lo), hi), NaN propagating
        x, lo, hi = self.bind(self(x)), self(lo), self(hi)
        low = self.bind(self.select(self.fmt("{} < {}", x, lo), lo, x))
        return self.select(self.fmt("{} > {}", low, hi), hi, low)

    def fn_clamp_min(self, x, lo):
        x, lo = self.bind(self(x)), self(lo)
        return self.select(self.fmt("{} < {}", x, lo), lo, x)

    def _scaled(self, scale, x):
        if isinstance(scale, Const) and scale.value == 1.0:
            return self(x)
        return self.fmt("({} * {})", self(scale), self(x))

    def fn_add(self, a, b, alpha):
        if isinstance(alpha, Const) and alpha.value in (1.0, -1.0):
            return self.fmt("({} {} {})", self(a), "+" if alpha.value == 1.0 else "-", self(b))
        if self.low is not None:
            return self._low_add(a, b, alpha)
        if "add" in self.fused:
            return self.fma(self(alpha), self(b), self(a))
        return self.fmt("({} + {})", self(a), self._scaled(alpha, b))

    def _low_add(self, a, b, alpha):
        """``add`` of a low-precision program: the alpha in the dtype; the body's formula, or
        the tail's where they differ (the scalar lambda: the product rounded too)."""
        a, b, alpha = self.bind(self(a)), self.bind(self(b)), self.narrow(self(alpha))

        def formula(kind):
            if kind == "fma":
                return self.fma(alpha, b, a)
            product = self.fmt("({} * {})", alpha, b)
            return self.fmt("({} + {})", a, self.narrow(product) if kind == "rounded" else product)

        body, tail = self.low.kind("add"), self.low.kind("add", tail=True)
        if body == tail:
            return formula(body)
        return self.select(self.in_tail(), formula(tail), formula(body))

    def fn_addcmul(self, a, b, c, value):
        if self.low is not None and self.low.kind("addcmul") != self.low.kind("addcmul", tail=True):
            # (operands bound once: both formulas read them)
            vb, c, a = self.bind(self._scaled(value, b)), self.bind(self(c)), self.bind(self(a))
            tail = self._addcmul(a, vb, c, self.low.kind("addcmul", tail=True) == "fma")
            return self.select(self.in_tail(), tail, self._addcmul(a, vb, c, "addcmul" in self.fused))
        if "addcmul" in self.fused:
            return self.fma(self._scaled(value, b), self(c), self(a))
        return self.fmt("({} + ({} * {}))", self(a), self._scaled(value, b), self(c))

    def _addcmul(self, a, vb, c, fused):
        return self.fma(vb, c, a) if fused else self.fmt("({} + ({} * {}))", a, vb, c)

    def fn_addcdiv(self, a, b, c, value):
        return self.fmt("({} + ({} / {}))", self(a), self._scaled(value, b), self(c))

    def fn_lerp(self, a, b, w):
        a, b = self.bind(self(a)), self.bind(self(b))
        fused = "lerp" in self.fused
        if self.lerp_small[w.name]:
            w = self.scalar(w.name)
            small = self._lerp_small(a, b, w, fused)
            if self.low is not None and self.low.kind("lerp") != self.low.kind("lerp", tail=True):
                tail = self._lerp_small(a, b, w, self.low.kind("lerp", tail=True) == "fma")
                return self.select(self.in_tail(), tail, small)
            return small
        comp = lerp_complement_var(w.name)
        if comp not in self.scalars:
            self.scalars.append(comp)
        # (w - 1) * (end - start) + end, as ATen's vectorized lerp (lerp_vec) computes the
        # branch; its scalar loop's end - (end - start) * (1 - w) has the same magnitude, and
        # differs only in the sign of a zero (lerp(+0, -0, 1): -0 vectorized, +0 scalar),
        # which a low-precision program's tail takes as the scalar loop does
        body = self._lerp_big(comp, b, a, fused)
        if self.low is None:
            return body
        tail = self._lerp_big_tail(self.scalar(w.name), a, b, self.low.kind("lerp", tail=True) == "fma")
        return self.select(self.in_tail(), tail, body)

    def _lerp_small(self, a, b, w, fused):
        if fused:
            return self.fma(w, self.fmt("({} - {})", b, a), a)
        return self.fmt("({} + ({} * ({} - {})))", a, w, b, a)

    def _lerp_big(self, comp, b, a, fused):
        if fused:
            return self.fma(comp, self.fmt("({} - {})", b, a), b)
        return self.fmt("(({} * ({} - {})) + {})", comp, b, a, b)

    def _lerp_big_tail(self, w, a, b, fused):
        """ATen's scalar lerp, ``end - (end - start) * (1 - w)`` (contracted: one rounding)."""
        one_minus_w = self.fmt("({} - {})", self.const(1.0), w)
        if fused:
            return self.fma(self.fmt("({} - {})", a, b), one_minus_w, b)
        return self.fmt("({} - (({} - {}) * {}))", b, b, a, one_minus_w)
