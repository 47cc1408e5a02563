"""What a *staged* spec is: a step that one elementwise pass cannot take.

Adafactor reads a tensor's norms before it updates it (the update's size depends on the
parameter's norm, its direction on row and column statistics of the gradient, its length on the
norm of the update itself); Muon orthogonalises its momentum with torch's matmuls between two
elementwise parts. Such a step is a sequence of *stages*, run on every parameter of the step in
turn:

:class:`Pass`
    an elementwise program (``ir.py``) over the parameter's tensors, whose ``norm`` statements
    are its outputs. Every pass but the last only reads (it may write the scratch tensors a
    :class:`Between` made): nothing a user sees moves until every stage before the last has run.
    The last pass writes the parameter and its state, as the single pass of an elementwise spec
    does.
:class:`Between`
    Python between two passes, per parameter, with torch ops on small tensors (the row and
    column statistics), torch call-outs (Muon's Newton-Schulz) and scalars in double precision,
    written as torch writes them. It reads and extends the parameter's *context*, a dict of
    names: the parameter's tensors, its options, its step's scalars, the reductions of the
    passes so far and what earlier ``Between`` stages added; it never writes a tensor it did not
    create.

``commit`` (the spec's) names the state entries the step replaces with a value a ``Between``
computed (``row_var`` with its new value), copied in after the last pass.

The fields shared with :class:`~roundpipe.optim.spec.core.OptimizerSpec` mean the same; the
differences: ``options(group, p)`` is per parameter (Adafactor factors matrices only), joined by
``state_options(state)`` where the parameter's state decides (bitsandbytes' 8-bit optimizers:
8-bit or 32-bit state); ``state_names(o, p)`` lists the state tensors a parameter with options
``o`` keeps, each with its shape, or ``(shape, dtype)`` where it is not float32; ``int_state``
names the entries of ``scalar_state`` that are Python ints (bitsandbytes' ``step``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .core import Options, SpecBase, build_program, built_once
from .ir import Program

__all__ = ["StagedSpec", "Pass", "Between", "program"]


@dataclass(frozen=True)
class Pass:
    """An elementwise pass; ``program``'s reductions join the context under their names."""

    program: Program


@dataclass(frozen=True)
class Between:
    """``fn(ctx)``: Python and torch ops between passes (see the module docstring)."""

    fn: Callable


def program(o, inputs, statements, kinds=None) -> Program:
    """A pass's program: ``statements(o, b)`` over ``inputs``, with the gradient factors of the
    options (loss scaling and clipping), as an elementwise spec's (``core.build_program``)."""
    return build_program(o, inputs, statements, kinds)


@dataclass(frozen=True)
class StagedSpec(SpecBase):
    name: str
    torch_class: type
    init_state: Callable  # (group, p, state): torch's _init_group for one parameter
    options: Callable  # (group, p) -> dict of hashable values
    state_names: Callable  # (o) -> the state tensors a parameter keeps
    scalars: Callable  # (group, state) -> dict, as OptimizerSpec.scalars
    build_stages: Callable  # (o) -> tuple of Pass and Between, the last a Pass
    check_group: Callable = lambda group: None  # raises before anything moves
    scalar_state: tuple = ("step",)
    commit: tuple = ()  # (state entry, context name) copied in after the last pass
    state_options: Callable | None = None  # (state) -> dict joining options(group, p)
    int_state: tuple = ()  # scalar_state entries kept as Python ints

    def param_options(self, group, p, state) -> dict:
        """A parameter's options: ``options(group, p)`` and what its state decides."""
        o = self.options(group, p)
        return o if self.state_options is None else {**o, **self.state_options(state)}

    def stages(self, options: dict) -> tuple:
        """The stages for ``options``, built once (validated: a typo fails the tests)."""
        return built_once(self, options, self._build)

    def _build(self, o: Options) -> tuple:
        stages = tuple(self.build_stages(o))
        if not stages or not isinstance(stages[-1], Pass):
            raise ValueError(f"{self.name}: a staged step ends with a Pass")
        return stages
