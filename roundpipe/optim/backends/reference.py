"""The ``reference`` backend: an interpreter that runs a spec program with plain torch ops.

Every IR function maps to the torch op it is named after (``torch.addcmul``, ``torch.lerp``,
...), so this backend computes what ``torch.optim``'s for-loop computes, op for op. ``let``
results are temporaries; ``assign`` copies the result into the target tensor in place.
It is slow (one temporary per operation) and meant for debugging and as a second opinion.
"""

from __future__ import annotations

import operator

import torch

from ..spec.ir import Assign, Bin, Call, Const, Let, Scalar, Tensor

# Python operators on tensors and numbers: the same torch ops, with a number applied as a
# float32 scalar, on either side.
_BIN = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    ">": operator.gt,
    "<": operator.lt,
    ">=": operator.ge,
    "<=": operator.le,
}


def _call(fn, args):
    if fn == "neg":
        return torch.neg(args[0])
    if fn == "sqrt":
        return torch.sqrt(args[0])
    if fn == "abs":
        return torch.abs(args[0])
    if fn == "sign":
        return torch.sign(args[0])
    if fn == "maximum":
        return torch.maximum(args[0], args[1])
    if fn == "where":
        return torch.where(*args)
    if fn == "clamp":
        return torch.clamp(args[0], args[1], args[2])
    if fn == "add":
        return torch.add(args[0], args[1], alpha=args[2])
    if fn == "addcmul":
        return torch.addcmul(args[0], args[1], args[2], value=args[3])
    if fn == "addcdiv":
        return torch.addcdiv(args[0], args[1], args[2], value=args[3])
    if fn == "lerp":
        return torch.lerp(args[0], args[1], args[2])
    raise NotImplementedError(fn)


def evaluate(expr, env, scalars):
    if isinstance(expr, Tensor):
        return env[expr.name]
    if isinstance(expr, Scalar):
        return scalars[expr.name]
    if isinstance(expr, Const):
        return expr.value
    if isinstance(expr, Bin):
        return _BIN[expr.op](evaluate(expr.a, env, scalars), evaluate(expr.b, env, scalars))
    if isinstance(expr, Call):
        return _call(expr.fn, [evaluate(a, env, scalars) for a in expr.args])
    raise TypeError(expr)


class ReferenceBackend:
    name = "reference"

    def run(self, program, items):
        """Run ``program`` for each ``(tensors, scalars)`` in ``items``.

        ``tensors`` maps the program's inputs to real (``view_as_real``) float32 tensors,
        ``scalars`` maps its scalar names to Python floats.
        """
        for tensors, scalars in items:
            env = dict(tensors)
            for st in program.statements:
                result = evaluate(st.expr, env, scalars)
                if isinstance(st, Let):
                    if isinstance(st.expr, Tensor):
                        result = result.clone()  # a let is a snapshot, not an alias
                    env[st.name] = result
                elif isinstance(st, Assign):
                    env[st.target].copy_(result)
