"""The 8-bit family: bitsandbytes' ``*8bit`` optimizers with their names, signatures, defaults,
errors, state and ``state_dict``, stepping as bitsandbytes 0.50's CPU step does, bit for bit
(the math: ``spec/eightbit.py``). bitsandbytes is never imported: switching is a change of
import, and a checkpoint loads both ways.

What they leave out, each raising a clear error where bitsandbytes would accept it: bfloat16 and
float16 parameters (use ``fp32_masters``: float32 masters with 8-bit state), ``args=``, and
per-parameter overrides from bitsandbytes' ``GlobalOptimManager``. ``LAMB8bit`` and ``LARS8bit``
refuse: bitsandbytes' CPU step leaves out their trust ratio (docs/contract.md).
"""

from __future__ import annotations

import copy
import itertools
import warnings

import torch

from . import backends
from .optimizer import RoundpipeOptimizer
from .spec.eightbit import EIGHTBIT_SPECS, MIN_8BIT_SIZE

__all__ = [
    "Adam8bit",
    "AdamW8bit",
    "Lion8bit",
    "SGD8bit",
    "RMSprop8bit",
    "Adagrad8bit",
    "AdEMAMix8bit",
    "LAMB8bit",
    "LARS8bit",
    "PagedAdam8bit",
    "PagedAdamW8bit",
    "PagedLion8bit",
    "PagedAdEMAMix8bit",
]

# the state entries bitsandbytes' state_dict nests under one key, so that FSDP's gathering
# skips them (bitsandbytes.optim.optimizer.Optimizer8bit)
QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"
_QUANT_KEYS = frozenset(
    ("qmap1", "qmap2", "max1", "max2", "new_max1", "new_max2", "state1", "state2")
    + ("gnorm_vec", "absmax1", "absmax2", "unorm_vec")
)


def _check_hyperparameters(lr, eps, betas, weight_decay):
    # bitsandbytes' Optimizer1State / Optimizer2State checks, in its order and words
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for i in range(len(betas)):
        if not 0.0 <= betas[i] < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class Optimizer8bit(RoundpipeOptimizer):
    """Base of the 8-bit family: bitsandbytes' ``Optimizer8bit`` contract on roundpipe's step."""

    def _setup(self, params, defaults, args, min_8bit_size, backend, paged=False):
        if args is not None:
            raise ValueError(
                f"roundpipe.optim.{type(self).__name__}: args= is not supported; pass min_8bit_size "
                "(and the hyperparameters) as arguments"
            )
        self._roundpipe_backend = backends.resolve(backend)
        self.min_8bit_size = int(min_8bit_size)
        torch.optim.Optimizer.__init__(self, params, {**defaults, "min_8bit_size": self.min_8bit_size})
        if paged:
            warnings.warn(
                "Paged optimizers are not supported on CPU. Falling back to non-paged optimizer behavior.",
                stacklevel=3,
            )

    def state_dict(self):
        """torch's ``state_dict`` with bitsandbytes' layout: the quantization entries of each
        parameter's state nested under ``__bnb_optimizer_quant_state__``."""
        sd = super().state_dict()
        states = {}
        for k, v in sd["state"].items():
            v = dict(v)
            quant = {key: v.pop(key) for key in list(v) if key in _QUANT_KEYS}
            if quant:
                v[QUANT_STATE_KEY] = quant
            states[k] = v
        sd["state"] = states
        return sd

    def load_state_dict(self, state_dict):
        """Loads ours or bitsandbytes' ``state_dict`` (nested or not) from a deep copy, as
        bitsandbytes does (torch's would share the tensors of ``state_dict``); a group without
        ``min_8bit_size`` (bitsandbytes') takes this optimizer's."""
        state_dict = copy.deepcopy(state_dict)
        states = {}
        for k, v in state_dict["state"].items():
            if isinstance(v, dict) and QUANT_STATE_KEY in v:
                v = {**{n: x for n, x in v.items() if n != QUANT_STATE_KEY}, **v[QUANT_STATE_KEY]}
            states[k] = v
        super().load_state_dict({**state_dict, "state": states})
        # torch's load casts every tensor to its parameter's dtype, the 8-bit codes included;
        # bitsandbytes keeps the quantization entries as saved
        saved = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for key, p in zip(saved, params, strict=True):
            entry = states.get(key)
            if isinstance(entry, dict):
                self.state[p].update({n: v for n, v in entry.items() if n in _QUANT_KEYS})
        for group in self.param_groups:
            group.setdefault("min_8bit_size", self.min_8bit_size)


def _spec(name):
    return EIGHTBIT_SPECS[name]


class Adam8bit(Optimizer8bit):
    """bitsandbytes' ``Adam8bit`` (decoupled weight decay, as its CPU step applies it)."""

    spec = _spec("Adam8bit")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        optim_bits=32,
        args=None,
        min_8bit_size=MIN_8BIT_SIZE,
        is_paged=False,
        *,
        backend=None,
    ):
        name = type(self).__name__
        if amsgrad:
            raise ValueError(f"{name} does not support amsgrad=True")
        if optim_bits != 32:
            raise ValueError(f"{name} only supports optim_bits=32 (default value for compatibility)")
        _check_hyperparameters(lr, eps, betas, weight_decay)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, alpha=0.0, t_alpha=None, t_beta3=None
        )
        self._setup(params, defaults, args, min_8bit_size, backend, paged=is_paged)


class AdamW8bit(Adam8bit):
    """bitsandbytes' ``AdamW8bit``: ``Adam8bit`` with ``weight_decay=1e-2``."""

    spec = _spec("AdamW8bit")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        optim_bits=32,
        args=None,
        min_8bit_size=MIN_8BIT_SIZE,
        is_paged=False,
        *,
        backend=None,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            optim_bits,
            args,
            min_8bit_size,
            is_paged,
            backend=backend,
        )


class PagedAdam8bit(Adam8bit):
    """bitsandbytes' ``PagedAdam8bit``: on the CPU, ``Adam8bit`` (it warns, as bitsandbytes does)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        optim_bits=32,
        args=None,
        min_8bit_size=MIN_8BIT_SIZE,
        is_paged=False,
        *,
        backend=None,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            optim_bits,
            args,
            min_8bit_size,
            True,
            backend=backend,
        )


class PagedAdamW8bit(AdamW8bit):
    """bitsandbytes' ``PagedAdamW8bit``: on the CPU, ``AdamW8bit`` (it warns, as bitsandbytes does)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        optim_bits=32,
        args=None,
        min_8bit_size=MIN_8BIT_SIZE,
        *,
        backend=None,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            optim_bits,
            args,
            min_8bit_size,
            True,
            backend=backend,
        )


class Lion8bit(Optimizer8bit):
    """bitsandbytes' ``Lion8bit``."""

    spec = _spec("Lion8bit")

    def __init__(
        self,
        params,
        lr=1e-4,
        betas=(0.9, 0.99),
        weight_decay=0,
        args=None,
        min_8bit_size=MIN_8BIT_SIZE,
        is_paged=False,
        *,
        backend=None,
    ):
        _check_hyperparameters(lr, 0.0, betas, weight_decay)
        defaults = dict(lr=lr, betas=betas, eps=0.0, weight_decay=weight_decay)
        self._setup(params, defaults, args, min_8bit_size, backend, paged=is_paged)


class PagedLion8bit(Lion8bit):
    """bitsandbytes' ``PagedLion8bit``: on the CPU, ``Lion8bit`` (it warns, as bitsandbytes does)."""

    def __init__(
        self,
        params,
        lr=1e-4,
        betas=(0.9, 0.99),
        weight_decay=0,
        args=None,
        min_8bit_size=MIN_8BIT_SIZE,
        *,
        backend=None,
    ):
        super().__init__(params, lr, betas, weight_decay, args, min_8bit_size, True, backend=backend)


class SGD8bit(Optimizer8bit):
    """bitsandbytes' ``SGD8bit`` (momentum SGD). Its step reads neither ``dampening`` nor
    ``nesterov``: other values than the defaults raise here instead of being ignored."""

    spec = _spec("SGD8bit")

    def __init__(
        self,
        params,
        lr,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        args=None,
        min_8bit_size=MIN_8BIT_SIZE,
        *,
        backend=None,
    ):
        if momentum == 0:
            raise NotImplementedError("SGD without momentum is not supported!")
        _check_hyperparameters(lr, 0.0, (momentum, dampening), weight_decay)
        if dampening != 0 or nesterov:
            raise ValueError(
                f"roundpipe.optim.SGD8bit: dampening={dampening!r}, nesterov={nesterov!r}: bitsandbytes' "
                "8-bit momentum step applies neither (it would silently step as dampening=0, "
                "nesterov=False); use those values, or torch.optim.SGD"
            )
        defaults = dict(lr=lr, betas=(momentum, dampening), eps=0.0, weight_decay=weight_decay)
        self._setup(params, defaults, args, min_8bit_size, backend)


class RMSprop8bit(Optimizer8bit):
    """bitsandbytes' ``RMSprop8bit``. Its step reads no ``momentum``: a non-zero one raises here
    instead of being ignored."""

    spec = _spec("RMSprop8bit")

    def __init__(
        self,
        params,
        lr=1e-2,
        alpha=0.99,
        eps=1e-8,
        weight_decay=0,
        momentum=0,
        centered=False,
        args=None,
        min_8bit_size=MIN_8BIT_SIZE,
        *,
        backend=None,
    ):
        if alpha == 0:
            raise NotImplementedError("RMSprop with alpha==0.0 is not supported!")
        if centered:
            raise NotImplementedError("Centered RMSprop is not supported!")
        _check_hyperparameters(lr, eps, (alpha, momentum), weight_decay)
        if momentum != 0:
            raise ValueError(
                f"roundpipe.optim.RMSprop8bit: momentum={momentum!r}: bitsandbytes' RMSprop step "
                "applies no momentum (it would silently step as momentum=0); use momentum=0, or "
                "torch.optim.RMSprop"
            )
        defaults = dict(lr=lr, betas=(alpha, momentum), eps=eps, weight_decay=weight_decay)
        self._setup(params, defaults, args, min_8bit_size, backend)


class Adagrad8bit(Optimizer8bit):
    """bitsandbytes' ``Adagrad8bit``."""

    spec = _spec("Adagrad8bit")

    def __init__(
        self,
        params,
        lr=1e-2,
        lr_decay=0,
        weight_decay=0,
        initial_accumulator_value=0,
        eps=1e-10,
        optim_bits=8,
        args=None,
        min_8bit_size=MIN_8BIT_SIZE,
        *,
        backend=None,
    ):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if initial_accumulator_value != 0.0:
            raise ValueError("Initial accumulator value != 0.0 not supported!")
        if lr_decay != 0.0:
            raise ValueError("Lr Decay != 0.0 not supported!")
        if optim_bits != 8:
            raise ValueError("Adagrad8bit only supports optim_bits=8 (default value for compatibility)")
        defaults = dict(lr=lr, betas=(0.0, 0.0), eps=eps, weight_decay=weight_decay)
        self._setup(params, defaults, args, min_8bit_size, backend)


class _Refused(torch.optim.Optimizer):
    """A bitsandbytes 8-bit class whose CPU step roundpipe does not reproduce: constructing one
    raises, naming why and what to use."""

    reason = ""

    def __init__(self, params, *args, backend=None, **kwargs):
        raise NotImplementedError(f"roundpipe.optim.{type(self).__name__}: {self.reason}")


class LAMB8bit(_Refused):
    reason = (
        "bitsandbytes' CPU step of LAMB8bit applies no trust ratio (it steps exactly as Adam8bit), "
        "so it is not LAMB; roundpipe refuses rather than copy that. Use roundpipe.optim.Adam8bit "
        "for what that step computes."
    )


class LARS8bit(_Refused):
    reason = (
        "bitsandbytes' CPU step of LARS8bit applies no trust ratio (it steps exactly as SGD8bit), "
        "so it is not LARS; roundpipe refuses rather than copy that. Use roundpipe.optim.SGD8bit "
        "for what that step computes."
    )


class AdEMAMix8bit(Optimizer8bit):
    """bitsandbytes' ``AdEMAMix8bit``: a fast and a slow first moment (``state1``, two halves)."""

    spec = _spec("AdEMAMix8bit")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        t_alpha=None,
        t_beta3=None,
        eps=1e-8,
        weight_decay=1e-2,
        min_8bit_size=MIN_8BIT_SIZE,
        is_paged=False,
        *,
        backend=None,
    ):
        _check_hyperparameters(lr, eps, betas, weight_decay)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        defaults.update(alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3)
        self._setup(params, defaults, None, min_8bit_size, backend, paged=is_paged)


class PagedAdEMAMix8bit(AdEMAMix8bit):
    """bitsandbytes' ``PagedAdEMAMix8bit``: on the CPU, ``AdEMAMix8bit`` (it warns, as bitsandbytes does)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        t_alpha=None,
        t_beta3=None,
        eps=1e-8,
        weight_decay=1e-2,
        min_8bit_size=MIN_8BIT_SIZE,
        *,
        backend=None,
    ):
        super().__init__(
            params,
            lr,
            betas,
            alpha,
            t_alpha,
            t_beta3,
            eps,
            weight_decay,
            min_8bit_size,
            True,
            backend=backend,
        )
