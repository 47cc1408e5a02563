"""SGD: ``torch.optim.sgd._single_tensor_sgd``, and with ``fused=True`` torch's fused CPU kernel
(``aten/src/ATen/native/cpu/FusedSGDKernel.cpp``).

The fused kernel's float32 arithmetic is the for-loop's, contracted as torch's ops contract
(``grad + param * weight_decay``, ``buf * momentum + grad * (1 - dampening)`` around the second
product, ``param - grad * lr``): one program serves both, but in the kernel's scalar remainder
(``in_remainder``, ``fused_kernels.py``), which contracts the buffer's around the first. On a
bfloat16 or float16 parameter it is that arithmetic on the widened tensors, each stored tensor
rounded once (torch >= 2.14; 2.13's 16-bit kernel is wrong, pytorch#191763, and is not
followed). torch's fused step raises a
TypeError when a group mixes parameters with and without a momentum buffer (a first gradient
that comes late); roundpipe steps such a parameter as the for-loop does, its buffer starting at
the gradient.

torch keeps no state without momentum, and creates ``momentum_buffer`` on the first step as a
copy of the (decayed) gradient: init_state creates it and returns the ``first`` flag, which
selects that program for the step.
"""

import torch

from .core import OptimizerSpec, to_scalar, zeros_like
from .ir import add, in_remainder
from .shared import add_on_complex, gradient


def init_state(group, p, state):
    if group["momentum"] != 0 and state.get("momentum_buffer") is None:
        # torch creates the buffer on the first step as grad.detach().clone(): the flag
        # returned here selects that program for this step.
        state["momentum_buffer"] = zeros_like(p)
        return {"first": True}
    return {"first": False}


def options(group):
    return {
        "maximize": group["maximize"],
        "weight_decay": group["weight_decay"] != 0,
        "momentum": group["momentum"] != 0,
        "nesterov": group["nesterov"],
        "fused": bool(group.get("fused")),
    }


def scalars(group, state):
    lr = to_scalar(group["lr"])
    if group.get("fused"):  # the kernel takes doubles (a tensor's ``item()``)
        lr = float(lr)
    momentum = group["momentum"]
    return {
        "weight_decay": group["weight_decay"],
        "momentum": momentum,
        "one_minus_dampening": 1 - group["dampening"],
        "neg_lr": -lr,
    }


def inputs(o):
    return ["param", "grad"] + (["momentum_buffer"] if o.momentum else [])


def statements(o, b):
    s = b.s
    param = b.tensor("param")
    grad = gradient(o, b)
    if o.momentum:
        buf = b.tensor("momentum_buffer")
        if o.first:
            b.assign(buf, grad)
        else:
            new = add_on_complex(o, buf * s.momentum, grad, s.one_minus_dampening)
            if o.get("fused"):  # its scalar remainder: fma(buf, momentum, grad * (1 - dampening))
                new = in_remainder(new, add(grad * s.one_minus_dampening, buf, s.momentum))
            b.assign(buf, new)
        if o.nesterov:
            grad = b.let("grad", add_on_complex(o, grad, buf, s.momentum))
        else:
            grad = buf
    # torch's SGD steps complex parameters as complex tensors (no view_as_real)
    b.assign(param, add_on_complex(o, param, grad, s.neg_lr))


SGD = OptimizerSpec(
    "SGD",
    torch.optim.SGD,
    init_state,
    options,
    inputs,
    scalars,
    statements,
    scalar_state=(),
    flags=("first",),
    fused_kernel=True,
    rich_kwargs=dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1),
    fidelity_kwargs=dict(lr=1e-2, momentum=0.9, nesterov=True),
)
