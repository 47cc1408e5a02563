"""Adam and AdamW: ``torch.optim.adam._single_tensor_adam`` (capturable=False branch).

AdamW is this spec with ``decoupled_weight_decay=True`` in its param groups, exactly as
``torch.optim.AdamW`` is ``torch.optim.Adam`` with that flag.
"""

import torch

from .core import OptimizerSpec, to_scalar, value, zero_step, zeros_like
from .ir import add, addcdiv, addcmul, lerp, maximum, sqrt


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
    weight_decay = group["weight_decay"]
    step_t = state["step"]
    step_t += 1
    step = value(step_t)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    return {
        "weight_decay": weight_decay,
        "weight_decay_factor": 1 - lr * weight_decay,
        "one_minus_beta1": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        "bias_correction2_sqrt": bias_correction2**0.5,
        "eps": group["eps"],
        "neg_step_size": -step_size,
    }


def inputs(o):
    return ["param", "grad", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if o.amsgrad else [])


def program(o, b):
    s = b.s
    param, grad = b.tensor("param"), b.tensor("grad")
    exp_avg, exp_avg_sq = b.tensor("exp_avg"), b.tensor("exp_avg_sq")
    if o.maximize:
        grad = b.let("grad", -grad)
    if o.weight_decay:
        if o.decoupled_weight_decay:
            b.assign(param, param * s.weight_decay_factor)
        else:
            grad = b.let("grad", add(grad, param, alpha=s.weight_decay))
    b.assign(exp_avg, lerp(exp_avg, grad, s.one_minus_beta1))
    b.assign(exp_avg_sq, addcmul(exp_avg_sq * s.beta2, grad, grad, value=s.one_minus_beta2))
    second_moment = exp_avg_sq
    if o.amsgrad:
        second_moment = b.assign(b.tensor("max_exp_avg_sq"), maximum(b.tensor("max_exp_avg_sq"), exp_avg_sq))
    denom = b.let("denom", sqrt(second_moment) / s.bias_correction2_sqrt + s.eps)
    b.assign(param, addcdiv(param, exp_avg, denom, value=s.neg_step_size))


ADAM = OptimizerSpec("Adam", torch.optim.Adam, init_state, options, inputs, scalars, program)
ADAMW = OptimizerSpec("AdamW", torch.optim.AdamW, init_state, options, inputs, scalars, program)
