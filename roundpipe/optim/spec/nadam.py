"""NAdam: ``torch.optim.nadam._single_tensor_nadam`` (capturable=False branch).

``mu_product`` is a per-parameter 0-d float32 state tensor multiplied in place each step, as
torch does; the two ``addcdiv`` coefficients are computed from its float32 value.
"""

import torch

from . import shared
from .core import OptimizerSpec, advance_step, to_scalar, value, zero_step
from .ir import addcdiv, sqrt


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
        state["mu_product"] = torch.tensor(1.0, dtype=zero_step().dtype)
        shared.moment_state(p, state)


options, inputs = shared.decay_options, shared.moment_inputs  # the Adam family's, without AMSGrad


def scalars(group, state):
    lr = to_scalar(group["lr"])
    beta1, beta2 = group["betas"]
    momentum_decay = group["momentum_decay"]
    mu_product = state["mu_product"]
    step = advance_step(state)
    bias_correction2 = 1 - beta2**step
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * momentum_decay)))
    mu_product *= mu
    mu_product_next = value(mu_product) * mu_next
    return {
        **shared.weight_decay_scalars(group, lr),
        **shared.moment_scalars(beta1, beta2),
        "bias_correction2": bias_correction2,
        "eps": group["eps"],
        "grad_coef": -lr * (1.0 - mu) / (1.0 - value(mu_product)),
        "exp_avg_coef": (-lr * mu_next) / (1.0 - mu_product_next),
    }


def statements(o, b):
    s, param = b.s, b.tensor("param")
    grad = shared.gradient(o, b, complex_decay=False)
    exp_avg, exp_avg_sq = shared.adam_moments(b, grad)
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
    statements,
    scalar_state=("step", "mu_product"),
    low_precision_scalars=shared.tensor_weight_scalars("one_minus_beta1", "betas", 0),
    rich_kwargs=dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
    fidelity_kwargs=dict(lr=1e-2),
)
