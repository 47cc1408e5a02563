"""Adam and AdamW: ``torch.optim.adam._single_tensor_adam`` (capturable=False branch).

AdamW is this spec with ``decoupled_weight_decay=True`` in its param groups, exactly as
``torch.optim.AdamW`` is ``torch.optim.Adam`` with that flag.
"""

import torch

from .blocks import adam_moments, gradient, moment_scalars, weight_decay_scalars
from .core import OptimizerSpec, to_scalar, value, zero_step, zeros_like
from .ir import addcdiv, maximum, sqrt


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
        state["exp_avg"] = zeros_like(p)
        state["exp_avg_sq"] = zeros_like(p)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = zeros_like(p)


def options(group):
    return {
        "maximize": group["maximize"],
        "weight_decay": group["weight_decay"] != 0,
        "decoupled_weight_decay": group["decoupled_weight_decay"],
        "amsgrad": group["amsgrad"],
    }


def scalars(group, state):
    lr = to_scalar(group["lr"])
    beta1, beta2 = (to_scalar(b) for b in group["betas"])
    step_t = state["step"]
    step_t += 1
    step = value(step_t)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    return {
        **weight_decay_scalars(group, lr),
        **moment_scalars(beta1, beta2),
        "bias_correction2_sqrt": bias_correction2**0.5,
        "eps": group["eps"],
        "neg_step_size": -step_size,
    }


def inputs(o):
    return ["param", "grad", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if o.amsgrad else [])


def program(o, b):
    s = b.s
    param = b.tensor("param")
    exp_avg, exp_avg_sq = b.tensor("exp_avg"), b.tensor("exp_avg_sq")
    grad = gradient(o, b)
    adam_moments(b, grad)
    second_moment = exp_avg_sq
    if o.amsgrad:
        second_moment = b.assign(b.tensor("max_exp_avg_sq"), maximum(b.tensor("max_exp_avg_sq"), exp_avg_sq))
    denom = b.let("denom", sqrt(second_moment) / s.bias_correction2_sqrt + s.eps)
    b.assign(param, addcdiv(param, exp_avg, denom, value=s.neg_step_size))


ADAM = OptimizerSpec("Adam", torch.optim.Adam, init_state, options, inputs, scalars, program)
ADAMW = OptimizerSpec("AdamW", torch.optim.AdamW, init_state, options, inputs, scalars, program)
