"""Adam and AdamW: ``torch.optim.adam._single_tensor_adam`` (capturable=False branch).

AdamW is this spec with ``decoupled_weight_decay=True`` in its param groups, exactly as
``torch.optim.AdamW`` is ``torch.optim.Adam`` with that flag (torch >= 2.7). Before 2.7 AdamW
is a class of its own whose ``_single_tensor_adamw`` is this update with the decay always
decoupled (``param.mul_(1 - lr * weight_decay)``, which is exact at ``weight_decay=0``), and
whose param groups have no ``decoupled_weight_decay``.
"""

import inspect

import torch

from . import shared
from .core import OptimizerSpec, advance_step, to_scalar, zero_step, zeros_like
from .ir import addcdiv, maximum, sqrt


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
        shared.moment_state(p, state)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = zeros_like(p)


# torch >= 2.7: every Adam param group has ``decoupled_weight_decay`` (AdamW's is True); before,
# Adam ignores the key (a state_dict from NAdam may carry it) and AdamW always decouples.
_GROUPS_DECOUPLE = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters


def options(group):
    decoupled = None if _GROUPS_DECOUPLE else False
    return {**shared.decay_options(group, decoupled), "amsgrad": group["amsgrad"]}


def adamw_options(group):
    decoupled = None if _GROUPS_DECOUPLE else True
    return {**shared.decay_options(group, decoupled), "amsgrad": group["amsgrad"]}


def scalars(group, state):
    lr = to_scalar(group["lr"])
    beta1, beta2 = (to_scalar(b) for b in group["betas"])
    step = advance_step(state)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    return {
        **shared.weight_decay_scalars(group, lr),
        **shared.moment_scalars(beta1, beta2),
        "bias_correction2_sqrt": bias_correction2**0.5,
        "eps": group["eps"],
        "neg_step_size": -step_size,
    }


def inputs(o):
    return [*shared.MOMENT_INPUTS] + (["max_exp_avg_sq"] if o.amsgrad else [])


def statements(o, b):
    s, param = b.s, b.tensor("param")
    grad = shared.gradient(o, b)
    exp_avg, exp_avg_sq = shared.adam_moments(b, grad)
    second_moment = exp_avg_sq
    if o.amsgrad:
        second_moment = b.assign(b.tensor("max_exp_avg_sq"), maximum(b.tensor("max_exp_avg_sq"), exp_avg_sq))
    denom = b.let("denom", sqrt(second_moment) / s.bias_correction2_sqrt + s.eps)
    b.assign(param, addcdiv(param, exp_avg, denom, value=s.neg_step_size))


ADAM = OptimizerSpec(
    "Adam",
    torch.optim.Adam,
    init_state,
    options,
    inputs,
    scalars,
    statements,
    rich_kwargs=dict(lr=0.01, weight_decay=0.1, amsgrad=True),
    fidelity_kwargs=dict(lr=1e-2, weight_decay=1e-3),
)
ADAMW = OptimizerSpec(
    "AdamW",
    torch.optim.AdamW,
    init_state,
    adamw_options,
    inputs,
    scalars,
    statements,
    # AdamW decays by default (weight_decay=0.01)
    rich_kwargs=dict(lr=0.01, amsgrad=True),
    fidelity_kwargs=dict(lr=1e-2, amsgrad=True),
)
