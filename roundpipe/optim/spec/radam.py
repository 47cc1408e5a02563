"""RAdam: ``torch.optim.radam._single_tensor_radam`` (capturable=False branch).

The variance rectification depends on the step: ``rectify`` (``rho_t > 5``) selects the
program, as torch's Python ``if`` does.
"""

import torch

from .blocks import adam_moments, gradient, moment_scalars, weight_decay_scalars
from .core import OptimizerSpec, to_scalar, value, zero_step, zeros_like
from .ir import add, sqrt


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
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
    step_t = state["step"]
    step_t += 1
    step = value(step_t)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    # maximum length of the approximated SMA, and its length at this step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
    out = {
        "rectify": bool(rho_t > 5.0),
        **weight_decay_scalars(group, lr),
        **moment_scalars(beta1, beta2),
        "bias_correction1": bias_correction1,
        "lr": lr,
    }
    if out["rectify"]:
        out["rect"] = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        out["bias_correction2_sqrt"] = bias_correction2**0.5
        out["eps"] = group["eps"]
    return out


def program(o, b):
    s = b.s
    param = b.tensor("param")
    exp_avg, exp_avg_sq = b.tensor("exp_avg"), b.tensor("exp_avg_sq")
    grad = gradient(o, b)
    adam_moments(b, grad)
    bias_corrected_exp_avg = exp_avg / s.bias_correction1
    if o.rectify:
        adaptive_lr = b.let("adaptive_lr", s.bias_correction2_sqrt / (sqrt(exp_avg_sq) + s.eps))
        b.assign(param, add(param, bias_corrected_exp_avg * s.lr * adaptive_lr * s.rect, alpha=-1.0))
    else:
        b.assign(param, add(param, bias_corrected_exp_avg * s.lr, alpha=-1.0))


RADAM = OptimizerSpec(
    "RAdam", torch.optim.RAdam, init_state, options, inputs, scalars, program, flags=("rectify",)
)
