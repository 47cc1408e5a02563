"""How torch's CPU kernels round bfloat16 and float16 ops, for the engines that reproduce them
(docs/low-precision.md has the measurements).

On a bfloat16 or float16 tensor every op of torch's for-loop computes in float32 (its "opmath"
type) and rounds its result to the tensor's dtype once. Three things differ from float32:

* the Python scalars: ``add``'s alpha and the scalar of ``tensor + s``, ``tensor - s``,
  ``s - tensor`` and of a comparison are rounded to the dtype first; those of ``*``, ``/``,
  ``addcmul``, ``addcdiv`` and ``lerp`` are not (formulas.py);
* which functions round ``a * b + c`` once (``fused``), and how: measured here per dtype;
* the *tail*: ATen's vectorized loop (``cpu_kernel_vec``) runs its vector body over runs of
  ``2 * Vectorized<T>::size()`` elements (``step``: 32 with AVX2, 64 with AVX-512) and the
  rest of each loop, its last ``n % step`` elements, through the op's scalar lambda, which for
  ``add`` with an alpha computes ``a + round(alpha * b)`` (two roundings) where the body takes
  one ``fma``. A loop is one chunk of a tensor: a tensor of more than ``GRAIN_SIZE`` elements
  is split into ``torch.get_num_threads()`` chunks (``at::parallel_for``), each with a tail of
  its own (``tail_spans``). torch's own result on a large bfloat16 tensor therefore depends on
  its thread count; roundpipe reproduces it for the thread count torch has when it steps.

``rounding(dtype)`` measures, once per process and dtype, the formulas of the body and of the
tail of ``add``, ``addcmul`` and ``lerp`` and the ``step``, on inputs where the candidate
formulas differ, and says whether they match a known one (``exact``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

# at::internal::GRAIN_SIZE: at most this many elements an op runs on one thread
GRAIN_SIZE = 32768
LOW_PRECISION = (torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def torch_chunks(numel: int, nthreads: int) -> list:
    """The ``(begin, end)`` chunks torch's elementwise op runs a contiguous tensor of ``numel``
    elements in, on ``nthreads`` intra-op threads (``TensorIteratorBase::for_each``, then
    ``at::parallel_for``/``invoke_parallel``: ``min(nthreads, ceil(numel / GRAIN_SIZE))``
    chunks of ``ceil(numel / chunks)`` elements, the last one shorter)."""
    if numel <= GRAIN_SIZE or nthreads <= 1:
        return [(0, numel)] if numel else []
    chunks = min(nthreads, -(-numel // GRAIN_SIZE))
    size = -(-numel // chunks)
    return [(lo, min(numel, lo + size)) for lo in range(0, numel, size)]


def tail_spans(numel: int, nthreads: int, step: int) -> list:
    """The ``(lo, hi)`` spans of a tensor that torch's vectorized loops run through their
    scalar lambda: each chunk's last ``len % step`` elements."""
    spans = []
    for lo, hi in torch_chunks(numel, nthreads):
        start = hi - (hi - lo) % step
        if start < hi:
            spans.append((start, hi))
    return spans


# the candidate formulas of each function, in float32 (numpy), ``r`` rounding to the dtype:
# "fma": ``a * b + c`` rounded once; "plain": rounded after the multiply too; "rounded": add's
# product rounded to the dtype (the scalar lambda's BFloat16/Half arithmetic)
FUNCTIONS = ("add", "addcmul", "lerp")


@dataclass(frozen=True)
class Rounding:
    """How torch rounds ``add`` (with an alpha), ``addcmul`` and ``lerp`` on one dtype: the
    formula of each in the vectorized body and in the tail (``kinds[fn] = (body, tail)``), the
    loop's ``step``, and whether every measurement matched a formula (``exact``)."""

    dtype: torch.dtype
    kinds: tuple  # ((fn, (body, tail)), ...): hashable, a key of the compiled kernels
    step: int
    exact: bool
    what: str

    @property
    def name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def kind(self, fn: str, tail: bool = False) -> str:
        """``fn``'s formula in the body, or in the tail."""
        return dict(self.kinds)[fn][1 if tail else 0]

    @property
    def fused(self) -> frozenset:
        """The functions whose body rounds a multiply-add once."""
        return frozenset(fn for fn, (body, _) in self.kinds if body == "fma")


_lock = threading.Lock()
_measured: dict = {}


def rounding(dtype) -> Rounding:
    """This torch's ``Rounding`` of ``dtype`` (bfloat16 or float16), measured once."""
    hit = _measured.get(dtype)
    if hit is None:
        with _lock:
            hit = _measured.get(dtype)
            if hit is None:
                hit = _measured[dtype] = _measure(dtype)
    return hit


_F32 = np.float32


def _round_to(x: np.ndarray, dtype) -> np.ndarray:
    """float32 values rounded to ``dtype`` (torch's conversion), as float32."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=_F32)).to(dtype).float().numpy()


def _fma(x, y, z):
    f64 = np.float64
    return (np.asarray(x, f64) * np.asarray(y, f64) + np.asarray(z, f64)).astype(_F32)


def _candidates(fn, a, b, c, s, dtype):
    """Each formula's float32 result (before the final rounding) of ``fn`` on ``a, b, c``."""
    if fn == "add":
        alpha = _round_to(np.array([s]), dtype)[0]
        return {"fma": _fma(alpha, b, a), "rounded": a + _round_to(alpha * b, dtype)}
    if fn == "addcmul":
        return {"fma": _fma(s * b, c, a), "plain": a + (s * b) * c}
    if fn == "lerp":  # |weight| < 0.5
        return {"fma": _fma(s, b - a, a), "plain": a + s * (b - a)}
    comp = s - _F32(1)  # lerp_big: the other branch (its zeros' signs are not probed)
    return {"fma": _fma(comp, b - a, b), "plain": comp * (b - a) + b}


def _call(fn, a, b, c, s):
    if fn == "add":
        return torch.add(a, b, alpha=float(s))
    if fn == "addcmul":
        return torch.addcmul(a, b, c, value=float(s))
    return torch.lerp(a, b, float(s))


_WEIGHTS = {"add": 0.3, "addcmul": 0.3, "lerp": 0.3, "lerp_big": 0.7}


def _discriminating(fn, dtype, count=4096):
    """Inputs (of ``dtype``, as float32 arrays) on which ``fn``'s candidate formulas differ
    after rounding: ``(a, b, c, s, {kind: rounded result})``."""
    gen = np.random.default_rng(0)
    s = _F32(_WEIGHTS[fn])
    picked = []
    for _ in range(64):
        a, b, c = (_round_to(gen.standard_normal(1 << 15).astype(_F32), dtype) for _ in range(3))
        outs = {k: _round_to(v, dtype) for k, v in _candidates(fn, a, b, c, s, dtype).items()}
        first, second = outs.values()
        keep = first != second
        picked.append((a[keep], b[keep], c[keep], {k: v[keep] for k, v in outs.items()}))
        if sum(len(p[0]) for p in picked) >= count:
            break
    a, b, c = (np.concatenate([p[i] for p in picked])[:count] for i in range(3))
    outs = {k: np.concatenate([p[3][k] for p in picked])[:count] for k in picked[0][3]}
    return a, b, c, s, outs


def _kind(got, outs):
    """The formula ``got`` equals on every element, or None."""
    for kind, want in outs.items():
        if np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            return kind
    return None


def _measure(dtype) -> Rounding:
    kinds, step, exact, notes = {}, 1, True, []
    with torch.inference_mode():
        for fn in (*FUNCTIONS, "lerp_big"):
            a, b, c, s, outs = _discriminating(fn, dtype)
            n = len(a) - len(a) % 128  # a body only: no tail at any step up to 128
            t = [torch.from_numpy(x).to(dtype) for x in (a, b, c)]
            got = _call(fn, t[0][:n], t[1][:n], t[2][:n], s).float().numpy()
            body = _kind(got, {k: v[:n] for k, v in outs.items()})
            # tails only: loops of 7 elements
            got = torch.cat([_call(fn, *(x[i : i + 7] for x in t), s) for i in range(0, 1022, 7)])
            got = got.float().numpy()
            tail = _kind(got, {k: v[: len(got)] for k, v in outs.items()})
            if body is None or tail is None:
                exact = False
                notes.append(f"{fn}: no known formula (body {body}, tail {tail})")
                body, tail = body or "fma", tail or body or "fma"
            if fn == "lerp_big":
                if (body, tail) != kinds["lerp"]:
                    exact = False
                    notes.append(f"lerp: its branches round otherwise ({kinds['lerp']}, {(body, tail)})")
                continue
            kinds[fn] = (body, tail)
            if fn == "add" and body != tail:
                step = _tail_step(t, s, outs, tail)
                if step is None:
                    exact, step = False, 32
                    notes.append("add: no vector step in (16, 32, 64, 128) places its tails")
    what = ", ".join(f"{fn} {b}/{t}" for fn, (b, t) in kinds.items()) + f" (body/tail), step {step}"
    if notes:
        what += "; " + "; ".join(notes)
    return Rounding(dtype, tuple(kinds.items()), step, exact, what)


def _tail_step(t, s, outs, tail_kind):
    """The loop's step: the one of (16, 32, 64, 128) that places ``add``'s tails where a loop of
    1,087 and one of 777 elements has them (the first tells them apart, the second checks)."""
    fits = {16, 32, 64, 128}
    for n in (1087, 777):
        got = torch.add(t[0][:n], t[1][:n], alpha=float(s)).float().numpy()
        in_tail = got.view(np.uint32) == outs[tail_kind][:n].view(np.uint32)
        fits &= {v for v in fits if in_tail[n - n % v :].all() and not in_tail[: n - n % v].any()}
    return fits.pop() if len(fits) == 1 else None
