"""Lines that several torch optimizers share, written once.

Each is the same few lines of torch's ``_single_tensor_*`` functions, in the same order:

* ``add_on_complex``: ``add`` (with alpha) as torch rounds it on complex tensors;
* ``gradient``: ``grad = -grad`` if ``maximize``, then L2 weight decay
  ``grad = grad.add(param, alpha=weight_decay)``, or, with ``decoupled_weight_decay``
  (AdamW, NAdamW, RAdamW), ``param.mul_(1 - lr * weight_decay)``. Options without
  ``weight_decay`` (Rprop) skip the decay.
* ``adam_moments``: ``exp_avg.lerp_(grad, 1 - beta1)`` and
  ``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)`` (Adam, AdamW, NAdam, RAdam).

with their scalars (``weight_decay_scalars``, ``moment_scalars``), computed as torch computes them,
the state, options and inputs the Adam family shares (``moment_state``, ``decay_options``,
``moment_inputs``), and the scalars of a squared-gradient average (``average_scalars``: Adadelta,
RMSprop).
"""

import torch

from .core import to_scalar, zeros_like
from .ir import add, addcmul, in_remainder, lerp


def moment_state(p, state):
    """``exp_avg`` and ``exp_avg_sq``, created as torch's Adam-family ``_init_group`` does."""
    state["exp_avg"] = zeros_like(p)
    state["exp_avg_sq"] = zeros_like(p)


MOMENT_INPUTS = ("param", "grad", "exp_avg", "exp_avg_sq")


def moment_inputs(o):
    """The tensors of an Adam-family step without AMSGrad: the moments, with param and grad."""
    return list(MOMENT_INPUTS)


def decay_options(group, decoupled=None):
    """The options of optimizers with ``maximize`` and (decoupled) weight decay: the group's
    ``decoupled_weight_decay``, or ``decoupled`` where the optimizer's torch class has no such
    option and always decays one way (torch < 2.7's Adam and AdamW)."""
    return {
        "maximize": group["maximize"],
        "weight_decay": group["weight_decay"] != 0,
        "decoupled_weight_decay": group["decoupled_weight_decay"] if decoupled is None else decoupled,
    }


def gradient(o, b, complex_decay=True):
    """The gradient the update uses (a let when it differs from ``grad``). ``complex_decay``:
    torch adds the L2 weight decay before it takes ``view_as_real`` of a complex parameter
    (every optimizer but ASGD, NAdam and RAdam), see ``add_on_complex``."""
    param, grad = b.tensor("param"), b.tensor("grad")
    if o.maximize:
        grad = b.let("grad", -grad)
    if o.get("weight_decay"):
        if o.get("decoupled_weight_decay"):
            b.assign(param, param * b.s.weight_decay_factor)
        else:
            decay = add_on_complex(o, grad, param, b.s.weight_decay) if complex_decay else None
            grad = b.let("grad", decay or add(grad, param, alpha=b.s.weight_decay))
    return grad


def add_on_complex(o, a, x, alpha):
    """``a.add(x, alpha=alpha)`` where torch runs it on the complex tensors of a complex
    parameter (not on their ``view_as_real``). There it is a complex multiply by ``alpha + 0j``
    and an add, rounded twice: torch's complex kernels fuse nothing, where its real ones
    compute ``a + alpha * x`` with one fused multiply-add. ``o.complex`` is set by the step
    plan for complex parameters, which get programs of their own."""
    if o.get("complex"):
        return a + alpha * x
    return add(a, x, alpha=alpha)


def average_scalars(group, state, decay: str) -> dict:
    """The step of an optimizer that keeps an average of squared gradients with decay rate
    ``group[decay]`` (Adadelta's ``rho``, RMSprop's ``alpha``), counted; its scalars: the rate
    and one minus it, ``eps``, the L2 weight decay and ``-lr``."""
    lr = to_scalar(group["lr"])
    rate = group[decay]
    state["step"] += 1
    return {
        "weight_decay": group["weight_decay"],
        decay: rate,
        f"one_minus_{decay}": 1 - rate,
        "eps": group["eps"],
        "neg_lr": -lr,
    }


def weight_decay_scalars(group, lr):
    weight_decay = group["weight_decay"]
    return {"weight_decay": weight_decay, "weight_decay_factor": 1 - lr * weight_decay}


def adam_moments(b, grad, fused=False):
    """``fused``: as torch's fused kernel computes them, whose scalar remainder contracts
    ``exp_avg_sq``'s multiply-add around the state's product (``in_remainder``)."""
    exp_avg, exp_avg_sq = b.tensor("exp_avg"), b.tensor("exp_avg_sq")
    b.assign(exp_avg, lerp(exp_avg, grad, b.s.one_minus_beta1))
    second = addcmul(exp_avg_sq * b.s.beta2, grad, grad, value=b.s.one_minus_beta2)
    if fused:
        second = in_remainder(second, add(b.s.one_minus_beta2 * grad * grad, exp_avg_sq, b.s.beta2))
    b.assign(exp_avg_sq, second)
    return exp_avg, exp_avg_sq


def moment_scalars(beta1, beta2):
    return {"one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2}


def in_dtype(value, dtype) -> float:
    """A float32 value (a 0-d float32 tensor's) as torch rounds it to ``dtype``."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


def tensor_weight_scalars(weight: str, option: str, index=None):
    """The ``low_precision_scalars`` of a spec whose lerp weight ``weight`` is ``1 - x``, ``x``
    the group's ``option`` (or its ``index``-th entry, a beta): where ``x`` is a tensor, the
    weight is a float32 0-d tensor, which torch's lerp rounds to the parameter's dtype (but for
    a 0-d parameter: the two promote to float32)."""

    def rounded(group, values, dtype, zero_dim):
        x = group[option] if index is None else group[option][index]
        if isinstance(x, torch.Tensor) and not zero_dim:
            values = {**values, weight: in_dtype(values[weight], dtype)}
        return values

    return rounded
