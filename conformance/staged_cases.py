"""The cases of the staged optimizers (Adafactor, Muon): parameter sets, tables, branches.

``harness.PARAMS`` has complex and empty parameters, which Adafactor and Muon reject (and Muon
steps matrices only), so each staged optimizer has its own parameter set here, with its own
step count; gradients are made as ``harness`` makes them (``ParamSpec``: seeded per step and
parameter, scaled, None or zeroed where the spec says). The tables are written as in
``cases.py`` (``grid``, ``extra``, ``cases_for``: defaults dropped, duplicates removed).

``expect`` names branches a case must reach on torch's trajectory (``adafactor_branches``):

* ``clipped``: an update scaled down, ``update.norm() / (sqrt(numel) * d) > 1`` (torch's
  ``denom``; by more than rounding: ``CLIPPED``);
* ``relative_step``: ``rho_t = 1 / sqrt(step)``, smaller than ``lr``;
* ``eps2_floor``: ``alpha`` from ``eps2``, a parameter's RMS below it.

Every backend of ``cases.BACKENDS`` claims these two bit for bit: a staged pass runs torch's own
ops, or (fast:numba, where its probes reproduced torch's reductions and fused multiply-adds)
compiled code with the same bits.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from .cases import BOOL, T, case_id, cases_for, extra, grid
from .harness import ParamSpec

ADAFACTOR_STEPS = 20
# ``clipped``: torch's denom above this (above 1 by more than rounding: on the default case's
# trajectory up to 1.8, on the 0-d parameter; never above 0.91 with d=2)
CLIPPED = 1.01
MUON_STEPS = 8  # torch's bfloat16 matmuls are slow on CPU

ADAFACTOR_PARAMS = (
    ParamSpec("3x5", (3, 5)),
    ParamSpec("2x3x4 grad*1e-20", (2, 3, 4), scale=1e-20),
    ParamSpec("1 element", (1,)),
    ParamSpec("0-d", ()),
    ParamSpec("7", (7,)),
    ParamSpec("1023 grad*1e-20 on odd steps", (1023,), tiny_on_odd_steps=True),
    ParamSpec("70001 with zero grads", (70001,), zero_every=7),
    ParamSpec("7x11 grad None every 3rd step", (7, 11), none_every=3),
    ParamSpec("64x40", (64, 40)),
    ParamSpec("2x8x24", (2, 8, 24)),
    ParamSpec("1x9", (1, 9)),
    ParamSpec("9x1", (9, 1)),
    ParamSpec("33x17", (33, 17)),
    ParamSpec("1x1", (1, 1)),
    ParamSpec("300x7", (300, 7)),
    ParamSpec("2048x16", (2048, 16)),
)

MUON_PARAMS = (
    ParamSpec("3x5", (3, 5)),
    ParamSpec("7x11 grad None every 3rd step", (7, 11), none_every=3),
    ParamSpec("16x32", (16, 32)),
    ParamSpec("33x17", (33, 17)),
    ParamSpec("1x9", (1, 9)),
    ParamSpec("9x1", (9, 1)),
    ParamSpec("64x40 grad*1e-20", (64, 40), scale=1e-20),
)

PARAMS_BY_OPTIMIZER = {"Adafactor": ADAFACTOR_PARAMS, "Muon": MUON_PARAMS}


@dataclasses.dataclass(frozen=True)
class StagedCase:
    """A case (``cases.Case``'s fields) with its step count; a count other than the
    optimizer's default shows in the id (``,steps=60``)."""

    optimizer: str
    kwargs: dict
    steps: int
    expect: tuple = ()
    id: str = dataclasses.field(init=False)

    def __post_init__(self):
        default = ADAFACTOR_STEPS if self.optimizer == "Adafactor" else MUON_STEPS
        suffix = f",steps={self.steps}" if self.steps != default else ""
        object.__setattr__(self, "id", case_id(self.optimizer, self.kwargs) + suffix)

    @property
    def params(self):
        return PARAMS_BY_OPTIMIZER[self.optimizer]

    def make_kwargs(self):
        """Fresh kwargs for one optimizer instance (tensor hyperparameters are copied)."""
        return copy.deepcopy(self.kwargs)


def staged_cases_for(optimizer, kwargs_list, steps, expect=()):
    return [
        StagedCase(c.optimizer, c.kwargs, steps, c.expect)
        for c in cases_for(optimizer, kwargs_list, expect=expect)
    ]


# ---------------------------------------------------------------------------------------------
# Adafactor


def _adafactor_expect(kw):
    out = []
    if kw.get("d", 1.0) <= 1.0:
        out.append("clipped")
    lr = kw.get("lr", 0.01)
    if float(lr) > 0.25:  # 1 / sqrt(step) < lr from step 5 on (lr = 0.5)
        out.append("relative_step")
    if kw.get("eps", (None, 1e-3))[1] >= 1.0:
        out.append("eps2_floor")
    return out


ADAFACTOR = staged_cases_for(
    "Adafactor",
    grid(maximize=BOOL, weight_decay=(0.0, 0.1), eps=((None, 1e-3), (1e-3, 1e-3)))
    + extra(
        {"lr": 0.5},  # rho_t = 1 / sqrt(step) from step 5 on
        {"lr": T(0.01)},
        {"lr": T(0.01), "weight_decay": 0.1, "maximize": True},
        {"beta2_decay": -0.5},
        {"d": 2.0},
        {"eps": (None, 1.0)},  # alpha = eps2 * rho_t for parameters of RMS < 1
    ),
    ADAFACTOR_STEPS,
    expect=_adafactor_expect,
) + [
    dataclasses.replace(c, steps=60)
    for c in staged_cases_for(
        "Adafactor", extra({"lr": 0.5, "weight_decay": 0.1}), ADAFACTOR_STEPS, _adafactor_expect
    )
]


def adafactor_branches(opt, before: bool) -> set:
    """The ``expect``-able branches of torch's Adafactor ``opt`` in this step: call with
    ``before=True`` ahead of ``step()`` (eps2_floor, from the parameters it is about to step)
    and ``before=False`` after it (relative_step and clipped, from the state it left)."""
    out = set()
    for group in opt.param_groups:
        lr = float(group["lr"])
        eps1, eps2 = group["eps"]
        eps1 = torch.finfo(torch.float32).eps if eps1 is None else eps1
        for p in group["params"]:
            if p.grad is None or p.numel() == 0:
                continue
            if before:
                if p.norm(2).item() / math.sqrt(p.numel()) < eps2:
                    out.add("eps2_floor")
                continue
            st = opt.state[p]
            step = st["step"].item()
            if 1 / math.sqrt(step) < lr:
                out.add("relative_step")
            grad = -p.grad if group["maximize"] else p.grad
            if p.grad.dim() > 1:
                row_var, col_var = st["row_var"], st["col_var"]
                var_estimate = (row_var @ col_var).div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
            else:
                var_estimate = st["variance"].clone()
            update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
            if update.norm(2).item() / (math.sqrt(update.numel()) * group["d"]) > CLIPPED:
                out.add("clipped")
    return out


# ---------------------------------------------------------------------------------------------
# Muon

# torch.optim.Muon from torch 2.9 (before: no Muon cases; test_staged.py skips its other tests)
MUON = (
    staged_cases_for(
        "Muon",
        grid(nesterov=BOOL, adjust_lr_fn=(None, "original", "match_rms_adamw"), weight_decay=(0.0, 0.1))
        + extra(
            {"ns_steps": 3},
            {"ns_coefficients": (2.0, -1.5, 0.5)},
            {"momentum": 0.5},
            {"lr": T(0.01)},
            {"lr": T(0.02), "nesterov": False, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.0},
        ),
        MUON_STEPS,
    )
    if hasattr(torch.optim, "Muon")
    else []
)

STAGED_CASES = ADAFACTOR + MUON
