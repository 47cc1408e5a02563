"""The torch lowering of the IR, shared by the ``reference`` backend and the ``fast`` backend's
torch engine: each IR operator or function is the torch op it is named after.

Every entry takes its operands (tensors, or Python floats for scalars) and an optional
``out=`` tensor. Python operators between a number and a tensor follow torch's own
``Tensor.__r*__`` definitions, so ``s / t`` is ``reciprocal(t) * s`` exactly as in
``torch/_tensor.py``: the rounding is the one torch.optim's for-loop gets.
"""

from __future__ import annotations

import functools

import torch

from ..spec import codebooks


def _is_t(x):
    return isinstance(x, torch.Tensor)


def _add(a, b, out=None):
    if not _is_t(a):
        a, b = b, a
    return torch.add(a, b, out=out)


def _sub(a, b, out=None):
    if _is_t(a):
        return torch.sub(a, b, out=out)
    # number - tensor: torch's __rsub__ is rsub(t, n) = n - t
    res = torch.rsub(b, a)
    return res if out is None else out.copy_(res)


def _mul(a, b, out=None):
    if not _is_t(a):
        a, b = b, a
    return torch.mul(a, b, out=out)


def _div(a, b, out=None):
    if _is_t(a):
        return torch.div(a, b, out=out)
    # number / tensor: torch's __rtruediv__ is reciprocal(t) * n
    res = torch.reciprocal(b, out=out)
    return res.mul_(a)


def _cmp(op, rop):
    def f(a, b, out=None):
        if _is_t(a):
            return op(a, b, out=out)
        return rop(b, a, out=out)

    return f


def _where(cond, a, b, out=None):
    if out is None:
        return torch.where(cond, a, b)
    if not _is_t(a):
        a = torch.tensor(a, dtype=out.dtype)
    if not _is_t(b):
        b = torch.tensor(b, dtype=out.dtype)
    return torch.where(cond, a, b, out=out)


def _sqrt_rn(x, out=None):
    # the float64 root of a float32 rounded to float32 is the correctly rounded one (53 >= 2*24+2)
    root = torch.sqrt(x.double())
    if out is None:
        return root.to(x.dtype)
    return out.copy_(root)


BINARY = {
    "+": _add,
    "-": _sub,
    "*": _mul,
    "/": _div,
    ">": _cmp(torch.gt, torch.lt),
    "<": _cmp(torch.lt, torch.gt),
    ">=": _cmp(torch.ge, torch.le),
    "<=": _cmp(torch.le, torch.ge),
}

FUNCTIONS = {
    "neg": lambda x, out=None: torch.neg(x, out=out),
    "sqrt": lambda x, out=None: torch.sqrt(x, out=out),
    "sqrt_rn": lambda x, out=None: _sqrt_rn(x, out),
    "abs": lambda x, out=None: torch.abs(x, out=out),
    "sign": lambda x, out=None: torch.sign(x, out=out),
    "maximum": lambda a, b, out=None: torch.maximum(a, b, out=out),
    "where": _where,
    "clamp": lambda x, lo, hi, out=None: torch.clamp(x, lo, hi, out=out),
    "rsqrt": lambda x, out=None: torch.rsqrt(x, out=out),
    "clamp_min": lambda x, lo, out=None: torch.clamp(x, min=lo, out=out),
    "add": lambda a, b, alpha, out=None: torch.add(a, b, alpha=alpha, out=out),
    "addcmul": lambda a, b, c, value, out=None: torch.addcmul(a, b, c, value=value, out=out),
    "addcdiv": lambda a, b, c, value, out=None: torch.addcdiv(a, b, c, value=value, out=out),
    "lerp": lambda a, b, w, out=None: torch.lerp(a, b, w, out=out),
    "dequantize": lambda codes, blocks, codebook, out=None: dequantize(codes, blocks, codebook, out),
}

COMPARISONS = (">", "<", ">=", "<=")


def norm(x, dim):
    """The IR's ``norm`` statement: ``torch.norm(x, dim=dim, keepdim=True)`` (the whole tensor's
    as a 0-d tensor when ``dim`` is None, as torch's for-loops take ``x.norm(2)``)."""
    if dim is None:
        return x.norm(2)
    return torch.norm(x, dim=dim, keepdim=True)


def _per_element(blocks, codes):
    """Each element's block value (``blocks[i // BLOCK]``), in ``codes``' shape."""
    return blocks.reshape(-1).repeat_interleave(codebooks.BLOCK)[: codes.numel()].view(codes.shape)


def dequantize(codes, blocks, codebook, out=None):
    """The IR's ``dequantize``: ``codebook[codes] * absmax`` of the element's block, in float32."""
    return torch.mul(codebook[codes.long()], _per_element(blocks, codes), out=out)


def lookup_table(codebook: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' 65,536-entry table of ``codebook`` (uint8), built once per codebook's values
    (the reference's quantize and the numba engine's kernel both read it)."""
    return _table(codebook.numpy().tobytes())


@functools.lru_cache(maxsize=8)
def _table(code_bytes: bytes) -> torch.Tensor:
    code = torch.frombuffer(bytearray(code_bytes), dtype=torch.float32)
    return torch.from_numpy(codebooks.lookup_table(code))


def quantize_(codes, blocks, codebook, value):
    """The IR's ``quantize``: ``value`` (float32, ``codes``' shape) into ``codes`` and
    ``blocks`` as bitsandbytes' CPU kernel writes them (``codebooks.py``)."""
    flat = value.reshape(-1)
    absmax = codebooks.block_absmax(flat.numpy())
    inv = torch.from_numpy(absmax).reciprocal()
    normed = flat * _per_element(inv, flat)
    table = lookup_table(codebook)
    picked = table[torch.from_numpy(codebooks.lut_position(normed.numpy()))]
    picked[_per_element(torch.from_numpy(absmax), flat) == 0] = 0  # an all-zero block: code 0
    codes.view(-1).copy_(picked)
    blocks.view(-1).copy_(torch.from_numpy(absmax))
