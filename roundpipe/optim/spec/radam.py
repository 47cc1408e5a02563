"""RAdam: ``torch.optim.radam._single_tensor_radam`` (capturable=False branch).

The variance rectification depends on the step: ``rectify`` (``rho_t > 5``) selects the
program, as torch's Python ``if`` does.
"""

import torch

from . import shared
from .core import OptimizerSpec, advance_step, to_scalar, zero_step
from .ir import add, sqrt


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
        shared.moment_state(p, state)


options, inputs = shared.decay_options, shared.moment_inputs  # the Adam family's, without AMSGrad


def scalars(group, state):
    lr = to_scalar(group["lr"])
    beta1, beta2 = group["betas"]
    step = advance_step(state)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    # maximum length of the approximated SMA, and its length at this step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
    out = {
        "rectify": bool(rho_t > 5.0),
        **shared.weight_decay_scalars(group, lr),
        **shared.moment_scalars(beta1, beta2),
        "bias_correction1": bias_correction1,
        "lr": lr,
    }
    if out["rectify"]:
        out["rect"] = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        out["bias_correction2_sqrt"] = bias_correction2**0.5
        out["eps"] = group["eps"]
    return out


def statements(o, b):
    s, param = b.s, b.tensor("param")
    grad = shared.gradient(o, b, complex_decay=False)
    exp_avg, exp_avg_sq = shared.adam_moments(b, grad)
    bias_corrected_exp_avg = exp_avg / s.bias_correction1
    if o.rectify:
        adaptive_lr = b.let("adaptive_lr", s.bias_correction2_sqrt / (sqrt(exp_avg_sq) + s.eps))
        b.assign(param, add(param, bias_corrected_exp_avg * s.lr * adaptive_lr * s.rect, alpha=-1.0))
    else:
        b.assign(param, add(param, bias_corrected_exp_avg * s.lr, alpha=-1.0))


RADAM = OptimizerSpec(
    "RAdam",
    torch.optim.RAdam,
    init_state,
    options,
    inputs,
    scalars,
    statements,
    flags=("rectify",),
    # with the default betas, it rectifies from step 6 on
    low_precision_scalars=shared.tensor_weight_scalars("one_minus_beta1", "betas", 0),
    rich_kwargs=dict(lr=0.01, weight_decay=0.1),
    fidelity_kwargs=dict(lr=1e-2),
)
