"""The public optimizer classes, one class statement each.

Each subclasses its ``torch.optim`` namesake and ``RoundpipeOptimizer`` (``optimizer.py``), which
installs at class creation an ``__init__`` with the installed torch's own signature plus the
keyword-only ``backend``, ``state_dtype`` and ``stochastic_rounding``: the arguments, defaults,
errors, ``param_groups`` and ``state_dict`` are torch's. The ``__init__`` declared under
``TYPE_CHECKING`` is that signature written out for type checkers and editors (torch 2.13's,
which a test holds against the installed torch); it never runs. ``backend``: ``"fast"`` (the
default), ``"fast:numba"``, ``"fast:torch"``, ``"fast:numexpr"`` or ``"reference"``
(``roundpipe.optim.backends``); None reads ``ROUNDPIPE_OPTIM_BACKEND``. ``state_dtype``: the
dtype of the state tensors (None: each parameter's, as torch; ``torch.bfloat16``: moments at 2
bytes an element, stepped in float32);
``stochastic_rounding``: bfloat16 parameters rounded stochastically (``roundpipe.optim.storage``).
Adafactor and Muon take neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .optimizer import RoundpipeOptimizer
from .spec import SPECS, STAGED_SPECS

if TYPE_CHECKING:
    from torch import Tensor
    from torch.optim.optimizer import ParamsT

__all__ = [
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "Adamax",
    "AdamW",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SGD",
]


class Adadelta(RoundpipeOptimizer, torch.optim.Adadelta):
    """``torch.optim.Adadelta`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["Adadelta"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 1.0,
            rho: float = 0.9,
            eps: float = 1e-06,
            weight_decay: float = 0,
            foreach: bool | None = None,
            *,
            capturable: bool = False,
            maximize: bool = False,
            differentiable: bool = False,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class Adafactor(RoundpipeOptimizer, torch.optim.Adafactor):
    """``torch.optim.Adafactor`` stepped by roundpipe's CPU backends: the same arguments,
    defaults, errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = STAGED_SPECS["Adafactor"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.01,
            beta2_decay: float = -0.8,
            eps: tuple[float | None, float] = (None, 0.001),
            d: float = 1.0,
            weight_decay: float = 0.0,
            *,
            foreach: bool | None = None,
            maximize: bool = False,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class Adagrad(RoundpipeOptimizer, torch.optim.Adagrad):
    """``torch.optim.Adagrad`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["Adagrad"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.01,
            lr_decay: float = 0,
            weight_decay: float = 0,
            initial_accumulator_value: float = 0,
            eps: float = 1e-10,
            foreach: bool | None = None,
            *,
            maximize: bool = False,
            differentiable: bool = False,
            fused: bool | None = None,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class Adam(RoundpipeOptimizer, torch.optim.Adam):
    """``torch.optim.Adam`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["Adam"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.001,
            betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
            eps: float = 1e-08,
            weight_decay: float = 0,
            amsgrad: bool = False,
            *,
            foreach: bool | None = None,
            maximize: bool = False,
            capturable: bool = False,
            differentiable: bool = False,
            fused: bool | None = None,
            decoupled_weight_decay: bool = False,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class Adamax(RoundpipeOptimizer, torch.optim.Adamax):
    """``torch.optim.Adamax`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["Adamax"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.002,
            betas: tuple[float, float] = (0.9, 0.999),
            eps: float = 1e-08,
            weight_decay: float = 0,
            foreach: bool | None = None,
            *,
            maximize: bool = False,
            differentiable: bool = False,
            capturable: bool = False,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class AdamW(RoundpipeOptimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["AdamW"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.001,
            betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
            eps: float = 1e-08,
            weight_decay: float = 0.01,
            amsgrad: bool = False,
            *,
            maximize: bool = False,
            foreach: bool | None = None,
            capturable: bool = False,
            differentiable: bool = False,
            fused: bool | None = None,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class ASGD(RoundpipeOptimizer, torch.optim.ASGD):
    """``torch.optim.ASGD`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["ASGD"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.01,
            lambd: float = 0.0001,
            alpha: float = 0.75,
            t0: float = 1000000.0,
            weight_decay: float = 0,
            foreach: bool | None = None,
            maximize: bool = False,
            differentiable: bool = False,
            capturable: bool = False,
            *,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class NAdam(RoundpipeOptimizer, torch.optim.NAdam):
    """``torch.optim.NAdam`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["NAdam"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.002,
            betas: tuple[float, float] = (0.9, 0.999),
            eps: float = 1e-08,
            weight_decay: float = 0,
            momentum_decay: float = 0.004,
            decoupled_weight_decay: bool = False,
            *,
            foreach: bool | None = None,
            maximize: bool = False,
            capturable: bool = False,
            differentiable: bool = False,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class RAdam(RoundpipeOptimizer, torch.optim.RAdam):
    """``torch.optim.RAdam`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["RAdam"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.001,
            betas: tuple[float, float] = (0.9, 0.999),
            eps: float = 1e-08,
            weight_decay: float = 0,
            decoupled_weight_decay: bool = False,
            *,
            foreach: bool | None = None,
            maximize: bool = False,
            capturable: bool = False,
            differentiable: bool = False,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class RMSprop(RoundpipeOptimizer, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["RMSprop"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.01,
            alpha: float = 0.99,
            eps: float = 1e-08,
            weight_decay: float = 0,
            momentum: float = 0,
            centered: bool = False,
            capturable: bool = False,
            foreach: bool | None = None,
            maximize: bool = False,
            differentiable: bool = False,
            *,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class Rprop(RoundpipeOptimizer, torch.optim.Rprop):
    """``torch.optim.Rprop`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["Rprop"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.01,
            etas: tuple[float, float] = (0.5, 1.2),
            step_sizes: tuple[float, float] = (1e-06, 50),
            *,
            capturable: bool = False,
            foreach: bool | None = None,
            maximize: bool = False,
            differentiable: bool = False,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


class SGD(RoundpipeOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` stepped by roundpipe's CPU backends: the same arguments, defaults,
    errors, state and ``state_dict``, and a keyword-only ``backend``."""

    spec = SPECS["SGD"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float | Tensor = 0.001,
            momentum: float = 0,
            dampening: float = 0,
            weight_decay: float | Tensor = 0,
            nesterov: bool = False,
            *,
            maximize: bool = False,
            foreach: bool | None = None,
            differentiable: bool = False,
            fused: bool | None = None,
            backend: str | None = None,
            state_dtype: torch.dtype | None = None,
            stochastic_rounding: bool = False,
        ) -> None: ...


# torch.optim.Muon exists from torch 2.9: before, importing roundpipe.optim.Muon raises an
# ImportError naming the installed torch (roundpipe/optim/__init__.py)
if TYPE_CHECKING or "Muon" in STAGED_SPECS:
    __all__.append("Muon")  # (only where it exists: star-imports work on a torch without it)

    class Muon(RoundpipeOptimizer, torch.optim.Muon):
        """``torch.optim.Muon`` stepped by roundpipe's CPU backends: the same arguments, defaults,
        errors, state and ``state_dict``, and a keyword-only ``backend``. The Newton-Schulz
        matmuls are torch's own."""

        spec = STAGED_SPECS["Muon"]

        if TYPE_CHECKING:

            def __init__(
                self,
                params: ParamsT,
                lr: float = 0.001,
                weight_decay: float = 0.1,
                momentum: float = 0.95,
                nesterov: bool = True,
                ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                eps: float = 1e-07,
                ns_steps: int = 5,
                adjust_lr_fn: str | None = None,
                *,
                backend: str | None = None,
                state_dtype: torch.dtype | None = None,
                stochastic_rounding: bool = False,
            ) -> None: ...
