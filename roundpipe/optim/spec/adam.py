"""Adam and AdamW: ``torch.optim.adam._single_tensor_adam`` (capturable=False branch), and with
``fused=True`` torch's fused CPU kernel (``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``).

The fused kernel computes the for-loop's formulas in the for-loop's order, its multiply-adds
contracted as torch's ops contract them (``lerp``, ``addcmul``, ``add`` with an alpha), except
the root: ``Vec::sqrt``, correctly rounded (``sqrt_rn``), where ``torch.sqrt`` of float32 runs
MKL's routine, and ``bias_correction2_sqrt`` is ``std::sqrt`` rather than ``** 0.5``
(conformance/test_fused.py holds it against the kernel); in its scalar remainder
(``in_remainder``, ``fused_kernels.py``) ``exp_avg_sq`` is ``fma(exp_avg_sq, beta2, (1 - beta2)
* grad * grad)``. On a bfloat16 or float16 parameter
it is that float32 arithmetic on the widened tensors, each stored tensor rounded once: the step
runs widened (``plan``).

AdamW is this spec with ``decoupled_weight_decay=True`` in its param groups, exactly as
``torch.optim.AdamW`` is ``torch.optim.Adam`` with that flag (torch >= 2.7). Before 2.7 AdamW
is a class of its own whose ``_single_tensor_adamw`` is this update with the decay always
decoupled (``param.mul_(1 - lr * weight_decay)``, which is exact at ``weight_decay=0``), and
whose param groups have no ``decoupled_weight_decay``.
"""

import functools
import inspect
import math

import torch

from . import shared
from .core import OptimizerSpec, advance_step, to_scalar, zero_step, zeros_like
from .ir import addcdiv, maximum, sqrt, sqrt_rn


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
    return {**shared.decay_options(group, decoupled), **_own_options(group)}


def adamw_options(group):
    decoupled = None if _GROUPS_DECOUPLE else True
    return {**shared.decay_options(group, decoupled), **_own_options(group)}


def _own_options(group):
    # (``fused``: a key of torch's groups since 2.x; a group without it is the for-loop's)
    return {"amsgrad": group["amsgrad"], "fused": bool(group.get("fused"))}


def scalars(group, state):
    lr = to_scalar(group["lr"])
    beta1, beta2 = (to_scalar(b) for b in group["betas"])
    if group.get("fused"):  # the kernel takes doubles (a tensor's ``item()``), not tensor arithmetic
        lr, beta1, beta2 = float(lr), float(beta1), float(beta2)
    step = advance_step(state)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    return {
        **shared.weight_decay_scalars(group, lr),
        **shared.moment_scalars(beta1, beta2),
        "bias_correction2_sqrt": math.sqrt(bias_correction2) if group.get("fused") else bias_correction2**0.5,
        "eps": group["eps"],
        "neg_step_size": -step_size,
    }


@functools.cache
def _casts_tensor_beta1() -> bool:
    """Whether this torch's for-loop casts a tensor beta1 to the parameter's dtype before it
    takes ``1 - beta1`` (``device_beta1``: from torch 2.6 on, where it is a 0-d tensor): a probe,
    one step of a bfloat16 element, whose ``exp_avg`` is then the lerp weight as rounded."""
    p = torch.zeros(1, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.ones(1, dtype=torch.bfloat16)
    opt = torch.optim.Adam([p], betas=(torch.tensor(0.9), torch.tensor(0.999)), foreach=False)
    opt.step()
    cast = 1 - torch.tensor(0.9).to(torch.bfloat16)
    return bool(opt.state[p]["exp_avg"][0] == cast)


def low_precision_scalars(group, values, dtype, zero_dim):
    """A tensor beta1's lerp weight as torch's for-loop computes it for a ``dtype`` parameter:
    ``1 - beta1.to(dtype)`` in that dtype, or ``1 - beta1`` in float32 rounded to it (but
    unrounded for a 0-d parameter: the two promote to float32)."""
    beta1 = to_scalar(group["betas"][0])
    if not isinstance(beta1, torch.Tensor):
        return values
    if _casts_tensor_beta1():
        weight = float(1 - beta1.to(dtype))
    elif zero_dim:
        return values
    else:
        weight = shared.in_dtype(values["one_minus_beta1"], dtype)
    return {**values, "one_minus_beta1": weight}


def inputs(o):
    return [*shared.MOMENT_INPUTS] + (["max_exp_avg_sq"] if o.amsgrad else [])


def statements(o, b):
    s, param = b.s, b.tensor("param")
    grad = shared.gradient(o, b)
    exp_avg, exp_avg_sq = shared.adam_moments(b, grad, fused=o.get("fused"))
    second_moment = exp_avg_sq
    if o.amsgrad:
        second_moment = b.assign(b.tensor("max_exp_avg_sq"), maximum(b.tensor("max_exp_avg_sq"), exp_avg_sq))
    root = sqrt_rn if o.get("fused") else sqrt
    denom = b.let("denom", root(second_moment) / s.bias_correction2_sqrt + s.eps)
    b.assign(param, addcdiv(param, exp_avg, denom, value=s.neg_step_size))


ADAM = OptimizerSpec(
    "Adam",
    torch.optim.Adam,
    init_state,
    options,
    inputs,
    scalars,
    statements,
    low_precision_scalars=low_precision_scalars,
    fused_kernel=True,
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
    low_precision_scalars=low_precision_scalars,
    fused_kernel=True,
    # AdamW decays by default (weight_decay=0.01)
    rich_kwargs=dict(lr=0.01, amsgrad=True),
    fidelity_kwargs=dict(lr=1e-2, amsgrad=True),
)
