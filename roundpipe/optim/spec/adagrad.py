"""Adagrad: ``torch.optim.adagrad._single_tensor_adagrad`` (dense gradients), and with
``fused=True`` torch's fused CPU kernel (``aten/src/ATen/native/cpu/FusedAdagradKernel.cpp``).

The fused kernel computes the for-loop's formulas in its order (``param - (clr * grad) / std``
is ``addcdiv``'s), except the root: ``Vec::sqrt``, correctly rounded (``sqrt_rn``). On a
bfloat16 or float16 parameter it is that float32 arithmetic on the widened tensors, each stored
tensor rounded once (torch >= 2.14; 2.13's 16-bit kernel rounds ``clr``, ``eps`` and
``weight_decay`` to the parameter's dtype in its vector body, which 2.14 fixed, and is not
followed).

torch creates Adagrad's state in ``__init__``; init_state only covers parameters added later
in a way that bypasses it, as torch's ``_init_group`` does.
"""

import torch

from .core import OptimizerSpec, advance_step, to_scalar, zero_step
from .ir import addcdiv, addcmul, sqrt, sqrt_rn
from .shared import gradient


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = zero_step()
        v = group["initial_accumulator_value"]
        init_value = complex(v, v) if torch.is_complex(p) else v
        state["sum"] = torch.full_like(p, init_value, memory_format=torch.preserve_format)


def options(group):
    return {
        "maximize": group["maximize"],
        "weight_decay": group["weight_decay"] != 0,
        "fused": bool(group.get("fused")),
    }


def scalars(group, state):
    lr = to_scalar(group["lr"])
    if group.get("fused"):  # the kernel takes doubles (a tensor's ``item()``)
        lr = float(lr)
    step = advance_step(state)
    clr = lr / (1 + (step - 1) * group["lr_decay"])
    return {"weight_decay": group["weight_decay"], "eps": group["eps"], "neg_clr": -clr}


def inputs(o):
    return ["param", "grad", "sum"]


def statements(o, b):
    s = b.s
    param, state_sum = b.tensor("param"), b.tensor("sum")
    grad = gradient(o, b)
    b.assign(state_sum, addcmul(state_sum, grad, grad, value=1))
    root = sqrt_rn if o.get("fused") else sqrt
    std = b.let("std", root(state_sum) + s.eps)
    b.assign(param, addcdiv(param, grad, std, value=s.neg_clr))


ADAGRAD = OptimizerSpec(
    "Adagrad",
    torch.optim.Adagrad,
    init_state,
    options,
    inputs,
    scalars,
    statements,
    fused_kernel=True,
    rich_kwargs=dict(lr=0.05, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
    fidelity_kwargs=dict(lr=0.05),
)
