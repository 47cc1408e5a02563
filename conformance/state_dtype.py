"""The stored cases: ``state_dtype`` and ``stochastic_rounding`` (``roundpipe.optim.storage``)
against the composition that defines them, written with torch.optim.

A parameter whose state dtype differs from its dtype, or that is rounded stochastically, is
stepped *widened*: before a step its state holds values of the state dtype; they and the
parameter are widened to float32, torch's for-loop (``foreach=False``) steps them in float32,
then the state is rounded to the state dtype (nearest even) and the parameter to its dtype
(nearest even, or ``storage.stochastic_round`` with the optimizer's seed, its step count and
the parameter's position). ``compose`` runs that with torch.optim; roundpipe must equal it bit
for bit, parameters and state, on every backend that claims torch's for-loop.

The tables, each case 10 steps of ``PARAMS`` (fp32 parameters: an odd 2-D shape, 1 element,
0-d, empty, gradients None every third step, subnormal gradients on odd steps, gradients whose
squares overflow float32, 70,001 elements with every 7th gradient zero) or ``BF16_PARAMS`` (the
same in bfloat16):

* ``BF16_STATE``: fp32 parameters, bfloat16 state, every optimizer on each option value of its
  16-bit cases at least once (``low_precision._covering``, not pairwise: what a stored step can
  get wrong, its loads and stores, does not depend on which options meet) and its last tensor
  hyperparameter case; fast:torch (``TORCH_ENGINE``) its first two per optimizer;
* ``STOCHASTIC``: bfloat16 parameters rounded stochastically, state bfloat16, every optimizer's
  first case;
* ``OTHER``: a few of float16 state (fp32 parameters) and of float32 state (bfloat16
  parameters, stochastic or not).

RAdam with a tensor ``beta2`` is left out, as in ``low_precision.py``
(``deviations.RADAM_TENSOR_BETA2``: every backend's float32 step is an ulp off there).
"""

from __future__ import annotations

import dataclasses

import torch

from .cases import CASES_BY_OPTIMIZER, Case
from .harness import ParamSpec
from .low_precision import CASES as LOW_PRECISION_CASES
from .low_precision import _covering, _has_tensor, _plain

STEPS = 10
BACKENDS = ("reference", "fast:numba", "fast:torch")


def _params(dtype):
    name = str(dtype).removeprefix("torch.")
    return (
        ParamSpec(f"3x5 {name}", (3, 5), dtype),
        ParamSpec(f"1 element {name}", (1,), dtype),
        ParamSpec(f"0-d {name}", (), dtype),
        ParamSpec(f"empty (0,) {name}", (0,), dtype),
        ParamSpec(f"33x65 {name}", (33, 65), dtype),
        ParamSpec(f"2x3x4 grad*1e-3 {name}", (2, 3, 4), dtype, scale=1e-3),
        ParamSpec(f"7x11 grad None every 3rd step {name}", (7, 11), dtype, none_every=3),
        # subnormal in float32 and bfloat16 alike (below 2**-126)
        ParamSpec(
            f"1023 subnormal grads on odd steps {name}", (1023,), dtype, tiny_on_odd_steps=True, tiny=2e-39
        ),
        ParamSpec(f"257 grad*1e20 {name}", (257,), dtype, scale=1e20),
        ParamSpec(f"70001 with zero grads {name}", (70001,), dtype, zero_every=7),
    )


PARAMS = _params(torch.float32)
BF16_PARAMS = _params(torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class StoredCase(Case):
    """A case of ``cases.py`` with ``state_dtype`` and ``stochastic_rounding`` on ``params``."""

    steps: int = STEPS
    state_dtype: torch.dtype | None = torch.bfloat16
    stochastic: bool = False
    params: tuple = PARAMS

    def __post_init__(self):
        super().__post_init__()
        stored = "" if self.state_dtype is None else f"-state_{str(self.state_dtype).removeprefix('torch.')}"
        params = str(self.params[0].dtype).removeprefix("torch.")
        object.__setattr__(self, "id", f"{self.id}{stored}{'-sr' if self.stochastic else ''}-{params}")

    def storage_kwargs(self) -> dict:
        return {"state_dtype": self.state_dtype, "stochastic_rounding": self.stochastic}


def _tables():
    bf16_state, torch_engine, stochastic = [], [], []
    low = {}
    for c in LOW_PRECISION_CASES:
        low.setdefault(c.optimizer, []).append(c)
    for name, cases in CASES_BY_OPTIMIZER.items():
        picked = [c for c in low[name] if _plain(c.kwargs)]
        tensors = [c for c in cases if not _plain(c.kwargs)]
        if name == "RAdam":  # deviations.RADAM_TENSOR_BETA2
            tensors = [c for c in tensors if not _has_tensor(c.kwargs.get("betas", ()))]
        once = _covering(name, picked, pairwise=False) + tensors[-1:]
        bf16_state += [StoredCase(c.optimizer, c.kwargs, c.expect) for c in once]
        torch_engine += [StoredCase(c.optimizer, c.kwargs, c.expect) for c in once[:2]]
        first = once[0]
        stochastic.append(
            StoredCase(first.optimizer, first.kwargs, state_dtype=None, stochastic=True, params=BF16_PARAMS)
        )
    return bf16_state, torch_engine, stochastic


def _other():
    def case(name, kwargs, **storage):
        return StoredCase(name, kwargs, **storage)

    f16, f32, bf16 = torch.float16, torch.float32, BF16_PARAMS
    return [
        case("AdamW", {"weight_decay": 0.1}, state_dtype=f16),
        case("SGD", {"momentum": 0.9, "nesterov": True}, state_dtype=f16),
        case("Adagrad", {"initial_accumulator_value": 0.1}, state_dtype=f16),
        case("Rprop", {}, state_dtype=f16),
        case("AdamW", {"amsgrad": True}, state_dtype=f32, params=bf16),
        case("SGD", {"momentum": 0.9}, state_dtype=f32, params=bf16),
        case("Rprop", {}, state_dtype=f32, params=bf16),
        case("AdamW", {}, state_dtype=f32, stochastic=True, params=bf16),
        case("Adam", {"amsgrad": True}, state_dtype=torch.bfloat16, stochastic=True, params=bf16),
    ]


BF16_STATE, TORCH_ENGINE, STOCHASTIC = _tables()
OTHER = _other()
CASES = (*BF16_STATE, *STOCHASTIC, *OTHER)
