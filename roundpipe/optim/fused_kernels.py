"""torch's fused CPU kernels (``fused=True``): what a step plan needs to know of them beyond the
spec's arithmetic.

* The *remainder*: each kernel steps a parameter in vector loops and its last elements in a
  scalar loop, which the compiler contracts otherwise (the spec's ``in_remainder``: SGD's
  buffer and Adam's ``exp_avg_sq`` as ``fma(state, beta, the other product)``). The scalar loop
  takes the last ``numel % step`` elements, ``step`` a choice of the compiler that built torch
  (what it was where measured: docs/contract.md), so measured at first use (``remainder_step``)
  on torch's fused SGD, on inputs where the two contractions differ in every element.
* ``KNOWN_WRONG``: the 16-bit kernels of some torch releases, which roundpipe does not follow
  (it follows the release that fixed them, docs/contract.md).
"""

from __future__ import annotations

import functools
import threading

import torch

# torch's 16-bit fused kernels that are wrong before the release named
KNOWN_WRONG = {
    "SGD": (2, 14),  # pytorch#191763: its vector blocks unstepped, the buffer read as float32
    "Adagrad": (2, 14),  # clr, eps and weight_decay rounded to the parameter's dtype in the body
}
_CANDIDATES = (4, 8, 16, 32, 64)  # (127 % each differs: the remainder's length names its step)
_N = 127
_lock = threading.Lock()


def known_wrong(name: str, dtype: torch.dtype) -> bool:
    """Whether the installed torch's fused ``name`` kernel is wrong on ``dtype`` parameters."""
    fixed = KNOWN_WRONG.get(name)
    if dtype is torch.float32 or fixed is None:
        return False
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return release < fixed


def remainder_step(dtype: torch.dtype) -> int | None:
    """``step``: torch's fused kernels step the last ``numel % step`` elements of a ``dtype``
    parameter in their scalar remainder; None where the probe finds no such step (the
    remainder is then not modelled: a declared deviation)."""
    with _lock:
        return _remainder_step(dtype)


@functools.cache
def _remainder_step(dtype: torch.dtype) -> int | None:
    if known_wrong("SGD", dtype):
        # no right 16-bit kernel here to measure: the fixed release's take twice the float32
        # step (docs/contract.md)
        step = _remainder_step(torch.float32)
        return None if step is None else 2 * step
    return _measure(dtype)


def _measure(dtype: torch.dtype) -> int | None:
    """SGD with ``momentum = 1 + 2**-20``, two steps of gradients ``b`` and ``-b``: the buffer
    is ``b * m - b``, which the vector loops round after the product (``round(b * m) - b``) and
    the remainder does not (``fma(b, m, -b)``, ``b * 2**-20`` exactly); ``b`` has every
    mantissa bit set, so the two differ in every element."""
    bits = {torch.float32: 0x3FFFFFFF, torch.bfloat16: 0x3FFF, torch.float16: 0x3BFF}[dtype]
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    scale = 2.0**10 if dtype is torch.float16 else 1.0  # (b * 2**-20 stays a normal float16)
    b = torch.full((_N,), bits, dtype=ints).view(dtype) * scale
    b[1::2] = -b[1::2]
    p = torch.zeros(_N, dtype=dtype, requires_grad=True)
    m = 1.0 + 2.0**-20
    opt = torch.optim.SGD([p], lr=0.0, momentum=m, fused=True)
    for g in (b, -b):
        p.grad = g.clone()
        opt.step()
    got = opt.state[p]["momentum_buffer"].float()
    wide = b.float()
    vector = (wide * torch.tensor(m, dtype=torch.float32) - wide).to(dtype).float()
    scalar = (wide.double() * m - wide.double()).float().to(dtype).float()
    if torch.equal(vector, scalar):
        return None
    in_remainder = (got == scalar) & (got != vector)
    in_vector = (got == vector) & (got != scalar)
    if not bool((in_remainder | in_vector).all()):
        return None
    first = int(in_remainder.nonzero()[0]) if bool(in_remainder.any()) else _N
    if bool(in_vector[first:].any()):  # (not one span at the end)
        return None
    found = [s for s in _CANDIDATES if _N % s == _N - first]
    return found[0] if found else None
