"""How an optimizer stores its state and its parameters: the ``state_dtype`` and
``stochastic_rounding`` keywords (``Storage``), and the random bits of stochastic rounding.

By default (``Storage()``) a parameter's state is of its dtype and each op of a step rounds to
that dtype, as torch's for-loop does (float32, or bfloat16 and float16: docs/low-precision.md).
With a ``state_dtype`` other than the parameter's, or with stochastic rounding, a parameter's
step is *widened*: its parameter, gradient and state tensors are read widened to float32, the
step is torch's float32 for-loop, the state is stored rounded to its dtype (nearest even) and
the parameter rounded to its own (nearest even; stochastically with ``stochastic_rounding``,
bfloat16 only). The 0-d state (``step`` ...) stays as torch keeps it.

Stochastic rounding adds 16 random bits to the float32 pattern and truncates the low 16 bits
(unbiased); a NaN stays a NaN (its sign and high payload, quieted), an infinity an infinity.
The bits are a counter-based function of (seed, step count, parameter id, element index),
``lowbias32`` (C. Wellons' 32-bit integer hash) over a combination of the four, the same on
every engine, thread count and split of the elements into work items:

* ``key = step_key(seed, steps)``: the optimizer's seed (drawn from torch's default generator
  when it is constructed, kept in ``state_dict``) and the number of steps it has taken with
  stochastic rounding;
* ``pkey = param_key(key, pid)``: ``pid`` the parameter's position in the optimizer
  (``state_dict``'s numbering: its groups' parameters in order);
* the element at flat index ``i``: ``r = mix32(mix32((i mod 2**32) ^ pkey))``, its top 16 bits.

``stochastic_round_`` writes it in torch's int32 ops (the reference backend and the torch
engine); the numba engine has it as an intrinsic (``numba_engine/conversions.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tensors import LOW_PRECISION

# the state dtypes offered: a 16-bit one stores the moments at 2 bytes an element
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STOCHASTIC_DTYPES = (torch.bfloat16,)
SR_KEY = "stochastic_rounding"  # state_dict's entry: {"seed": int, "steps": int}
M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers


@dataclass(frozen=True)
class Storage:
    """An optimizer's ``state_dtype`` (None: each parameter's own) and ``stochastic_rounding``."""

    state_dtype: torch.dtype | None = None
    stochastic: bool = False
    # a param group with ``fused=True`` (torch's fused kernel: float32 math on the widened
    # tensors, each stored tensor rounded once to its own dtype); not an optimizer's keyword
    fused: bool = False

    def state_dtype_of(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the state tensors of a parameter of ``dtype``."""
        return dtype if self.state_dtype is None else self.state_dtype

    def widened(self, dtype: torch.dtype) -> bool:
        """Whether a parameter of ``dtype`` is stepped widened (see the module docstring)."""
        if self.fused:
            return dtype in LOW_PRECISION
        return self.stochastic or (self.state_dtype is not None and self.state_dtype is not dtype)

    def problem(self, dtype: torch.dtype) -> str | None:
        """Why a parameter of ``dtype`` cannot be stepped with these settings, or None."""
        if self.stochastic and dtype not in STOCHASTIC_DTYPES:
            return (
                f"stochastic_rounding=True rounds bfloat16 parameters; this one is {dtype} "
                "(float32 parameters need no rounding; float16 ones are not offered)"
            )
        if self.state_dtype is not None and dtype is torch.complex64 and self.state_dtype is not dtype:
            return f"state_dtype={self.state_dtype} is for real parameters; this one is complex64"
        return None


DEFAULT = Storage()
FUSED = Storage(fused=True)


def fused_refusal(cls_name: str) -> str:
    """Why ``fused=True`` does not take ``state_dtype=`` or ``stochastic_rounding=``."""
    return (
        f"roundpipe.optim.{cls_name}: fused=True steps as torch's fused kernel does, each tensor in "
        "its own dtype; state_dtype= and stochastic_rounding= are for the for-loop's step (fused=None)"
    )


def check_keywords(cls_name: str, state_dtype, stochastic_rounding) -> Storage:
    """The ``Storage`` of the keywords, or the error a user should see (before anything moves)."""
    if state_dtype is not None and not isinstance(state_dtype, torch.dtype):
        raise TypeError(
            f"roundpipe.optim.{cls_name}: state_dtype must be a torch.dtype or None, got {state_dtype!r}"
        )
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        offered = ", ".join(str(d) for d in STATE_DTYPES)
        raise TypeError(
            f"roundpipe.optim.{cls_name}: state_dtype={state_dtype} is not offered; the state dtypes "
            f"are {offered} (None: each parameter's own, as torch)"
        )
    if type(stochastic_rounding) is not bool:
        raise TypeError(
            f"roundpipe.optim.{cls_name}: stochastic_rounding must be True or False: {stochastic_rounding!r}"
        )
    return Storage(state_dtype, stochastic_rounding)


def draw_seed() -> int:
    """A seed for the stream of random bits, from torch's default generator (63 bits)."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


# ----------------------------------------------------------------------------------------------
# the random bits


def mix32(x: int) -> int:
    """lowbias32: a 32-bit integer hash (a bijection of [0, 2**32))."""
    x &= M32
    x ^= x >> 16
    x = (x * _C1) & M32
    x ^= x >> 15
    x = (x * _C2) & M32
    x ^= x >> 16
    return x


def step_key(seed: int, steps: int) -> int:
    """The 32-bit key of the ``steps``-th stochastically rounded step of a seed's stream."""
    k = mix32(mix32(seed & M32) ^ ((seed >> 32) & M32))
    return mix32(mix32(k ^ (steps & M32)) ^ ((steps >> 32) & M32))


def step_scalars(seed: int, steps: int) -> dict:
    """The step's key as the program scalars ``sr_hi``, ``sr_lo`` (16 bits each: exact in float32)."""
    k = step_key(seed, steps)
    return {"sr_hi": float(k >> 16), "sr_lo": float(k & 0xFFFF)}


def param_key(key: int, pid: int) -> int:
    """A parameter's key at a step of key ``key``."""
    return mix32(mix32(pid & M32) ^ key)


def element_bits(pkey: int, index: int) -> int:
    """The 16 random bits of element ``index`` (pure Python: what the engines must compute)."""
    return mix32(mix32((index & M32) ^ pkey)) >> 16


def _signed(x: int) -> int:
    """An int32 tensor's element of unsigned bits ``x``."""
    return x - (1 << 32) if x >= 1 << 31 else x


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int32 tensor (its ops wrap; shifts masked to be logical)."""
    x ^= (x >> 16) & 0xFFFF
    x *= _signed(_C1)
    x ^= (x >> 15) & 0x1FFFF
    x *= _signed(_C2)
    x ^= (x >> 16) & 0xFFFF
    return x


def random_bits(pkey: int, start: int, n: int) -> torch.Tensor:
    """The 16 random bits (int32) of elements ``start`` to ``start + n`` of a parameter."""
    index = (torch.arange(start, start + n, dtype=torch.int64) & M32).to(torch.int32)
    index ^= _signed(pkey)
    return (_mix32_(_mix32_(index)) >> 16) & 0xFFFF


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, pkey: int, start: int = 0) -> torch.Tensor:
    """``out`` (bfloat16) := float32 ``x`` rounded stochastically, its elements at flat indices
    ``start``... of their parameter (both contiguous, of one shape)."""
    u = x.detach().reshape(-1).view(torch.int32)
    r = random_bits(pkey, start, u.numel())
    rounded = ((u + r) >> 16) & 0xFFFF
    nan = ((u >> 16) & 0xFFFF) | 0x0040  # quieted, its sign and high payload kept
    bits = torch.where(x.detach().reshape(-1).isnan(), nan, rounded).to(torch.int16)
    out.view(-1).view(torch.int16).copy_(bits)
    return out


def stochastic_round(x: torch.Tensor, seed: int, steps: int, pid: int) -> torch.Tensor:
    """float32 ``x`` (a whole parameter) rounded stochastically to bfloat16 as the ``steps``-th
    step of ``seed``'s stream rounds parameter ``pid`` (for tests and compositions)."""
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    return stochastic_round_(out, x.contiguous(), param_key(step_key(seed, steps), pid))
