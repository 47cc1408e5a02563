"""The ``reference`` backend: an interpreter that runs a spec program with plain torch ops.

Every IR operator and function maps to the torch op it is named after (``torch_ops.py``),
so this backend computes what ``torch.optim``'s for-loop computes, op for op, one tensor at
a time. ``let`` results are temporaries; ``assign`` copies the result into the target tensor
in place. It is slow (one temporary per operation) and meant for debugging and as a second
opinion.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..backend_api import Backend
from ..spec.core import GRAD_FACTOR, factors_of
from ..spec.ir import Assign, Bin, Call, Const, Let, Quantize, Reduce, Scalar, Tensor
from ..spec.modes import param_rounding
from ..storage import param_key, stochastic_round_
from . import composed, cut_at_remainder, segments
from .torch_ops import BINARY, FUNCTIONS, norm, quantize_

logger = logging.getLogger("roundpipe.optim")


def evaluate(expr, env, scalars, dtype=torch.float32):
    """``expr``'s value: a tensor, or a Python float for a scalar. ``dtype``: the parameter's,
    of a ``where`` between two scalars (torch's for-loop writes them into a tensor of the
    parameter's dtype, Rprop's ``sign[...] = etaplus``; ``torch.where`` of two Python floats
    would give the default dtype)."""
    if isinstance(expr, Tensor):
        return env[expr.name]
    if isinstance(expr, Scalar):
        return scalars[expr.name]
    if isinstance(expr, Const):
        return expr.value
    if isinstance(expr, Bin):
        return BINARY[expr.op](evaluate(expr.a, env, scalars, dtype), evaluate(expr.b, env, scalars, dtype))
    if isinstance(expr, Call):
        args = [evaluate(a, env, scalars, dtype) for a in expr.args]
        if expr.fn == "where" and not any(isinstance(a, torch.Tensor) for a in args[1:]):
            args[1] = torch.tensor(args[1], dtype=dtype)
        return FUNCTIONS[expr.fn](*args)
    raise TypeError(expr)


def run_program(program, scalars, tensors):
    """Run ``program`` once on ``tensors`` (name -> real float32, bfloat16 or float16 tensor, of
    one dtype; broadcast inputs in their own shapes): its reductions, by name."""
    env = dict(tensors)
    reduced = {}
    param = env.get("param")
    dtype = param.dtype if param is not None else torch.float32
    for st in program.statements:
        result = evaluate(st.expr, env, scalars, dtype)
        if isinstance(st, Reduce):
            reduced[st.name] = norm(result, st.dim)
        elif isinstance(st, Let):
            if isinstance(st.expr, Tensor):
                result = result.clone()  # a let is a snapshot, not an alias
            env[st.name] = result
        elif isinstance(st, Assign):
            env[st.target].copy_(result)
        elif isinstance(st, Quantize):
            quantize_(env[st.codes], env[st.blocks], env[st.codebook], result)
    return reduced


def run_stored(program, scalars, tensors, pid=None):
    """``program`` (stored widened: ``Program.storage``) once on one parameter's ``tensors``:
    each widened to float32, the program run on those (torch's float32 for-loop), each target
    rounded back to its dtype (nearest even; a STOCHASTIC program's parameter stochastically,
    from its id ``pid`` and this step's key, ``storage.py``). A bfloat16 or float16 parameter's
    own gradient is multiplied by the gradient factors in its dtype first (``unscaled``)."""
    wide = {n: t if t.dtype is torch.float32 else t.float() for n, t in tensors.items()}
    grad, scalars = unscaled(tensors.get("grad"), tensors["param"], scalars)
    if grad is not None:
        wide["grad"] = grad.float()
    run_program(program, scalars, wide)
    for n in program.targets:
        t = tensors[n]
        if t is wide[n]:
            continue
        if n == "param" and param_rounding(program.storage) == "stochastic":
            stochastic_round_(t, wide[n], param_key(step_key_of(scalars), pid))
        else:
            t.copy_(wide[n])


def unscaled(grad, param, scalars):
    """``(grad, scalars)``: a widened step's own 16-bit gradient times its gradient factors
    (``spec.core.gradient_factors``), each product rounded to its dtype as torch's unscale and
    clip round ``p.grad`` in place, and the scalars with those factors 1 (exact: the program's
    products in float32 then change nothing); ``(None, scalars)`` where there is nothing to do."""
    factors = factors_of(scalars)
    if not factors or grad is None or grad.dtype is torch.float32 or grad.dtype is not param.dtype:
        return None, scalars
    for f in factors:
        grad = grad * f
    return grad, {**scalars, **{f"{GRAD_FACTOR}{i}": 1.0 for i in range(len(factors))}}


def step_key_of(scalars) -> int:
    """The step's key from its two 16-bit halves (``modes.STOCHASTIC_SCALARS``)."""
    return (int(scalars["sr_hi"]) << 16) | int(scalars["sr_lo"])


def run_staged(program, scalars, tensors):
    """A staged step's pass: ``run_program`` on each parameter in turn; their reductions. A
    partner's low-precision gradient is widened first: the fp32 master gradient torch steps."""
    return [run_program(program, s, _widened(t)) for s, t in zip(scalars, tensors, strict=True)]


def _widened(tensors):
    grad = tensors.get("grad")
    if grad is None or grad.dtype == torch.float32:
        return tensors
    return {**tensors, "grad": grad.float()}


class ReferenceBackend(Backend):
    name = "reference"

    @property
    def exact(self) -> bool:
        return True  # the same torch ops as the for-loop (conformance.cases.BIT_EXACT)

    def prepare(self, program, scalars, columns, cache=None):
        """The launch of ``program`` on every parameter of ``columns`` (see ``backends``), one by
        one; partners (``masters.py``) by their defining composition."""
        cache = {} if cache is None else cache
        return composed(lambda *a: cut_at_remainder(self._prepare, *a), program, scalars, columns, cache)

    def prepare_staged(self, program, scalars, tensors, cache=None):
        return functools.partial(run_staged, program, scalars, tensors)

    def _prepare(self, program, scalars, columns, cache=None):
        ids = columns.get("sr_ids")
        columns = {n: c for n, c in columns.items() if n != "sr_ids"}
        names = list(columns)
        rows = list(zip(*columns.values(), strict=True))
        work = [
            (values, dict(zip(names, row, strict=True)), None if ids is None else ids[k])
            for values, start, stop in segments(scalars, len(rows))
            for k, row in enumerate(rows[start:stop], start)
        ]

        def launch():
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("backend=reference: %d parameters, one at a time", len(rows))
            for values, tensors, pid in work:
                if program.storage:
                    run_stored(program, values, tensors, pid)
                else:
                    run_program(program, values, tensors)

        return launch
