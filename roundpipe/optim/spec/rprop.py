"""Rprop: ``torch.optim.rprop._single_tensor_rprop`` (capturable=False branch).

torch maps ``sign(grad * prev)`` to ``etaplus`` / ``etaminus`` / 1 with boolean indexing and
zeroes the gradient where that factor equals ``etaminus`` (the sign flipped); here the same is
written with ``where``. As in torch, a NaN product counts as 0 (torch.sign(NaN) is 0 on the CPU).
"""

import torch

from .core import OptimizerSpec, to_scalar, zero_step, zeros_like
from .ir import addcmul, clamp, sign, where
from .shared import gradient


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
        state["prev"] = zeros_like(p)
        if p.dtype.is_complex:
            state["step_size"] = torch.full_like(p, complex(group["lr"], group["lr"]))
        else:
            state["step_size"] = torch.full_like(p, to_scalar(group["lr"]))


def options(group):
    return {"maximize": group["maximize"]}


def inputs(o):
    return ["param", "grad", "prev", "step_size"]


def scalars(group, state):
    etaminus, etaplus = group["etas"]
    step_size_min, step_size_max = group["step_sizes"]
    state["step"] += 1
    return {
        "etaminus": etaminus,
        "etaplus": etaplus,
        "step_size_min": step_size_min,
        "step_size_max": step_size_max,
    }


def statements(o, b):
    s = b.s
    param = b.tensor("param")
    prev, step_size = b.tensor("prev"), b.tensor("step_size")
    grad = gradient(o, b)
    direction = b.let("direction", grad * prev)  # torch: sign = grad.mul(prev).sign()
    factor = b.let("factor", where(direction > 0, s.etaplus, where(direction < 0, s.etaminus, 1.0)))
    b.assign(step_size, clamp(step_size * factor, s.step_size_min, s.step_size_max))
    # torch: grad[sign.eq(etaminus)] = 0, the etaminus rounded to the parameter's dtype. Of the
    # factor's values (etaplus >= 1 >= etaminus, rounded) the ones equal to etaminus are those
    # at most etaminus: where it rounds to 1 (0.999 in bfloat16) the unchanged signs count too
    grad = b.let("grad", where(factor <= s.etaminus, 0.0, grad))
    b.assign(param, addcmul(param, sign(grad), step_size, value=-1))
    b.assign(prev, grad)


RPROP = OptimizerSpec(
    "Rprop",
    torch.optim.Rprop,
    init_state,
    options,
    inputs,
    scalars,
    statements,
    rich_kwargs=dict(lr=0.01, etas=(0.4, 1.3)),
    fidelity_kwargs={},
)
