"""The low-precision cases: every optimizer of ``cases.py`` on bfloat16 and float16 parameters
(gradients of the same dtype), stepped directly, against ``torch.optim``'s for-loop on the same
parameters, bit for bit: parameters and state, which torch keeps in the parameter's dtype and
rounds after each of its ops (docs/low-precision.md).

One parameter set holds both dtypes and a float32 parameter, all in one param group (torch
steps a group of mixed dtypes parameter by parameter; roundpipe launches each dtype on its own).
Per dtype: an odd 2-D shape, a 1-element and a 0-d parameter, gradients that are None every
third step, subnormal gradients on odd steps, gradients whose squares overflow the dtype (to
inf in the moments), and 70,001 elements with every 7th gradient zero (its last 17 elements
are torch's scalar tail: ``docs/low-precision.md``).

The table is smaller than ``cases.py``'s, to keep CI's time (most of it the numba engine's
compiles: two dtypes a program): per optimizer its cases with float and boolean values, all of
them where they are at most ``FULL_GRID``, else a pairwise covering subset (every value of
every option meets every value of every other at least once, torch's defaults filled in:
``betas=(0, ...)``, a lerp of weight 1, included), plus its cases with tensor hyperparameters
(``lr``, ``betas``). RAdam with a tensor ``beta2`` is left out: a declared deviation
(``deviations.RADAM_TENSOR_BETA2``) of every backend, float32 as here. fast:torch runs a
smaller part (``TORCH_ENGINE_CASES``: every option value at least once, and one tensor case):
it runs torch's own ops, and what it can get wrong (its slots' dtype, its chunks against
torch's tails) does not depend on which options meet.
"""

from __future__ import annotations

import dataclasses

import torch

from . import deviations
from .cases import CASES_BY_OPTIMIZER, Case
from .harness import ParamSpec

STEPS = 10
DTYPES = (torch.bfloat16, torch.float16)
# the backends that step 16-bit parameters (fast:numexpr refuses them: tests/low_precision)
BACKENDS = ("reference", "fast:numba", "fast:torch")


def _per_dtype(dtype, tiny, large):
    name = str(dtype).removeprefix("torch.")
    return (
        ParamSpec(f"3x5 {name}", (3, 5), dtype),
        ParamSpec(f"1 element {name}", (1,), dtype),
        ParamSpec(f"0-d {name}", (), dtype),
        ParamSpec(f"33x65 {name}", (33, 65), dtype),
        ParamSpec(f"2x3x4 {name}", (2, 3, 4), dtype, scale=1e-3),
        ParamSpec(f"7x11 grad None every 3rd step {name}", (7, 11), dtype, none_every=3),
        ParamSpec(
            f"1023 subnormal grads on odd steps {name}", (1023,), dtype, tiny_on_odd_steps=True, tiny=tiny
        ),
        ParamSpec(f"257 grad*{large:g} {name}", (257,), dtype, scale=large),
        ParamSpec(f"70001 with zero grads {name}", (70001,), dtype, zero_every=7),
    )


PARAMS = (
    ParamSpec("3x5 float32", (3, 5)),
    ParamSpec("empty (0,) bfloat16", (0,), torch.bfloat16),
    ParamSpec("empty (3,0) float16", (3, 0), torch.float16),
    # subnormal: below 2**-126 (bfloat16), 2**-14 (float16); large: squares past the largest
    # bfloat16 (3.4e38) and float16 (65504)
    *_per_dtype(torch.bfloat16, 2e-39, 1e20),
    *_per_dtype(torch.float16, 2e-6, 300.0),
)


@dataclasses.dataclass(frozen=True)
class LowPrecisionCase(Case):
    """A case of ``cases.py`` on the low-precision parameter set, ``STEPS`` steps."""

    steps: int = STEPS
    nan_bits: bool = True  # a 16-bit tensor's NaNs compared by their bits too

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "id", self.id + "-16bit")

    @property
    def params(self):
        return PARAMS


FULL_GRID = 8


def _plain(kwargs) -> bool:
    """A case whose values are floats and bools (no tensor hyperparameter)."""
    return not any(isinstance(v, torch.Tensor) or _has_tensor(v) for v in kwargs.values())


def _has_tensor(v) -> bool:
    return isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v)


def _covering(name, cases, pairwise=True):
    """A subset of ``cases`` in which every value of every option the set varies meets every
    value of every other (``pairwise``; else appears at least once), torch's defaults filled
    in, chosen greedily."""
    defaults = deviations.torch_defaults(name)
    varied = sorted({k for c in cases for k in c.kwargs})
    wanted_of = []
    for c in cases:
        full = {**defaults, **c.kwargs}
        items = [(k, repr(full[k])) for k in varied]
        wanted_of.append({(a, b) for a in items for b in items} if pairwise else set(items))
    wanted = set().union(*wanted_of) if wanted_of else set()
    chosen, covered = [], set()
    while covered != wanted:
        best = max(range(len(cases)), key=lambda i: len(wanted_of[i] - covered))
        chosen.append(best)
        covered |= wanted_of[best]
    return [cases[i] for i in sorted(chosen)]


def _table():
    """``(cases, torch_engine_cases)``: the table, and the part of it fast:torch runs."""
    out, torch_engine = [], []
    for name, cases in CASES_BY_OPTIMIZER.items():
        plain = [c for c in cases if _plain(c.kwargs)]
        tensors = [c for c in cases if not _plain(c.kwargs)]
        if name == "RAdam":  # deviations.RADAM_TENSOR_BETA2
            tensors = [c for c in tensors if not _has_tensor(c.kwargs.get("betas", ()))]
        picked = plain if len(plain) <= FULL_GRID else _covering(name, plain)
        out += [LowPrecisionCase(c.optimizer, c.kwargs, c.expect) for c in picked + tensors]
        once = _covering(name, picked, pairwise=False) + tensors[-1:]
        torch_engine += [LowPrecisionCase(c.optimizer, c.kwargs, c.expect) for c in once]
    return out, torch_engine


CASES, TORCH_ENGINE_CASES = _table()


# Gradients past the dtype's largest value (inf in about 3% of elements): NaNs spread through
# the moments and the parameter, in the vector body and in the scalar tails, where torch's
# kernels store NaNs of other bits (``maximum``'s own: docs/low-precision.md)
NAN_PARAMS = (
    ParamSpec("70001 grad*3e4 (inf) float16", (70001,), torch.float16, scale=3e4),
    ParamSpec("70001 grad*1.5e38 (inf) bfloat16", (70001,), torch.bfloat16, scale=1.5e38),
)


@dataclasses.dataclass(frozen=True)
class NanCase(LowPrecisionCase):
    """A low-precision case on ``NAN_PARAMS``: NaNs compared by their bits."""

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "id", self.id + "-nan")

    @property
    def params(self):
        return NAN_PARAMS


NAN_CASES = (
    NanCase("Adam", {"amsgrad": True, "weight_decay": 0.1}),
    NanCase("AdamW", {"amsgrad": True}),
    NanCase("Adamax", {"weight_decay": 0.1}),
    NanCase("NAdam", {"weight_decay": 0.1}),
    NanCase("RMSprop", {"centered": True, "momentum": 0.9}),
)
