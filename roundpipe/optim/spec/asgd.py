"""ASGD: ``torch.optim.asgd._single_tensor_asgd`` (capturable=False branch).

``eta`` and ``mu`` are per-parameter 0-d state tensors: the step reads them (as float32
values), then writes the next step's values, as torch does. ``average`` (``mu != 1``) selects
between averaging into ``ax`` and copying the parameter.
"""

import torch
from torch.optim.optimizer import _get_scalar_dtype

from .core import OptimizerSpec, set_value, to_scalar, value, zeros_like
from .ir import add
from .shared import gradient


def init_state(group, p, state):
    if len(state) == 0:
        state["step"] = torch.zeros((), dtype=_get_scalar_dtype())
        state["eta"] = torch.as_tensor(to_scalar(group["lr"]), dtype=_get_scalar_dtype()).clone().detach()
        state["mu"] = torch.ones((), dtype=_get_scalar_dtype())
        state["ax"] = zeros_like(p)


def options(group):
    return {"maximize": group["maximize"], "weight_decay": group["weight_decay"] != 0}


def inputs(o):
    return ["param", "grad", "ax"]


def scalars(group, state):
    lr = to_scalar(group["lr"])
    lambd, alpha, t0 = group["lambd"], group["alpha"], group["t0"]
    step_t, eta, mu = state["step"], state["eta"], state["mu"]
    step_t += 1
    eta_value = value(eta)
    mu_value = value(mu)
    out = {
        "average": mu_value != 1,
        "weight_decay": group["weight_decay"],
        "decay": 1 - lambd * eta_value,
        "neg_eta": -eta_value,
        "mu": mu_value,
    }
    # the next step's eta and mu, written after the values above were read (as torch does)
    step = value(step_t)
    set_value(eta, lr / ((1 + lambd * lr * step) ** alpha))
    set_value(mu, 1 / max(1, step - t0))
    return out


def statements(o, b):
    s = b.s
    param, ax = b.tensor("param"), b.tensor("ax")
    grad = gradient(o, b, complex_decay=False)
    b.assign(param, param * s.decay)
    b.assign(param, add(param, grad, alpha=s.neg_eta))
    b.assign(ax, ax + (param - ax) * s.mu if o.average else param)  # (torch copies param into ax)


ASGD = OptimizerSpec(
    "ASGD",
    torch.optim.ASGD,
    init_state,
    options,
    inputs,
    scalars,
    statements,
    scalar_state=("step", "eta", "mu"),
    flags=("average",),
    # a small t0 makes it start averaging (mu != 1) within a few steps
    rich_kwargs=dict(lr=0.01, t0=2.0, lambd=1e-3, weight_decay=0.1),
    fidelity_kwargs=dict(lr=1e-2, t0=100),
)
