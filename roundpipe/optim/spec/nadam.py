"""NAdam: ``torch.optim.nadam._single_tensor_nadam`` (capturable=False branch).

``mu_product`` is a per-parameter 0-d float32 state tensor multiplied in place each step, as
torch does; the two ``addcdiv`` coefficients are computed from its float32 value.
"""

import torch

from .blocks import adam_moments, gradient, moment_scalars, weight_decay_scalars
from .core import OptimizerSpec, to_scalar, value, zero_step, zeros_like
from .ir import addcdiv, sqrt


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
        state["mu_product"] = torch.tensor(1.0, dtype=zero_step().dtype)
        state["exp_avg"] = zeros_like(p)
        state["exp_avg_sq"] = zeros_like(p)


def options(group):
    return {
        "maximize": group["maximize"],
        "weight_decay": group["weight_decay"] != 0,
        "decoupled_weight_decay": group["decoupled_weight_decay"],
    }


def inputs(o):
    return ["param", "grad", "exp_avg", "exp_avg_sq"]


def scalars(group, state):
    lr = to_scalar(group["lr"])
    beta1, beta2 = group["betas"]
    momentum_decay = group["momentum_decay"]
    step_t, mu_product = state["step"], state["mu_product"]
    step_t += 1
    step = value(step_t)
    bias_correction2 = 1 - beta2**step
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * momentum_decay)))
    mu_product *= mu
    mu_product_next = value(mu_product) * mu_next
    return {
        **weight_decay_scalars(group, lr),
        **moment_scalars(beta1, beta2),
        "bias_correction2": bias_correction2,
        "eps": group["eps"],
        "grad_coef": -lr * (1.0 - mu) / (1.0 - value(mu_product)),
        "exp_avg_coef": (-lr * mu_next) / (1.0 - mu_product_next),
    }


def program(o, b):
    s = b.s
    param = b.tensor("param")
    exp_avg, exp_avg_sq = b.tensor("exp_avg"), b.tensor("exp_avg_sq")
    grad = gradient(o, b)
    adam_moments(b, grad)
    denom = b.let("denom", sqrt(exp_avg_sq / s.bias_correction2) + s.eps)
    b.assign(param, addcdiv(param, grad, denom, value=s.grad_coef))
    b.assign(param, addcdiv(param, exp_avg, denom, value=s.exp_avg_coef))


NADAM = OptimizerSpec(
    "NAdam",
    torch.optim.NAdam,
    init_state,
    options,
    inputs,
    scalars,
    program,
    scalar_state=("step", "mu_product"),
)
