"""RMSprop: ``torch.optim.rmsprop._single_tensor_rmsprop`` (centered and momentum variants)."""

import torch

from . import shared
from .core import OptimizerSpec, zero_step, zeros_like
from .ir import add, addcdiv, addcmul, lerp, sqrt
from .shared import average_scalars, gradient


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
        state["square_avg"] = zeros_like(p)
        if group["momentum"] > 0:
            state["momentum_buffer"] = zeros_like(p)
        if group["centered"]:
            state["grad_avg"] = zeros_like(p)


def options(group):
    return {
        "maximize": group["maximize"],
        "weight_decay": group["weight_decay"] != 0,
        "momentum": group["momentum"] > 0,
        "centered": group["centered"],
    }


def inputs(o):
    names = ["param", "grad", "square_avg"]
    if o.momentum:
        names.append("momentum_buffer")
    if o.centered:
        names.append("grad_avg")
    return names


def scalars(group, state):
    # lerp_weight: the same value as the lerp's weight, which a low-precision step rounds where
    # alpha is a tensor (``low_precision_scalars``) and addcmul's value never
    values = average_scalars(group, state, "alpha")
    return {**values, "lerp_weight": values["one_minus_alpha"], "momentum": group["momentum"]}


def statements(o, b):
    s = b.s
    param, square_avg = b.tensor("param"), b.tensor("square_avg")
    grad = gradient(o, b)
    b.assign(square_avg, addcmul(square_avg * s.alpha, grad, grad, value=s.one_minus_alpha))
    if o.centered:
        grad_avg = b.tensor("grad_avg")
        b.assign(grad_avg, lerp(grad_avg, grad, s.lerp_weight))
        avg = b.let("avg", sqrt(addcmul(square_avg, grad_avg, grad_avg, value=-1)) + s.eps)
    else:
        avg = b.let("avg", sqrt(square_avg) + s.eps)
    if o.momentum:
        buf = b.tensor("momentum_buffer")
        b.assign(buf, addcdiv(buf * s.momentum, grad, avg, value=1))
        b.assign(param, add(param, buf, alpha=s.neg_lr))
    else:
        b.assign(param, addcdiv(param, grad, avg, value=s.neg_lr))


RMSPROP = OptimizerSpec(
    "RMSprop",
    torch.optim.RMSprop,
    init_state,
    options,
    inputs,
    scalars,
    statements,
    low_precision_scalars=shared.tensor_weight_scalars("lerp_weight", "alpha"),
    rich_kwargs=dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1),
    fidelity_kwargs=dict(lr=1e-3, centered=True, momentum=0.5),
)
