"""The 8-bit family: bitsandbytes' ``*8bit`` optimizers with their names, signatures, defaults,
errors, state and ``state_dict``, stepping as bitsandbytes 0.50's CPU step does, bit for bit
(the math: ``spec/eightbit.py``). bitsandbytes is never imported: switching is a change of
import, and a checkpoint loads both ways.

Each class is one class statement over its entry of the registry ``EIGHTBIT_SPECS``
(``spec/eightbit_classes.py``), as the torch family's are over ``SPECS``: ``Optimizer8bit``
installs at class creation the ``__init__`` that runs, bitsandbytes' signature from the entry
plus the keyword-only ``backend``. The ``__init__`` declared under ``TYPE_CHECKING`` is that
signature written out for type checkers, unannotated where bitsandbytes' is (all but
AdEMAMix's); it never runs (``tests/public_api/test_typing.py`` holds it against the one that
does). A ``Paged`` class declares none: type checkers see its base's.

Per-parameter config from bitsandbytes' ``GlobalOptimManager`` (or roundpipe's, for a process
without bitsandbytes) is honoured as bitsandbytes' CPU step honours it (``overrides.py``).
What they leave out, each raising a clear error where bitsandbytes would accept it: bfloat16 and
float16 parameters (use ``fp32_masters``: float32 masters with 8-bit state), ``args=``, and a
config's ``max_unorm``. ``LAMB8bit`` and ``LARS8bit`` refuse: bitsandbytes' CPU step leaves out
their trust ratio (docs/contract.md).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import warnings
from typing import TYPE_CHECKING

import torch

from . import backends, overrides
from .optimizer import RoundpipeOptimizer
from .spec import EIGHTBIT_SPECS
from .spec.eightbit_classes import REFUSED

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

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


class Optimizer8bit(RoundpipeOptimizer):
    """Base of the 8-bit family: bitsandbytes' ``Optimizer8bit`` contract on roundpipe's step."""

    def __init_subclass__(cls, **kwargs):
        # not RoundpipeOptimizer's hook, which installs a torch class's __init__: a class of the
        # registry gets bitsandbytes' (its spec's); a subclass without a spec keeps its base's
        super(RoundpipeOptimizer, cls).__init_subclass__(**kwargs)
        if "spec" in cls.__dict__ and "__init__" not in cls.__dict__:
            cls.__init__ = _make_init(cls)  # type: ignore[method-assign]

    def _setup(self, arguments: dict, defaults: dict, paged: bool) -> None:
        if arguments.get("args") is not None:
            raise ValueError(
                f"roundpipe.optim.{type(self).__name__}: args= is not supported; pass min_8bit_size "
                "(and the hyperparameters) as arguments"
            )
        self._roundpipe_backend = backends.resolve(arguments["backend"])
        self.min_8bit_size = int(arguments["min_8bit_size"])
        defaults = {**defaults, "min_8bit_size": self.min_8bit_size}
        torch.optim.Optimizer.__init__(self, arguments["params"], defaults)
        overrides.bind(self)
        if paged:
            warnings.warn(
                "Paged optimizers are not supported on CPU. Falling back to non-paged optimizer behavior.",
                stacklevel=3,
            )

    def __getstate__(self):
        return {**super().__getstate__(), "min_8bit_size": self.min_8bit_size}

    def __setstate__(self, state):
        super().__setstate__(state)
        if "spec" not in self.__dict__:  # unpickled: the per-parameter config read anew
            overrides.bind(self)

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


def _make_init(cls):
    """bitsandbytes' ``__init__`` of ``cls.spec`` (its parameters, checks and defaults) plus the
    keyword-only ``backend``."""
    spec = cls.spec
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [inspect.Parameter("self", kind), inspect.Parameter("params", kind)]
    parameters += [inspect.Parameter(name, kind, default=default) for name, default in spec.parameters]
    backend = inspect.Parameter(
        "backend", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None"
    )
    signature = inspect.Signature([*parameters, backend])

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        self._setup(arguments, spec.construct(spec.name, arguments), spec.paged)

    __init__.__signature__ = signature  # type: ignore[attr-defined]
    __init__.__qualname__ = f"{cls.__name__}.__init__"
    return __init__


class Adam8bit(Optimizer8bit):
    """bitsandbytes' ``Adam8bit`` (decoupled weight decay, as its CPU step applies it)."""

    spec = EIGHTBIT_SPECS["Adam8bit"]

    if TYPE_CHECKING:

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
            min_8bit_size=4096,
            is_paged=False,
            *,
            backend: str | None = None,
        ) -> None: ...


class AdamW8bit(Adam8bit):
    """bitsandbytes' ``AdamW8bit``: ``Adam8bit`` with ``weight_decay=1e-2``."""

    spec = EIGHTBIT_SPECS["AdamW8bit"]

    if TYPE_CHECKING:

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
            min_8bit_size=4096,
            is_paged=False,
            *,
            backend: str | None = None,
        ) -> None: ...


class PagedAdam8bit(Adam8bit):
    """bitsandbytes' ``PagedAdam8bit``: on the CPU, ``Adam8bit`` (it warns, as bitsandbytes does)."""

    spec = EIGHTBIT_SPECS["PagedAdam8bit"]


class PagedAdamW8bit(AdamW8bit):
    """bitsandbytes' ``PagedAdamW8bit``: on the CPU, ``AdamW8bit`` (it warns, as bitsandbytes does)."""

    spec = EIGHTBIT_SPECS["PagedAdamW8bit"]


class Lion8bit(Optimizer8bit):
    """bitsandbytes' ``Lion8bit``."""

    spec = EIGHTBIT_SPECS["Lion8bit"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params,
            lr=1e-4,
            betas=(0.9, 0.99),
            weight_decay=0,
            args=None,
            min_8bit_size=4096,
            is_paged=False,
            *,
            backend: str | None = None,
        ) -> None: ...


class PagedLion8bit(Lion8bit):
    """bitsandbytes' ``PagedLion8bit``: on the CPU, ``Lion8bit`` (it warns, as bitsandbytes does)."""

    spec = EIGHTBIT_SPECS["PagedLion8bit"]


class SGD8bit(Optimizer8bit):
    """bitsandbytes' ``SGD8bit`` (momentum SGD). Its step reads neither ``dampening`` nor
    ``nesterov``: other values than the defaults raise here instead of being ignored."""

    spec = EIGHTBIT_SPECS["SGD8bit"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params,
            lr,
            momentum=0,
            dampening=0,
            weight_decay=0,
            nesterov=False,
            args=None,
            min_8bit_size=4096,
            *,
            backend: str | None = None,
        ) -> None: ...


class RMSprop8bit(Optimizer8bit):
    """bitsandbytes' ``RMSprop8bit``. Its step reads no ``momentum``: a non-zero one raises here
    instead of being ignored."""

    spec = EIGHTBIT_SPECS["RMSprop8bit"]

    if TYPE_CHECKING:

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
            min_8bit_size=4096,
            *,
            backend: str | None = None,
        ) -> None: ...


class Adagrad8bit(Optimizer8bit):
    """bitsandbytes' ``Adagrad8bit``."""

    spec = EIGHTBIT_SPECS["Adagrad8bit"]

    if TYPE_CHECKING:

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
            min_8bit_size=4096,
            *,
            backend: str | None = None,
        ) -> None: ...


class AdEMAMix8bit(Optimizer8bit):
    """bitsandbytes' ``AdEMAMix8bit``: a fast and a slow first moment (``state1``, two halves)."""

    spec = EIGHTBIT_SPECS["AdEMAMix8bit"]

    if TYPE_CHECKING:

        def __init__(
            self,
            params: ParamsT,
            lr: float = 1e-3,
            betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
            alpha: float = 5.0,
            t_alpha: int | None = None,
            t_beta3: int | None = None,
            eps: float = 1e-8,
            weight_decay: float = 1e-2,
            min_8bit_size: int = 4096,
            is_paged: bool = False,
            *,
            backend: str | None = None,
        ) -> None: ...


class PagedAdEMAMix8bit(AdEMAMix8bit):
    """bitsandbytes' ``PagedAdEMAMix8bit``: on the CPU, ``AdEMAMix8bit`` (it warns, as bitsandbytes does)."""

    spec = EIGHTBIT_SPECS["PagedAdEMAMix8bit"]


class Refused8bit(torch.optim.Optimizer):
    """A bitsandbytes 8-bit class whose CPU step roundpipe does not reproduce: constructing one
    raises, naming why and what to use (``spec/eightbit_classes.py``'s ``REFUSED``)."""

    def __init__(self, params, *args, backend=None, **kwargs):
        name = type(self).__name__
        raise NotImplementedError(f"roundpipe.optim.{name}: {REFUSED[name]}")


class LAMB8bit(Refused8bit):
    """bitsandbytes' ``LAMB8bit``: refused (its CPU step is Adam8bit's)."""


class LARS8bit(Refused8bit):
    """bitsandbytes' ``LARS8bit``: refused (its CPU step is SGD8bit's)."""
