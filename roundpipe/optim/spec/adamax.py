"""Adamax: ``torch.optim.adamax._single_tensor_adamax`` (not differentiable, not capturable).

The running infinity norm is ``torch.maximum(exp_inf * beta2, |grad| + eps)``, so NaN
propagates from either side as in torch.
"""

import torch

from . import shared
from .core import OptimizerSpec, advance_step, to_scalar, zero_step, zeros_like
from .ir import abs_, addcdiv, lerp, maximum
from .shared import gradient


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
        state["exp_avg"] = zeros_like(p)
        state["exp_inf"] = zeros_like(p)


def options(group):
    return {"maximize": group["maximize"], "weight_decay": group["weight_decay"] != 0}


def inputs(o):
    return ["param", "grad", "exp_avg", "exp_inf"]


def scalars(group, state):
    lr = to_scalar(group["lr"])
    beta1, beta2 = group["betas"]
    bias_correction = 1 - beta1 ** advance_step(state)
    clr = lr / bias_correction
    return {
        "weight_decay": group["weight_decay"],
        "one_minus_beta1": 1 - beta1,
        "beta2": beta2,
        "eps": group["eps"],
        "neg_clr": -clr,
    }


def statements(o, b):
    s = b.s
    param = b.tensor("param")
    exp_avg, exp_inf = b.tensor("exp_avg"), b.tensor("exp_inf")
    grad = gradient(o, b)
    b.assign(exp_avg, lerp(exp_avg, grad, s.one_minus_beta1))
    b.assign(exp_inf, maximum(exp_inf * s.beta2, abs_(grad) + s.eps))
    b.assign(param, addcdiv(param, exp_avg, exp_inf, value=s.neg_clr))


ADAMAX = OptimizerSpec(
    "Adamax",
    torch.optim.Adamax,
    init_state,
    options,
    inputs,
    scalars,
    statements,
    low_precision_scalars=shared.tensor_weight_scalars("one_minus_beta1", "betas", 0),
    rich_kwargs=dict(lr=0.01, weight_decay=0.1),
    fidelity_kwargs=dict(lr=1e-2),
)
