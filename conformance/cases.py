"""The table of conformance cases: one entry per (optimizer, kwargs).

Every case is run for ``STEPS`` steps on every backend of ``BACKENDS`` against
``torch.optim.<optimizer>`` (see ``harness.py``).

How the table is written:

* ``grid(**axes)`` is the full product of the listed option values (``itertools.product``);
  the boolean code-path options of each optimizer are gridded, so every combination of them that
  torch accepts is a case (combinations torch rejects are filtered with ``where=``).
* ``extra(...)`` lists single cases: non-default numeric hyperparameters (which select no new
  code path), tensor ``lr`` and tensor ``betas``, and cases that force a particular branch.
* Keyword arguments equal to torch's own default are dropped from a case, so a case's kwargs
  (and its test id) show only what differs from the default; duplicates are removed.
* ``expect`` names branches a case must actually reach on torch's trajectory (checked by the
  harness, so a case that silently stops covering its branch fails):
  ``rectified``/``unrectified`` (RAdam's rho_t > 5 / <= 5), ``averaging`` (ASGD's mu != 1),
  ``step_size_min``/``step_size_max`` (an Rprop step size clamped to the bound).

The sources of the values: ``torch/testing/_internal/common_optimizers.py``
(``optim_inputs_func_*``), extended to the full grid of each optimizer's options.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from dataclasses import dataclass, field

import torch

from roundpipe.optim.spec import SPECS

STEPS = 20  # steps per case
# Every case runs on each: the fast backend once per engine (fast:numba is plain fast's default).
BACKENDS = ("reference", "fast:numba", "fast:torch", "fast:numexpr")
# The engines that claim torch.optim's for-loop bit for bit: compared with exact equality (every
# bit, NaN by position), not assert_close. fast:numba only where its probes say it models this
# torch's rounding (fused multiply-adds, sqrt) exactly; elsewhere it is compared as fast:numexpr.
BIT_EXACT = ("reference", "fast:torch", "fast:numba")

OPTIMIZERS = tuple(SPECS)  # the elementwise registry: every one needs its cases here


def T(value):
    """A tensor hyperparameter, as a user would write it: ``torch.tensor(value)`` (float32)."""
    return torch.tensor(value)


def grid(where=None, **axes):
    """Every combination of the axes' values (itertools.product), as kwargs dicts.

    ``where(kwargs) -> bool`` drops the combinations torch rejects.
    """
    names = list(axes)
    out = [dict(zip(names, values, strict=True)) for values in itertools.product(*axes.values())]
    return [kw for kw in out if where is None or where(kw)]


def extra(*kwargs_list):
    return list(kwargs_list)


@dataclass(frozen=True)
class Case:
    optimizer: str
    kwargs: dict
    expect: tuple = ()
    steps: int = STEPS
    id: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "id", case_id(self.optimizer, self.kwargs))

    def make_kwargs(self):
        """Fresh kwargs for one optimizer instance (tensor hyperparameters are copied)."""
        return copy.deepcopy(self.kwargs)


def fmt(v) -> str:
    """Compact, readable rendering of a hyperparameter value for test ids."""
    if isinstance(v, torch.Tensor):
        if v.dim() == 0:
            return f"tensor({v.item():.7g})"
        return "tensor(" + fmt_nested(v.tolist()) + ")"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(fmt(x) for x in v) + ")"
    return str(v)


def fmt_nested(v) -> str:
    if isinstance(v, list):
        return "[" + ",".join(fmt_nested(x) for x in v) + "]"
    return f"{v:.7g}"


def case_id(optimizer, kwargs) -> str:
    if not kwargs:
        return f"{optimizer}-default"
    return optimizer + "-" + ",".join(f"{k}={fmt(v)}" for k, v in sorted(kwargs.items()))


def _is_default(torch_defaults, key, value) -> bool:
    if key not in torch_defaults:
        raise TypeError(f"torch.optim has no option {key!r}")
    default = torch_defaults[key]
    if isinstance(value, torch.Tensor) or any(isinstance(x, torch.Tensor) for x in _flat(value)):
        return False
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


def _flat(v):
    return v if isinstance(v, (tuple, list)) else ()


# Options that an older torch of the supported range lacks, with their default where torch has
# them: a case that sets one to that default runs without it there; a case that sets it
# otherwise tests a path that torch does not have, and is left out there.
LATER_OPTIONS = {"decoupled_weight_decay": False}  # Adam's from torch 2.7


def _on_this_torch(torch_defaults, kw):
    """``kw`` as this torch takes it, or None where it sets an option this torch lacks."""
    for key in set(kw) - set(torch_defaults):
        if key in LATER_OPTIONS and kw[key] is LATER_OPTIONS[key]:
            kw = {k: v for k, v in kw.items() if k != key}
        elif key in LATER_OPTIONS:
            return None
    return kw


def cases_for(optimizer, kwargs_list, expect=()):
    """Build the cases of one optimizer: drop default-valued kwargs, then duplicates."""
    sig = inspect.signature(getattr(torch.optim, optimizer).__init__)
    torch_defaults = {n: p.default for n, p in sig.parameters.items() if n not in ("self", "params")}
    out, seen = [], set()
    for kw in kwargs_list:
        kw = _on_this_torch(torch_defaults, kw)
        if kw is None:
            continue
        kw = {k: v for k, v in kw.items() if not _is_default(torch_defaults, k, v)}
        case = Case(optimizer, kw, expect=tuple(expect(kw)) if callable(expect) else tuple(expect))
        if case.id not in seen:
            seen.add(case.id)
            out.append(case)
    return out


BOOL = (False, True)

# 1-element tensor hyperparameters of other shapes, as in torch's own database: torch squeezes
# lr from 2.8 and Adam's betas from 2.10; before, its for-loop raises on them (a broadcast into
# an in-place op), so they are cases only where it steps.
ODD_SHAPES = ({"lr": T([0.01]), "betas": (T([[[0.9]]]), T([[0.99]]))},)


def where_torch_steps(optimizer, kwargs_list):
    """The kwargs of ``kwargs_list`` this torch's for-loop steps with (a probe, not a version)."""
    out = []
    for kwargs in kwargs_list:
        p = torch.zeros(2, 3, requires_grad=True)
        p.grad = torch.ones(2, 3)
        try:
            getattr(torch.optim, optimizer)([p], **copy.deepcopy(kwargs)).step()
        except RuntimeError:
            continue
        out.append(kwargs)
    return out


# ---------------------------------------------------------------------------------------------
# The table. One block per optimizer, in the order of torch.optim's documentation.

ADADELTA = cases_for(
    "Adadelta",
    grid(weight_decay=(0.0, 0.1), maximize=BOOL)
    + extra(
        {"lr": 0.01},
        {"rho": 0.95, "weight_decay": 0.9},
        {"rho": 0.5, "eps": 1e-3},
        {"lr": T(0.01)},
        {"lr": T(0.01), "weight_decay": 0.1, "maximize": True},
    ),
)

ADAGRAD = cases_for(
    "Adagrad",
    grid(
        lr_decay=(0.0, 0.5),
        weight_decay=(0.0, 0.1),
        initial_accumulator_value=(0.0, 0.1),
        maximize=BOOL,
    )
    + extra(
        {"lr": 0.1},
        {"eps": 1e-3},
        {"lr": T(0.01)},
        {"lr": T(0.01), "lr_decay": 0.5, "weight_decay": 0.1, "initial_accumulator_value": 0.1},
    ),
)

ADAM = cases_for(
    "Adam",
    grid(
        weight_decay=(0.0, 0.1),
        amsgrad=BOOL,
        maximize=BOOL,
        decoupled_weight_decay=BOOL,
    )
    + extra(
        {"lr": 0.01},
        {"betas": (0.8, 0.99)},
        {"betas": (0.0, 0.5)},  # beta1 = 0: lerp with weight 1
        {"eps": 1e-4},
        {"lr": T(0.01)},
        {"lr": T(0.01), "betas": (T(0.9), T(0.999))},
        {"lr": T(0.01), "betas": (T(0.8), T(0.99)), "amsgrad": True, "weight_decay": 0.1, "maximize": True},
        {"lr": T(0.01), "betas": (T(0.8), T(0.99)), "weight_decay": 0.1, "decoupled_weight_decay": True},
        *where_torch_steps("Adam", ODD_SHAPES),
    ),
)

ADAMW = cases_for(
    "AdamW",
    grid(weight_decay=(0.0, 1e-2, 0.1), amsgrad=BOOL, maximize=BOOL)
    + extra(
        {"lr": 0.01},
        {"betas": (0.8, 0.99)},
        {"betas": (0.0, 0.5)},
        {"eps": 1e-4},
        {"lr": T(0.01)},
        {"lr": T(0.01), "betas": (T(0.9), T(0.999))},
        {"lr": T(0.01), "betas": (T(0.8), T(0.99)), "amsgrad": True, "weight_decay": 0.1, "maximize": True},
        *where_torch_steps("AdamW", ODD_SHAPES),
    ),
)

ADAMAX = cases_for(
    "Adamax",
    grid(weight_decay=(0.0, 0.1), maximize=BOOL)
    + extra(
        {"lr": 0.1},
        {"betas": (0.8, 0.99)},
        {"betas": (0.0, 0.5)},
        {"eps": 1e-3},
        {"lr": T(0.01)},
        {"lr": T(0.01), "betas": (T(0.9), T(0.999))},
        {"lr": T(0.01), "betas": (T(0.8), T(0.99)), "weight_decay": 0.1, "maximize": True},
    ),
)


def _asgd_expect(kw):
    # mu becomes 1 / (step - t0) once step > t0 + 1: with a small t0 the averaging branch
    # (ax += mu * (param - ax), mu != 1) must be reached within the run.
    return ("averaging",) if kw.get("t0", 1e6) < STEPS - 2 else ()


ASGD = cases_for(
    "ASGD",
    grid(t0=(1e6, 5.0), weight_decay=(0.0, 0.1), maximize=BOOL)
    + extra(
        {"lambd": 0.1},
        {"lr": 0.02},
        {"alpha": 0.5, "t0": 5.0},
        {"lambd": 0.1, "alpha": 1.0, "t0": 0.0},
        {"t0": 100.0},
        {"lr": T(0.01)},
        {"lr": T(0.01), "t0": 5.0, "weight_decay": 0.1, "maximize": True},
    ),
    expect=_asgd_expect,
)

# tensor lr and betas, alone and with every option on (NAdam, RAdam)
TENSOR_HYPERPARAMETERS_DECOUPLED = (
    {"lr": T(0.01)},
    {"lr": T(0.01), "betas": (T(0.9), T(0.999))},
    {
        "lr": T(0.01),
        "betas": (T(0.8), T(0.99)),
        "weight_decay": 0.1,
        "decoupled_weight_decay": True,
        "maximize": True,
    },
)


NADAM = cases_for(
    "NAdam",
    grid(weight_decay=(0.0, 0.1), decoupled_weight_decay=BOOL, maximize=BOOL)
    + extra(
        {"momentum_decay": 6e-3},
        {"weight_decay": 0.1, "momentum_decay": 6e-3},
        {"lr": 1e-3},
        {"betas": (0.8, 0.99)},
        {"eps": 1e-4},
        *TENSOR_HYPERPARAMETERS_DECOUPLED,
    ),
)

# RAdam rectifies once rho_t > 5: with the default betas that is from step 6 on, so every case
# (STEPS = 20) runs both branches; the harness checks it.
RADAM = cases_for(
    "RAdam",
    grid(weight_decay=(0.0, 0.1), decoupled_weight_decay=BOOL, maximize=BOOL)
    + extra(
        {"lr": 2e-3},
        {"eps": 1e-6},
        {"betas": (0.8, 0.99)},
        *TENSOR_HYPERPARAMETERS_DECOUPLED,
    ),
    expect=("rectified", "unrectified"),
)

RMSPROP = cases_for(
    "RMSprop",
    grid(centered=BOOL, momentum=(0.0, 0.9), weight_decay=(0.0, 0.1), maximize=BOOL)
    + extra(
        {"lr": 1e-3},
        {"alpha": 0.9},
        {"eps": 1e-4},
        {"lr": T(0.01)},
        {"lr": T(0.01), "centered": True, "momentum": 0.9, "weight_decay": 0.1, "maximize": True},
    ),
)


def _rprop_expect(kw):
    # With lr = 0.01, random gradients and etas (0.5, 1.2) / (0.3, 1.5), a bound of 0.004 from
    # below or 0.02 from above is hit within a few steps by many elements.
    lo, hi = kw.get("step_sizes", (1e-6, 50))
    return (("step_size_min",) if lo >= 1e-3 else ()) + (("step_size_max",) if hi <= 0.1 else ())


RPROP = cases_for(
    "Rprop",
    grid(etas=((0.5, 1.2), (0.3, 1.5)), step_sizes=((1e-6, 50), (4e-3, 2e-2)), maximize=BOOL)
    + extra(
        {"lr": 2e-4},
        {"step_sizes": (2e-6, 100)},
        {"step_sizes": (1e-6, 2e-2)},  # only the upper bound binds
        {"step_sizes": (4e-3, 50)},  # only the lower bound binds
        {"lr": T(0.01)},
        {"lr": T(0.01), "step_sizes": (4e-3, 2e-2), "maximize": True},
    ),
    expect=_rprop_expect,
)


def _sgd_valid(kw):
    # torch: "Nesterov momentum requires a momentum and zero dampening"
    return not kw["nesterov"] or (kw["momentum"] > 0 and kw["dampening"] == 0)


SGD = cases_for(
    "SGD",
    grid(
        where=_sgd_valid,
        momentum=(0.0, 0.9),
        dampening=(0.0, 0.5),
        nesterov=BOOL,
        weight_decay=(0.0, 0.1),
        maximize=BOOL,
    )
    + extra(
        {"lr": 1e-2},
        {"lr": 1e-2, "momentum": 0.5, "dampening": 1.0},
        {"lr": T(0.01)},
        {"lr": T(0.01), "momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "maximize": True},
    ),
)

CASES_BY_OPTIMIZER = {
    "Adadelta": ADADELTA,
    "Adagrad": ADAGRAD,
    "Adam": ADAM,
    "AdamW": ADAMW,
    "Adamax": ADAMAX,
    "ASGD": ASGD,
    "NAdam": NADAM,
    "RAdam": RADAM,
    "RMSprop": RMSPROP,
    "Rprop": RPROP,
    "SGD": SGD,
}
assert set(CASES_BY_OPTIMIZER) == set(OPTIMIZERS), "a registered optimizer without cases, or the reverse"

CASES = [case for name in OPTIMIZERS for case in CASES_BY_OPTIMIZER[name]]
