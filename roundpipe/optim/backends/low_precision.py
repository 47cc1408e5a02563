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

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

# at::internal::GRAIN_SIZE: at most this many elements an op runs on one thread
GRAIN_SIZE = 32768
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
FUNCTIONS = ("add", "addcmul", "lerp")  # (and "maximum": its choice between equal zeros)


@dataclass(frozen=True)
class Rounding:
    """How torch rounds ``add`` (with an alpha), ``addcmul`` and ``lerp`` on one dtype: the
    formula of each in the vectorized body and in the tail (``kinds[fn] = (body, tail)``;
    ``maximum``: its choice between opposite zeros; ``<op>_nan``: the NaN an op of ``NAN_OPS``
    stores, ``nan()``), the loop's ``step``, and whether every measurement matched a formula
    (``exact``)."""

    dtype: torch.dtype
    kinds: tuple  # ((fn, (body, tail)), ...): hashable, a key of the compiled kernels
    step: int
    exact: bool
    what: str

    @property
    def name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def kind(self, fn: str, tail: bool = False):
        """``fn``'s formula in the body, or in the tail."""
        return dict(self.kinds)[fn][1 if tail else 0]

    def nan(self, fn: str = "round") -> tuple:
        """``(body, tail)``: the NaN ``fn``'s result holds where it is NaN (``NAN_OPS``; the
        rounded ops' rule for any other): a 16-bit pattern (an int) whatever the operands', or
        ``"kept"``: the operand's sign and payload, quieted."""
        kinds = dict(self.kinds)
        return kinds.get(f"{fn}_nan", kinds["round_nan"])

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
    """float32 values rounded to ``dtype`` as torch rounds them (nearest even), as float32."""
    x = np.asarray(x, dtype=_F32)
    if dtype is torch.float16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(_F32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(_F32)
    return np.where(np.isnan(x), x, rounded)


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


def _discriminating(fn, dtype, count=512):
    """Inputs (of ``dtype``, as float32 arrays) on which ``fn``'s candidate formulas differ
    after rounding: ``(a, b, c, s, {kind: rounded result})``. (The fused and the plain
    ``lerp`` and ``addcmul`` differ in about one element in a thousand.)"""
    gen = np.random.default_rng(0)
    s = _F32(_WEIGHTS[fn])
    picked, found = [], 0
    for _ in range(8):
        a, b, c = (_round_to(gen.standard_normal(1 << 20, dtype=_F32), dtype) for _ in range(3))
        outs = {k: _round_to(v, dtype) for k, v in _candidates(fn, a, b, c, s, dtype).items()}
        first, second = outs.values()
        keep = first != second
        picked.append((a[keep], b[keep], c[keep], {k: v[keep] for k, v in outs.items()}))
        found += int(keep.sum())
        if found >= count:
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
    kinds, step, notes = {}, 1, []
    with torch.inference_mode():
        for fn in (*FUNCTIONS, "lerp_big"):
            body, tail, in_tail = _function_kinds(fn, dtype, notes)
            if fn == "lerp_big":
                if (body, tail) != kinds["lerp"]:
                    notes.append(f"lerp: its branches round otherwise ({kinds['lerp']}, {(body, tail)})")
                continue
            kinds[fn] = (body, tail)
            if fn == "add" and body != tail:
                step = _tail_step(in_tail)
        kinds["maximum"] = _maximum_kinds(dtype)
        for op in NAN_OPS:
            found = kinds[f"{op}_nan"] = _nan_kinds(op, dtype)
            if None in found:
                notes.append(f"{op}: no known NaN in the body or the tail {found}")
                kinds[f"{op}_nan"] = tuple("kept" if k is None else k for k in found)
        if None in kinds["maximum"]:
            notes.append(f"maximum: no known choice between equal zeros {kinds['maximum']}")
            kinds["maximum"] = tuple(k or "second" for k in kinds["maximum"])
        elif step == 1 and kinds["maximum"][0] != kinds["maximum"][1]:
            step = _tail_step(functools.partial(_maximum_in_tail, dtype, kinds["maximum"][1]))
        if step is None:
            step = 32
            notes.append("no vector step in (16, 32, 64, 128) places the tails")
        if not _sqrt_is_correctly_rounded(dtype):
            notes.append("sqrt: not the correctly rounded float32 root, rounded")
    what = ", ".join(f"{fn} {_shown(b)}/{_shown(t)}" for fn, (b, t) in kinds.items())
    what += f" (body/tail), step {step}"
    if notes:
        what += "; " + "; ".join(notes)
    return Rounding(dtype, tuple(kinds.items()), step, not notes, what)


def _function_kinds(fn, dtype, notes):
    """``(body, tail, in_tail)``: ``fn``'s formula in the vector body and in the scalar tail
    (a note where neither candidate matches), and ``in_tail(n)`` for its tails' step."""
    a, b, c, s, outs = _discriminating(fn, dtype)
    n = len(a) - len(a) % 128  # a body only: no tail at any step up to 128
    t = [torch.from_numpy(x).to(dtype) for x in (a, b, c)]
    got = _call(fn, t[0][:n], t[1][:n], t[2][:n], s).float().numpy()
    body = _kind(got, {k: v[:n] for k, v in outs.items()})
    # tails only: loops of 7 elements
    got = torch.cat([_call(fn, *(x[i : i + 7] for x in t), s) for i in range(0, n - 6, 7)])
    tail = _kind(got.float().numpy(), {k: v[: len(got)] for k, v in outs.items()})
    if body is None or tail is None:
        notes.append(f"{fn}: no known formula (body {body}, tail {tail})")
        body, tail = body or "fma", tail or body or "fma"
    return body, tail, functools.partial(_add_in_tail, t, s, outs[tail])


def _maximum_kinds(dtype):
    """``torch.maximum``'s choice between two equal zeros of opposite signs in the body and in
    the tail: ``second`` (``_mm256_max_ps(a, b)``) or ``first`` (``std::max``)."""
    a = torch.tensor([0.0, -0.0] * 64, dtype=dtype)
    b = -a

    def kind(x, y):
        got = torch.signbit(torch.maximum(x, y))
        if torch.equal(got, torch.signbit(y)):
            return "second"
        return "first" if torch.equal(got, torch.signbit(x)) else None

    tail = {kind(a[i : i + 2], b[i : i + 2]) for i in range(0, 8, 2)}
    return kind(a, b), tail.pop() if len(tail) == 1 else None


def _shown(kind) -> str:
    return f"0x{kind:04x}" if isinstance(kind, int) else str(kind)


def _nans(dtype) -> list:
    """Quiet NaNs of ``dtype`` as 16-bit patterns: both signs, several payloads. (A signalling
    NaN is quieted as it is read: torch's bitwise ops keep one; not modelled.)"""
    if dtype is torch.float16:
        return [0x7E00, 0xFE00, 0x7F55, 0x7FFF, 0xFFFF]
    return [0x7FC0, 0xFFC0, 0x7FD5, 0x7FFF, 0xFFFF]


def _from_bits(bits, dtype) -> torch.Tensor:
    signed = [b - (1 << 16) if b >= 1 << 15 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int16).view(dtype)


def _bits(t: torch.Tensor) -> list:
    return (t.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()


# The ops whose NaN is measured: each a function of two tensors, and what it does to a NaN's
# bits where it keeps them ("round": every op that rounds, as a multiply by a scalar rounds).
# Their vector bodies and scalar tails store NaNs otherwise: torch's vectorized bfloat16
# conversion makes every NaN 0xffff, c10::BFloat16's 0x7fc0; maximum's body ORs an all-ones
# mask into its float32 result, its scalar lambda returns ``quiet_NaN()``; neg and abs flip a
# vector's bits, and so on (docs/low-precision.md).
NAN_OPS = {
    "round": (lambda a, b: a * 0.9, lambda x: x),
    "sqrt": (lambda a, b: torch.sqrt(a), lambda x: x),
    "neg": (lambda a, b: torch.neg(a), lambda x: x ^ 0x8000),
    "abs": (lambda a, b: torch.abs(a), lambda x: x & 0x7FFF),
    "clamp": (lambda a, b: torch.clamp(a, -1.0, 1.0), lambda x: x),
    "where": (lambda a, b: torch.where(torch.ones_like(a, dtype=torch.bool), a, b), lambda x: x),
    "maximum": (torch.maximum, None),
}


def _nan_kinds(op, dtype):
    """``(body, tail)``: what ``op`` (``NAN_OPS``) stores where its result is NaN, over every
    pairing of a NaN with a NaN or a number (either side): one 16-bit pattern, ``"kept"`` (the
    operand's NaN, its bits as ``op`` treats them, quieted), or None (neither)."""
    fn, on_bits = NAN_OPS[op]
    quiet = 0x0200 if dtype is torch.float16 else 0x0040
    nans = _nans(dtype)
    one = 0x3FC0 if dtype is torch.bfloat16 else 0x3E00  # 1.5
    pairs = [(x, y) for x in nans + [one] for y in nans + [one] if x in nans or y in nans]
    a = _from_bits([x for x, _ in pairs], dtype)
    b = _from_bits([y for _, y in pairs], dtype)

    def classify(got, a_bits):
        got = [g for g, x in zip(got, a_bits, strict=True) if x in nans or op == "maximum"]
        a_bits = [x for x in a_bits if x in nans or op == "maximum"]
        if len(set(got)) == 1:
            return got[0]
        if on_bits is not None and got == [on_bits(x) | quiet for x in a_bits]:
            return "kept"
        return None

    # the body: each pair over a whole vector loop (128 elements: no tail at any step up to
    # 128); the tail: loops of 7 elements
    n = len(pairs)
    body = _bits(fn(a.repeat_interleave(128), b.repeat_interleave(128))[::128])
    tail = _bits(torch.cat([fn(a[i : i + 7], b[i : i + 7]) for i in range(0, n, 7)]))
    a_bits = _bits(a)  # (an op but maximum: where ``a`` is NaN)
    return classify(body, a_bits), classify(tail, a_bits)


def _sqrt_is_correctly_rounded(dtype) -> bool:
    """Whether ``torch.sqrt`` of every ``dtype`` value, in the body and in a tail, is the
    correctly rounded float32 root rounded to ``dtype`` (the formulas' root)."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    with np.errstate(invalid="ignore"):
        want = torch.from_numpy(np.sqrt(x.float().numpy())).to(dtype)
    for got in (torch.sqrt(x), torch.cat([torch.sqrt(x[i : i + 7]) for i in range(0, 7 * 64, 7)])):
        n = len(got)
        same = (got.view(torch.int16) == want[:n].view(torch.int16)) | (got.isnan() & want[:n].isnan())
        if not bool(same.all()):
            return False
    return True


def _add_in_tail(t, s, tail_result, n):
    """Which of the first ``n`` discriminating elements ``torch.add`` computes as its tail."""
    got = torch.add(t[0][:n], t[1][:n], alpha=float(s)).float().numpy()
    return got.view(np.uint32) == tail_result[:n].view(np.uint32)


def _maximum_in_tail(dtype, tail_kind, n):
    """Which of ``n`` elements ``torch.maximum`` of opposite zeros takes as its tail takes them."""
    a = torch.tensor([0.0, -0.0] * (n // 2 + 1), dtype=dtype)[:n]
    got = torch.signbit(torch.maximum(a, -a))
    return (got == torch.signbit(a if tail_kind == "first" else -a)).numpy()


def _tail_step(in_tail):
    """The loop's step: the one of (16, 32, 64, 128) that places the tails where a loop of 511
    and one of 400 elements has them (``in_tail(n)``; the first tells them apart, the second
    checks), or None."""
    fits = {16, 32, 64, 128}
    for n in (511, 400):
        found = in_tail(n)
        fits &= {v for v in fits if found[n - n % v :].all() and not found[: n - n % v].any()}
    return fits.pop() if len(fits) == 1 else None
