"""How a step computes and stores its tensors: ``StepMode``, carried by every program
(``ir.Program.storage``), and the one place engines ask what it means (``param_rounding``)."""

from __future__ import annotations

import enum


class StepMode(str, enum.Enum):
    """How a program computes and stores its tensors (``Program.storage``), the one enumeration
    every engine dispatches on (``param_rounding``). ``fused=True`` is not a mode: its arithmetic
    is the spec's (its options), and it steps 16-bit parameters WIDENED (``storage.FUSED``).

    * TORCH: torch's own ops on each tensor's dtype (the for-loop; a 16-bit tensor's ops round
      one by one, as ``backends.low_precision`` measures them);
    * WIDENED: every tensor read widened to float32, every op computed in float32 (torch's
      float32 step), every target stored rounded to its tensor's dtype, nearest even;
    * STOCHASTIC: so, with the parameter (bfloat16) rounded stochastically from the random bits
      of this step's key (the scalars STOCHASTIC_SCALARS), the parameter's id and the element's
      index (``roundpipe.optim.storage``)."""

    TORCH = ""
    WIDENED = "widened"
    STOCHASTIC = "stochastic"


def param_rounding(mode) -> str:
    """How a program in ``mode`` stores its parameter: ``"own"`` (TORCH: its ops' own rounding),
    ``"nearest"`` or ``"stochastic"``. Every engine asks here; a mode none knows raises."""
    if mode == StepMode.TORCH:
        return "own"
    if mode == StepMode.WIDENED:
        return "nearest"
    if mode == StepMode.STOCHASTIC:
        return "stochastic"
    raise ValueError(f"unknown step mode {mode!r} (spec.modes.StepMode)")


STOCHASTIC_SCALARS = ("sr_hi", "sr_lo")  # the step's 32-bit key, as two exact 16-bit halves
