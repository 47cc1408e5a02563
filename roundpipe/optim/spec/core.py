"""What an optimizer spec is: the one place an optimizer's math lives.

Each optimizer module in this package (``adam.py``, ``sgd.py`` ...) defines one
:class:`OptimizerSpec` that mirrors torch's ``_single_tensor_<name>`` function:

``init_state(group, p, state)``
    creates missing state entries exactly as torch's ``_init_group`` does (same keys, dtypes
    and initial values), so that ``state_dict()`` is interchangeable with ``torch.optim``.
    It may return a dict of flags for this step (SGD: ``first``, the step that creates the
    momentum buffer).
``options(group)``
    the options fixed for a param group that select which statements exist
    (``amsgrad``, ``maximize``, ``weight_decay != 0`` ...), as a dict of hashable values.
``inputs(o)``
    the tensors the program binds for options ``o``: ``param``, ``grad`` and state entries.
    They are checked (present, shape, dtype, layout) before anything is modified.
``scalar_state``
    the names of the 0-d state tensors (``step``; ASGD's ``eta`` and ``mu``; NAdam's
    ``mu_product``).
``scalars(group, state)``
    the per-parameter Python part of a step, written as torch writes it: advances the 0-d
    state tensors in ``state`` (which holds only the ``scalar_state`` entries) and returns the
    per-step scalars in Python double precision (bias corrections, step sizes). A ``step``
    entry may be a :class:`Scratch` (its value, rounded as the tensor would be) instead of a
    tensor: only ``+= 1`` and ``advance_step`` may touch it. Entries whose
    value is a ``bool`` are *flags*: they join the options to select the program for this step
    (RAdam's rectification, ASGD's ``mu == 1``; declared in ``flags``). It sees nothing but the
    group and the 0-d state, so parameters whose 0-d state is equal get equal scalars: the step loop calls it
    once per distinct 0-d state, not once per parameter.
``statements(o, b)``
    adds the elementwise statements for options ``o`` (attribute access; static options and
    this step's flags) to ``b``, a :class:`~roundpipe.optim.spec.ir.ProgramBuilder` over
    ``inputs(o)``. ``OptimizerSpec.program(options)`` runs it, builds the
    :class:`~roundpipe.optim.spec.ir.Program` (``b.build()``) and caches it per options.

Two sets of constructor keyword arguments (valid for ``torch_class``) let the tests step every
optimizer without a table of their own, so that a new spec needs no edit in ``tests/``:

``rich_kwargs``
    hyperparameters that switch on the optimizer's state and optional branches (every state
    tensor any of its programs binds, weight decay where it has one), for the unit tests that
    train a few steps and compare with torch (``tests/_util.py``'s ``RICH_KWARGS``).
``fidelity_kwargs``
    hyperparameters for the long run of ``tests/test_fidelity.py`` (1,000 steps of
    least-squares problems whose optimum is far from the start): a learning rate small enough
    that the run is still on its way to the optimum at the end, without oscillating around it,
    where a float32 run tracks the exact one and a slightly wrong update shows (see that
    module's docstring). ``{}`` where torch's defaults do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import torch
from torch.optim import optimizer as _torch_optimizer
from torch.optim.optimizer import _get_scalar_dtype, _get_value

from .ir import Bin, Let, Program, ProgramBuilder, Scalar

__all__ = [
    "OptimizerSpec",
    "Options",
    "advance_step",
    "zero_step",
    "zeros_like",
    "value",
    "set_value",
    "to_scalar",
]


class Options(dict):
    """Options with attribute access: ``o.amsgrad``. A missing option is an AttributeError."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no option {name!r}; options are {sorted(self)}") from None


@dataclass(frozen=True)
class SpecBase:
    """What every spec has beside its math (``OptimizerSpec``, ``staged.StagedSpec``): its test
    kwargs and the cache of what it builds per set of options (``built_once``)."""

    # keyword-only and required: a spec without them cannot be built, rather than a test
    # failing later with a KeyError; not compared, as they are test data, not the algorithm
    rich_kwargs: Mapping = field(kw_only=True, repr=False, compare=False)
    fidelity_kwargs: Mapping = field(kw_only=True, repr=False, compare=False)
    _cache: dict = field(default_factory=dict, kw_only=True, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, kw_only=True, repr=False, compare=False)

    def __post_init__(self):
        freeze_test_kwargs(self)


@dataclass(frozen=True)
class OptimizerSpec(SpecBase):
    name: str
    torch_class: type
    init_state: Callable
    options: Callable
    inputs: Callable
    scalars: Callable
    statements: Callable
    scalar_state: tuple = ("step",)
    flags: tuple = ()  # per-step flags (bools from init_state or scalars) that select the program
    # torch holds a few scalars as 0-d tensors, which its ops round to a bfloat16 or float16
    # parameter's dtype (a tensor lerp weight: ``1 - beta1`` of a tensor beta1), unless the
    # parameter is 0-d too (type promotion: the op runs in float32). For such a parameter the
    # step calls ``low_precision_scalars(group, values, dtype, zero_dim)`` on the scalars
    # ``scalars`` returned; it returns them with those rounded as torch rounds them
    low_precision_scalars: Callable | None = None
    # torch has a fused CPU kernel for it (``fused=True``), which ``options(group)["fused"]``
    # selects: its arithmetic, and a bfloat16 or float16 parameter stepped widened
    fused_kernel: bool = False

    def program(self, options: dict) -> Program:
        return built_once(self, options, self._build)

    def _build(self, o: Options) -> Program:
        return build_program(o, self.inputs(o), self.statements)


def build_program(o, inputs, statements, kinds=None) -> Program:
    """``statements(o, b)`` on a builder over ``inputs`` (``kinds``: those of a kind), after
    the gradient factors of the options (``gradient_factors``), validated."""
    o = Options(dict(o))
    b = ProgramBuilder(inputs, kinds)
    gradient_factors(b, o.get("grad_factors", 0))
    statements(o, b)
    return b.build()


def freeze_test_kwargs(spec) -> None:
    """``rich_kwargs`` and ``fidelity_kwargs`` read-only, so that a test that edits the kwargs it
    was given cannot change what the next test reads."""
    for name in ("rich_kwargs", "fidelity_kwargs"):
        object.__setattr__(spec, name, MappingProxyType(dict(getattr(spec, name))))


def built_once(spec, options: dict, build):
    """``build(Options(options))``, once per set of options (``spec._cache`` under
    ``spec._lock``): programs key every compile cache, and a step asks for them every time."""
    key = tuple(sorted(options.items()))
    hit = spec._cache.get(key)
    if hit is None:
        with spec._lock:
            hit = spec._cache.get(key)
            if hit is None:
                hit = spec._cache[key] = build(Options(dict(options)))
    return hit


GRAD_FACTOR = "grad_factor_"  # the scalars of ``gradient_factors``: grad_factor_0, 1 ...


def factors_of(scalars) -> list:
    """The values of a step's gradient factors (``gradient_factors``), in order."""
    out = []
    while f"{GRAD_FACTOR}{len(out)}" in scalars:
        out.append(scalars[f"{GRAD_FACTOR}{len(out)}"])
    return out


def is_factor_product(st) -> bool:
    """Whether statement ``st`` is one of ``gradient_factors``' products. A program stored widened
    (``ir.Program.storage``) on a bfloat16 or float16 parameter's own gradient rounds each to the
    gradient's dtype: torch's unscale and clip multiply ``p.grad`` in place, in its dtype."""
    e = st.expr
    return (
        isinstance(st, Let)
        and isinstance(e, Bin)
        and e.op == "*"
        and isinstance(e.b, Scalar)
        and e.b.name.startswith(GRAD_FACTOR)
    )


def gradient_factors(b: ProgramBuilder, count: int) -> None:
    """The option ``grad_factors``: the gradient the update reads is ``grad`` multiplied by
    ``count`` per-step scalars ``grad_factor_0, 1 ...`` in turn, each product rounded to float32.
    That is what torch's loss scaling (``GradScaler``'s unscale: ``grad * (1 / scale)``) and
    clipping (``clip_grad_norm_``: ``grad * clip_coef``) do to ``p.grad`` in place before a
    step, in the order they ran; here they are folded into the step's own pass."""
    grad = b.tensor("grad")
    for i in range(count):
        grad = b.let("grad", grad * getattr(b.s, f"grad_factor_{i}"))
    if count:
        b.alias("grad", grad)


# Helpers shared by the specs' state initialisers and scalar functions: the same calls torch
# makes, imported from torch itself where torch has them.
def zero_step() -> torch.Tensor:
    """The ``step`` entry torch creates: a 0-d tensor of the scalar dtype (float32)."""
    return torch.tensor(0.0, dtype=_get_scalar_dtype())


def zeros_like(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _kept(x):
    return x


# torch >= 2.8 squeezes a one-element tensor hyperparameter (``_to_scalar``); before, its
# for-loops use the tensor as given, and so do the specs.
to_scalar = getattr(_torch_optimizer, "_to_scalar", _kept)


def value(x) -> float:
    """A 0-d state entry's value (torch's ``_get_value``; a ``Scratch``'s own)."""
    return x.value if type(x) is Scratch else _get_value(x)


def set_value(t, v: float) -> None:
    """torch's ``t.copy_(torch.as_tensor(v))`` on a 0-d state entry (ASGD's ``eta``, ``mu``)."""
    if type(t) is Scratch:
        t.set(v)
    else:
        t.copy_(torch.as_tensor(v))


def advance_step(state) -> float:
    """torch's ``step_t += 1`` on the 0-d ``state["step"]`` (in place), then its value."""
    step_t = state["step"]
    step_t += 1
    if type(step_t) is Scratch:
        return step_t.value
    return value(step_t)


class Scratch:
    """A float 0-d state entry (``step``, ASGD's ``eta`` and ``mu``, NAdam's ``mu_product``)
    while a step computes its scalars: its value as a Python float, rounded to the entry's dtype
    after an update exactly as torch's in-place op on the 0-d tensor rounds. The step plan gives
    these to ``scalars`` in place of clones of the tensors, whose few tensor ops a step of one
    small parameter would pay every time (docs/benchmarks.md). What a spec may do with one:
    ``+=`` a number (float32: the double sum, rounded once, is the float32 sum of the float32
    operands, torch's), ``*=`` a Python float (torch casts the scalar to float32 first, then
    multiplies in float32: the double product of two float32 values is exact, rounded once),
    ``set_value`` (``copy_(torch.as_tensor(v))``: rounded to the default dtype, then to the
    entry's) and ``value``."""

    __slots__ = ("value", "dtype")

    def __init__(self, value: float, dtype):
        self.value = value
        self.dtype = dtype

    def __iadd__(self, other):
        v = self.value + other
        if self.dtype is int:  # a counter kept as a Python int (bitsandbytes' step)
            self.value = int(v)
        else:
            self.value = float(np.float32(v)) if self.dtype is torch.float32 else float(v)
        return self

    def __imul__(self, other: float):
        if self.dtype is torch.float32:
            self.value = float(np.float32(self.value * float(np.float32(other))))
        else:
            self.value = float(self.value * other)
        return self

    def set(self, v: float) -> None:
        if torch.get_default_dtype() is torch.float32:
            v = float(np.float32(v))
        self.value = float(np.float32(v)) if self.dtype is torch.float32 else float(v)

    def __repr__(self):
        return f"Scratch({self.value!r}, {self.dtype})"
