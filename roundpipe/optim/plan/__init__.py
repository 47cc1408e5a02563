"""The step plan: everything a step needs, built once and checked cheaply at every step.

A plan records, for each param group, the parameters that have a gradient, their state dicts
and state tensors, the real float32 local tensors the backends step (``view_as_real`` of complex
tensors, the local shard of a ``DTensor``), and *units*: parameters whose 0-d state (``step``,
...) and init flags are equal, so the spec's ``scalars`` runs once per unit, not per parameter.

Per step, ``StepPlan.check`` verifies only what can change between steps, with a few list
comprehensions and no per-tensor Python calls beyond attribute reads:

* the param groups, their ``params`` lists, ``optimizer.state`` and its dicts are the same
  objects (``add_param_group`` and ``load_state_dict`` replace them), the options the groups'
  hyperparameters select are the same;
* the same parameters have gradients, and the parameters' storage is where it was (a ``.data``
  swap moves it); each state tensor the step reads is the same object;
* every gradient is well formed (the contract: dense, contiguous, CPU, dtype and shape of its
  parameter).

Anything else makes ``check`` answer None, and the step rebuilds the plan (the slow path, which
validates everything, creates missing state and says exactly what is wrong). A failed check
never leaves anything modified.

The modules, from the floor up (docs/step-plan.md has the design and the measurements):

* ``checks.py``: the contract, one check per kind of tensor, and the checks across tensors
  (duplicates, overlapping parameters, partners overlapping what the step reads);
* ``units.py``: ``Unit`` and the bucketing of a group's parameters into units;
* ``groups.py``: ``GroupPlan``, one param group's plan and its per-step gradient check;
* ``state.py``: the state a plan reads, created, adopted into flat buffers, stored in the
  optimizer's state dtype, rolled back;
* ``step_plan.py``: ``StepPlan`` and ``build``;
* ``staged.py``: a step of a staged spec (Adafactor, Muon: ``spec/staged.py``), its passes
  and the Python between them, with the same all-or-nothing contract;
* ``launches.py``: a step on the plan (``run_step``): the units' scalars, one launch per
  program prepared by the backend before anything is written, and the replay of the last
  step's launches.
"""

from .launches import run_step
from .staged import run_staged_step
from .state import adopt_flat_state, adopt_init_state, rollback, store_state
from .step_plan import StepPlan, build

__all__ = [
    "StepPlan",
    "adopt_flat_state",
    "adopt_init_state",
    "build",
    "rollback",
    "run_staged_step",
    "run_step",
    "store_state",
]
