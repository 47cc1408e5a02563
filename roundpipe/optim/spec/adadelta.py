"""Adadelta: ``torch.optim.adadelta._single_tensor_adadelta``."""

import torch

from .core import OptimizerSpec, zero_step, zeros_like
from .ir import addcmul, sqrt
from .shared import add_on_complex, average_scalars, gradient


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
        state["square_avg"] = zeros_like(p)
        state["acc_delta"] = zeros_like(p)


def options(group):
    return {"maximize": group["maximize"], "weight_decay": group["weight_decay"] != 0}


def inputs(o):
    return ["param", "grad", "square_avg", "acc_delta"]


def scalars(group, state):
    return average_scalars(group, state, "rho")


def statements(o, b):
    s = b.s
    param = b.tensor("param")
    square_avg, acc_delta = b.tensor("square_avg"), b.tensor("acc_delta")
    grad = gradient(o, b)
    b.assign(square_avg, addcmul(square_avg * s.rho, grad, grad, value=s.one_minus_rho))
    std = b.let("std", sqrt(square_avg + s.eps))
    delta = b.let("delta", sqrt(acc_delta + s.eps) / std * grad)
    b.assign(acc_delta, addcmul(acc_delta * s.rho, delta, delta, value=s.one_minus_rho))
    b.assign(param, add_on_complex(o, param, delta, s.neg_lr))  # after view_as_complex


ADADELTA = OptimizerSpec(
    "Adadelta",
    torch.optim.Adadelta,
    init_state,
    options,
    inputs,
    scalars,
    statements,
    rich_kwargs=dict(lr=0.5, rho=0.8, weight_decay=0.1),
    fidelity_kwargs={},
)
