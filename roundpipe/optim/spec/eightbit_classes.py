"""bitsandbytes' 8-bit classes as data: the registry ``EIGHTBIT_SPECS`` that roundpipe's 8-bit
classes (``roundpipe/optim/eightbit.py``) are made from, as the torch family's are made from
``SPECS``.

Each entry is an :class:`EightBitSpec`: the step spec of its update rule (``eightbit.STEPS``)
and bitsandbytes 0.50's constructor of the class, as data: ``parameters``, its signature after
``params`` (names and defaults, in its order); ``construct(name, arguments)``, its checks in its
order and words, returning the param group's defaults; ``paged``, whether it is a ``Paged``
class (on the CPU: the same step, with bitsandbytes' warning). ``REFUSED`` holds the two classes
whose CPU step roundpipe does not copy, and why.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from .eightbit import MIN_8BIT_SIZE, STEPS
from .staged import StagedSpec

__all__ = ["EIGHTBIT_SPECS", "EightBitSpec", "REFUSED", "REQUIRED"]

REQUIRED = inspect.Parameter.empty  # a parameter without a default (SGD8bit's lr)


@dataclass(frozen=True)
class EightBitSpec(StagedSpec):
    parameters: tuple = ()  # ((name, default), ...) after ``params``, in bitsandbytes' order
    construct: Callable | None = None  # (class name, arguments) -> the param group's defaults
    paged: bool = False


def _checked(lr, eps, betas, weight_decay):
    """bitsandbytes' ``Optimizer1State``/``Optimizer2State`` checks, in their order and words."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for i in range(len(betas)):
        if not 0.0 <= betas[i] < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _two_state_betas(betas):
    # Optimizer2State takes betas written as a string too: '(beta1, beta2)'
    if isinstance(betas, str):
        return [float(b) for b in betas.replace("(", "").replace(")", "").strip().split(",")]
    return betas


def _adam(name, a):
    if a["amsgrad"]:
        raise ValueError(f"{name} does not support amsgrad=True")
    if a["optim_bits"] != 32:
        raise ValueError(f"{name} only supports optim_bits=32 (default value for compatibility)")
    betas = _two_state_betas(a["betas"])
    _checked(a["lr"], a["eps"], betas, a["weight_decay"])
    hyper = dict(lr=a["lr"], betas=betas, eps=a["eps"], weight_decay=a["weight_decay"])
    return {**hyper, "alpha": 0.0, "t_alpha": None, "t_beta3": None}


def _ademamix(name, a):
    betas = _two_state_betas(a["betas"])
    _checked(a["lr"], a["eps"], betas, a["weight_decay"])
    hyper = dict(lr=a["lr"], betas=betas, eps=a["eps"], weight_decay=a["weight_decay"])
    return {**hyper, "alpha": a["alpha"], "t_alpha": a["t_alpha"], "t_beta3": a["t_beta3"]}


def _lion(name, a):
    _checked(a["lr"], 0.0, a["betas"], a["weight_decay"])
    return dict(lr=a["lr"], betas=a["betas"], eps=0.0, weight_decay=a["weight_decay"])


def _sgd(name, a):
    lr, momentum, dampening, weight_decay = (a[k] for k in ("lr", "momentum", "dampening", "weight_decay"))
    if momentum == 0:
        raise NotImplementedError("SGD without momentum is not supported!")
    _checked(lr, 0.0, (momentum, dampening), weight_decay)
    if dampening != 0 or a["nesterov"]:
        raise ValueError(
            f"roundpipe.optim.SGD8bit: dampening={dampening!r}, nesterov={a['nesterov']!r}: bitsandbytes' "
            "8-bit momentum step applies neither (it would silently step as dampening=0, "
            "nesterov=False); use those values, or torch.optim.SGD"
        )
    return dict(lr=lr, betas=(momentum, dampening), eps=0.0, weight_decay=weight_decay)


def _rmsprop(name, a):
    lr, alpha, eps, weight_decay, momentum = (
        a[k] for k in ("lr", "alpha", "eps", "weight_decay", "momentum")
    )
    if alpha == 0:
        raise NotImplementedError("RMSprop with alpha==0.0 is not supported!")
    if a["centered"]:
        raise NotImplementedError("Centered RMSprop is not supported!")
    _checked(lr, eps, (alpha, momentum), weight_decay)
    if momentum != 0:
        raise ValueError(
            f"roundpipe.optim.RMSprop8bit: momentum={momentum!r}: bitsandbytes' RMSprop step "
            "applies no momentum (it would silently step as momentum=0); use momentum=0, or "
            "torch.optim.RMSprop"
        )
    return dict(lr=lr, betas=(alpha, momentum), eps=eps, weight_decay=weight_decay)


def _adagrad(name, a):
    lr, weight_decay, eps = a["lr"], a["weight_decay"], a["eps"]
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if a["initial_accumulator_value"] != 0.0:
        raise ValueError("Initial accumulator value != 0.0 not supported!")
    if a["lr_decay"] != 0.0:
        raise ValueError("Lr Decay != 0.0 not supported!")
    if a["optim_bits"] != 8:
        raise ValueError("Adagrad8bit only supports optim_bits=8 (default value for compatibility)")
    return dict(lr=lr, betas=(0.0, 0.0), eps=eps, weight_decay=weight_decay)


_RICH = dict(lr=1e-2, weight_decay=0.1)  # every state tensor, weight decay on


def _entry(name: str, step: str, construct, parameters: dict, rich=_RICH) -> EightBitSpec:
    base = STEPS[step]
    spec = {f.name: getattr(base, f.name) for f in fields(base)}  # (its programs' cache shared)
    spec.update(name=name, construct=construct, parameters=tuple(parameters.items()), rich_kwargs=rich)
    return EightBitSpec(**spec)


def paged(spec: EightBitSpec, *, is_paged: bool = False) -> EightBitSpec:
    """The ``Paged`` class of ``spec``'s: the same step and checks; its signature keeps
    ``is_paged`` (ignored, as bitsandbytes ignores it) where ``is_paged`` is True."""
    parameters = spec.parameters if is_paged else tuple(p for p in spec.parameters if p[0] != "is_paged")
    return replace(spec, name="Paged" + spec.name, parameters=parameters, paged=True)


# each class's parameters after ``params``, bitsandbytes' (dicts keep their order)
_TAIL = dict(args=None, min_8bit_size=MIN_8BIT_SIZE)
_ADAM = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
_ADAM_TAIL = dict(amsgrad=False, optim_bits=32, **_TAIL, is_paged=False)
_SPECS = [
    _entry("Adam8bit", "adam", _adam, {**_ADAM, "weight_decay": 0, **_ADAM_TAIL}),
    _entry("AdamW8bit", "adam", _adam, {**_ADAM, "weight_decay": 1e-2, **_ADAM_TAIL}),
    _entry(
        "Lion8bit", "lion", _lion, dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0, **_TAIL, is_paged=False)
    ),
    _entry(
        "SGD8bit",
        "momentum",
        _sgd,
        dict(lr=REQUIRED, momentum=0, dampening=0, weight_decay=0, nesterov=False, **_TAIL),
        dict(lr=1e-2, momentum=0.9, weight_decay=0.1),  # (momentum 0 is refused)
    ),
    _entry(
        "RMSprop8bit",
        "rmsprop",
        _rmsprop,
        dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False, **_TAIL),
    ),
    _entry(
        "Adagrad8bit",
        "adagrad",
        _adagrad,
        dict(
            lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10, optim_bits=8, **_TAIL
        ),
    ),
    _entry(
        "AdEMAMix8bit",
        "ademamix",
        _ademamix,
        dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None, eps=1e-8)
        | dict(weight_decay=1e-2, min_8bit_size=MIN_8BIT_SIZE, is_paged=False),
    ),
]
EIGHTBIT_SPECS = {s.name: s for s in _SPECS}
EIGHTBIT_SPECS["PagedAdam8bit"] = paged(EIGHTBIT_SPECS["Adam8bit"], is_paged=True)
EIGHTBIT_SPECS["PagedAdamW8bit"] = paged(EIGHTBIT_SPECS["AdamW8bit"])
EIGHTBIT_SPECS["PagedLion8bit"] = paged(EIGHTBIT_SPECS["Lion8bit"])
EIGHTBIT_SPECS["PagedAdEMAMix8bit"] = paged(EIGHTBIT_SPECS["AdEMAMix8bit"])

# bitsandbytes' classes roundpipe has but refuses to construct: their CPU step is another's
REFUSED = {
    "LAMB8bit": (
        "bitsandbytes' CPU step of LAMB8bit applies no trust ratio (it steps exactly as Adam8bit), "
        "so it is not LAMB; roundpipe refuses rather than copy that. Use roundpipe.optim.Adam8bit "
        "for what that step computes."
    ),
    "LARS8bit": (
        "bitsandbytes' CPU step of LARS8bit applies no trust ratio (it steps exactly as SGD8bit), "
        "so it is not LARS; roundpipe refuses rather than copy that. Use roundpipe.optim.SGD8bit "
        "for what that step computes."
    ),
}
