"""Variants of a program that the plan makes for a step: stored otherwise than torch's own ops
(``stored``: ``modes.StepMode``), or with a fused kernel's scalar remainder placed
(``with_remainder``) or resolved away for engines that cut tensors there (``resolved``)."""

from __future__ import annotations

import dataclasses
import functools

from .ir import Bin, Call, Program, walk
from .modes import STOCHASTIC_SCALARS, StepMode


@functools.lru_cache(maxsize=1024)
def stored(program: Program, storage: StepMode) -> Program:
    """``program`` with ``storage`` (WIDENED or STOCHASTIC): the same statements, another
    program (its kernels and launches are its own)."""
    if storage not in (StepMode.WIDENED, StepMode.STOCHASTIC) or program.storage:
        raise ValueError(f"storage {storage!r} of a program stored as {program.storage!r}")
    scalars = program.scalars + (STOCHASTIC_SCALARS if storage == StepMode.STOCHASTIC else ())
    return dataclasses.replace(program, scalars=scalars, storage=storage)


@functools.lru_cache(maxsize=1024)
def has_remainder(program: Program) -> bool:
    """Whether ``program`` computes otherwise in a fused kernel's scalar remainder."""
    return any(
        isinstance(n, Call) and n.fn == "remainder" for st in program.statements for n in walk(st.expr)
    )


@functools.lru_cache(maxsize=1024)
def with_remainder(program: Program, step: int) -> Program:
    """``program`` whose ``remainder`` calls take their tail in each tensor's last ``numel %
    step`` elements (``fused_kernels.remainder_step``)."""
    return dataclasses.replace(program, remainder_step=step)


@functools.lru_cache(maxsize=1024)
def resolved(program: Program, tail: bool) -> Program:
    """``program`` with each ``remainder`` call replaced by its body (or its ``tail``): what it
    computes before each tensor's remainder (or in it), for engines that cut tensors there."""

    def one(e):
        if isinstance(e, Bin):
            return Bin(e.op, one(e.a), one(e.b))
        if isinstance(e, Call):
            if e.fn == "remainder":
                return one(e.args[1 if tail else 0])
            return Call(e.fn, tuple(one(a) for a in e.args))
        return e

    statements = tuple(dataclasses.replace(st, expr=one(st.expr)) for st in program.statements)
    return dataclasses.replace(program, statements=statements, remainder_step=0)
