"""Building blocks that several torch optimizers share, written once.

Each is the same few lines of torch's ``_single_tensor_*`` functions, in the same order:

* ``gradient``: ``grad = -grad`` if ``maximize``, then L2 weight decay
  ``grad = grad.add(param, alpha=weight_decay)``, or, with ``decoupled_weight_decay``
  (AdamW, NAdamW, RAdamW), ``param.mul_(1 - lr * weight_decay)``. Options without
  ``weight_decay`` (Rprop) skip the decay.
* ``adam_moments``: ``exp_avg.lerp_(grad, 1 - beta1)`` and
  ``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)`` (Adam, AdamW, NAdam, RAdam).

with their scalars (``weight_decay_scalars``, ``moment_scalars``), computed as torch computes them.
"""

from .ir import add, addcmul, lerp


def gradient(o, b):
    """The gradient the update uses (a let when it differs from ``grad``)."""
    param, grad = b.tensor("param"), b.tensor("grad")
    if o.maximize:
        grad = b.let("grad", -grad)
    if o.get("weight_decay"):
        if o.get("decoupled_weight_decay"):
            b.assign(param, param * b.s.weight_decay_factor)
        else:
            grad = b.let("grad", add(grad, param, alpha=b.s.weight_decay))
    return grad


def weight_decay_scalars(group, lr):
    weight_decay = group["weight_decay"]
    return {"weight_decay": weight_decay, "weight_decay_factor": 1 - lr * weight_decay}


def adam_moments(b, grad):
    exp_avg, exp_avg_sq = b.tensor("exp_avg"), b.tensor("exp_avg_sq")
    b.assign(exp_avg, lerp(exp_avg, grad, b.s.one_minus_beta1))
    b.assign(exp_avg_sq, addcmul(exp_avg_sq * b.s.beta2, grad, grad, value=b.s.one_minus_beta2))
    return exp_avg, exp_avg_sq


def moment_scalars(beta1, beta2):
    return {"one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2}
