"""The backend interface: what the step plan (``plan/``) asks of a backend, and what every
backend (``backends/``) implements. It sits below both, so neither imports the other.

A backend runs a spec program (``spec/ir.py``) in place on many parameters at once. The step
plan calls, per step: ``prepare`` for each launch (a program over the parameters that run it)
before anything is written, then each returned launch; on a step that repeats the last one
with new scalars and gradients, ``rebind`` instead (a *replay*). Required: ``name`` and
``prepare``. Optional capabilities have defaults here that decline (``None``, ``0``), so a
caller never probes for them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .spec.ir import Program

Launch = Callable[[], None]
"""Runs a prepared program; short of a crash it cannot fail."""

Scalars = dict[str, float] | list[tuple[dict[str, float], int]]
"""One dict of per-step scalars for every parameter of a launch, or ``(scalars, count)``
segments that cover the parameters in order (parameters whose 0-d state differs, e.g. another
``step``, get other scalars)."""

Columns = dict[str, Sequence["torch.Tensor"]]
"""Program tensor name -> one real, contiguous CPU tensor per parameter. ``"param"`` and the
state are float32; ``"grad"`` may be bfloat16 or float16 (a partner's gradient: read widened)
and ``"partner"`` holds bfloat16 or float16 tensors to write with each updated parameter, as
``partner.copy_(param)`` rounds (``masters.py``). Each column holds one dtype. A column of type
``Checked`` (``tensors.py``) has been validated by the step plan; the backend checks any other."""


class Backend(ABC):
    """A backend: see the module docstring."""

    name: str
    """As passed to ``backend=``."""

    flat_state_below: int = 0
    """The step plan creates the state of parameters with fewer elements than this in flat
    buffers (``plan/state.py``): a backend that batches small parameters then steps those
    buffers where they are. 0: no flat state."""

    @property
    def exact(self) -> bool:
        """Whether this backend's results are bit for bit torch.optim's for-loop."""
        return False

    def exact_for(self, dtype) -> bool:
        """``exact`` for parameters of ``dtype`` (float32, bfloat16, float16)."""
        return self.exact

    def check_settings(self) -> None:  # noqa: B027 (optional: a backend without settings)
        """Raise now, before a step modifies anything, if the settings this backend reads (its
        environment variables) are bad. Called when a plan is built; ``prepare`` and
        ``rebind`` check what they read themselves on every step."""

    @abstractmethod
    def prepare(self, program: Program, scalars: Scalars, columns: Columns, cache: dict) -> Launch:
        """Everything that can fail for running ``program`` in place on every parameter of
        ``columns``: checks, compilation, workspaces. Writes nothing a user can see; returns
        the launch. ``cache`` is this launch's own dict, kept by the step plan between steps
        for the same program and parameters (flat buffers, address tables) and dropped with
        the plan; never shared between threads."""

    def run(self, program: Program, scalars: Scalars, columns: Columns, cache: dict | None = None) -> None:
        """``prepare`` then launch (for tools and tests)."""
        self.prepare(program, scalars, columns, {} if cache is None else cache)()

    # -- optional capabilities -------------------------------------------------------------
    def replay_handle(self, program: Program, cache: dict) -> Any | None:
        """After ``prepare`` (or ``prepare_staged``) ran for ``cache``'s launch: what ``rebind``
        needs to repeat that launch with new scalars and gradients, or None (this backend does
        not replay)."""
        return None

    def rebind(
        self, handle: Any, scalars: dict[str, float] | list[dict[str, float]], grads: Sequence[torch.Tensor]
    ) -> Launch | None:
        """The launch of ``handle`` with this step's scalars (one dict; for a staged pass one per
        parameter, as ``prepare_staged`` takes them) and gradient column, everything else as it
        was; or None (the step plan then prepares it anew)."""
        return None

    def prepare_staged(
        self,
        program: Program,
        scalars: list[dict[str, float]],
        tensors: list[dict[str, torch.Tensor]],
        cache: dict | None = None,
    ) -> Callable[[], list[dict[str, Any]]]:
        """A pass of a staged step (``spec/staged.py``): ``program`` once per parameter, the i-th
        with ``scalars[i]`` and ``tensors[i]`` (float32 tensors in their shapes, broadcast inputs
        in theirs, scratch tensors of any dtype; ``"grad"`` may be a partner's bfloat16 or
        float16 gradient, read widened, as ``Columns``); everything that can fail done here. The launch
        returns each parameter's reductions (``norm`` statements) by name, as torch's
        ``torch.norm(..., keepdim=True)`` returns them (a whole-tensor norm may be a float).
        ``cache``: this pass's own dict, kept by the step plan between steps, as ``prepare``'s."""
        raise TypeError(f"backend {self.name!r} cannot run the passes of a staged optimizer step")

    def gradient_sums(self, grads: Sequence[torch.Tensor], order: float) -> np.ndarray | None:
        """Per gradient, the float64 sum a norm of ``order`` (1, 2 or inf) is taken from, in one
        read-only pass; None where this backend has no such pass (``amp.py`` then takes
        torch's norms)."""
        return None
