"""A pairing's dtype conversions (masters.py), as intrinsics: ``widen_bfloat16`` and
``widen_float16`` (the bits of a bfloat16 or float16, as uint16, to float32: exact) and
``narrow_bfloat16`` and ``narrow_float16`` (float32 to those bits, as torch's ``copy_`` rounds
on the CPU: nearest-even, subnormals kept). Integer and float32 operations only (no ``half``
type, which LLVM may lower to a runtime call), so loops vectorize:

* bfloat16: ``(u + 0x7fff + ((u >> 16) & 1)) >> 16`` of the float32 bits ``u``; every NaN
  becomes 0xffff (as torch's vectorized and scalar conversions both give it);
* float16: the branch-free sequences of the FP16 library (M. Dukhan's ``fp16_ieee_from_fp32
  _value`` / ``fp16_ieee_to_fp32_value``), which round through float32 arithmetic; a NaN becomes
  ``sign | 0x7e00 | (mantissa >> 13)``, as F16C's ``vcvtps2ph`` (torch's vectorized copy) gives.
  Widening keeps a NaN's payload and quiets it, as ``vcvtph2ps`` does. Where numba's target has
  F16C, both are LLVM's ``fptrunc``/``fpext`` through ``half``, which x86 lowers to exactly
  those two instructions: the same bits (checked: docs/numba-engine.md).

And stochastic rounding to bfloat16 (``roundpipe.optim.storage``, where the same is written in
torch's int32 ops): ``sr_param_key`` (a parameter's key at a step) and ``narrow_bfloat16_sr``
(an element's random bits from its key and index, added to its float32 bits, truncated), all
in 32-bit integer operations, which vectorize (``vpmulld``).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .probes import target_features

_I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()


def _c32(v):
    """An int32 constant from its unsigned bits."""
    return ir.Constant(_I32, v - (1 << 32) if v >= 1 << 31 else v)


def _f32(v):
    return ir.Constant(_F32, v)


def _widen_bfloat16(builder, h, f16c):
    return builder.bitcast(builder.shl(builder.zext(h, _I32), _c32(16)), _F32)


def _narrow_bfloat16(builder, x, f16c):
    u = builder.bitcast(x, _I32)
    lsb = builder.and_(builder.lshr(u, _c32(16)), _c32(1))
    r = builder.lshr(builder.add(builder.add(u, _c32(0x7FFF)), lsb), _c32(16))
    nan = builder.fcmp_unordered("uno", x, x)
    return builder.trunc(builder.select(nan, _c32(0xFFFF), r), _I16)


def _widen_float16(builder, h, f16c):
    if f16c:  # vcvtph2ps
        return builder.fpext(builder.bitcast(h, ir.HalfType()), _F32)
    w = builder.shl(builder.zext(h, _I32), _c32(16))
    sign = builder.and_(w, _c32(0x80000000))
    two_w = builder.add(w, w)
    norm = builder.fmul(
        builder.bitcast(builder.add(builder.lshr(two_w, _c32(4)), _c32(0x70000000)), _F32), _f32(2.0**-112)
    )
    denorm = builder.fsub(
        builder.bitcast(builder.or_(builder.lshr(two_w, _c32(17)), _c32(0x3F000000)), _F32), _f32(0.5)
    )
    small = builder.icmp_unsigned("<", two_w, _c32(1 << 27))
    bits = builder.select(small, builder.bitcast(denorm, _I32), builder.bitcast(norm, _I32))
    return builder.bitcast(builder.or_(sign, bits), _F32)


def _narrow_float16(builder, x, f16c):
    if f16c:  # vcvtps2ph, rounding as MXCSR says: nearest-even, as torch runs it
        return builder.bitcast(builder.fptrunc(x, ir.HalfType()), _I16)
    fabs = builder.module.declare_intrinsic("llvm.fabs", [_F32])
    base = builder.fmul(builder.fmul(builder.call(fabs, [x]), _f32(2.0**112)), _f32(2.0**-110))
    w = builder.bitcast(x, _I32)
    shl1 = builder.add(w, w)
    sign = builder.and_(w, _c32(0x80000000))
    bias = builder.and_(shl1, _c32(0xFF000000))
    bias = builder.select(builder.icmp_unsigned("<", bias, _c32(0x71000000)), _c32(0x71000000), bias)
    base = builder.fadd(
        builder.bitcast(builder.add(builder.lshr(bias, _c32(1)), _c32(0x07800000)), _F32), base
    )
    bits = builder.bitcast(base, _I32)
    nonsign = builder.add(
        builder.and_(builder.lshr(bits, _c32(13)), _c32(0x7C00)), builder.and_(bits, _c32(0x0FFF))
    )
    mant = builder.lshr(builder.and_(w, _c32(0x007FFFFF)), _c32(13))
    nan = builder.or_(_c32(0x7E00), mant)
    r = builder.or_(
        builder.lshr(sign, _c32(16)),
        builder.select(builder.icmp_unsigned(">", shl1, _c32(0xFF000000)), nan, nonsign),
    )
    return builder.trunc(r, _I16)


def _kept_bfloat16(builder, x, f16c):
    # a NaN's sign and high payload, quieted (c10's conversion of a NaN operand kept as is)
    u = builder.bitcast(x, _I32)
    return builder.trunc(builder.or_(builder.lshr(u, _c32(16)), _c32(0x40)), _I16)


def _with_nan(narrow, kept):
    """``narrow`` where ``x`` is a number; where it is NaN, ``nan`` (int64): its 16-bit pattern,
    or -1: ``kept``'s (the NaN's own bits, quieted)."""

    def build(builder, x, nan, f16c):
        given = builder.icmp_signed(">=", nan, ir.Constant(nan.type, 0))
        own = builder.select(given, builder.trunc(nan, _I16), kept(builder, x, f16c))
        return builder.select(builder.fcmp_unordered("uno", x, x), own, narrow(builder, x, f16c))

    return build


def _bits_bfloat16(builder, x, f16c):
    # a float32 that holds a bfloat16 (a NaN too): its high half, exactly
    return builder.trunc(builder.lshr(builder.bitcast(x, _I32), _c32(16)), _I16)


def _round_bfloat16(builder, x, f16c):
    return _widen_bfloat16(builder, _narrow_bfloat16(builder, x, f16c), f16c)


def _round_float16(builder, x, f16c):
    return _widen_float16(builder, _narrow_float16(builder, x, f16c), f16c)


_MIX = (0x7FEB352D, 0x846CA68B)  # lowbias32's multipliers (storage.mix32)


def _mix32(builder, x):
    x = builder.xor(x, builder.lshr(x, _c32(16)))
    x = builder.mul(x, _c32(_MIX[0]))
    x = builder.xor(x, builder.lshr(x, _c32(15)))
    x = builder.mul(x, _c32(_MIX[1]))
    return builder.xor(x, builder.lshr(x, _c32(16)))


def _narrow_bfloat16_sr(builder, x, key, index):
    """storage.stochastic_round_: ``(u + r) >> 16``, ``r`` the element's 16 random bits; a NaN
    its sign and high payload, quieted."""
    r = _mix32(builder, _mix32(builder, builder.xor(builder.trunc(index, _I32), key)))
    u = builder.bitcast(x, _I32)
    rounded = builder.lshr(builder.add(u, builder.lshr(r, _c32(16))), _c32(16))
    nan = builder.or_(builder.lshr(u, _c32(16)), _c32(0x40))
    return builder.trunc(builder.select(builder.fcmp_unordered("uno", x, x), nan, rounded), _I16)


def _sr_param_key(builder, hi, lo, pid):
    """storage.param_key of the step's key (its 16-bit halves, float32) and the parameter's id."""
    key = builder.or_(builder.shl(builder.fptoui(hi, _I32), _c32(16)), builder.fptoui(lo, _I32))
    return _mix32(builder, builder.xor(_mix32(builder, builder.trunc(pid, _I32)), key))


@intrinsic
def narrow_bfloat16_sr(typingctx, x, key, index):
    """float32 ``x`` rounded stochastically to bfloat16's bits (uint16), its random bits those
    of element ``index`` (int64) of the parameter of key ``key`` (int32: ``sr_param_key``)."""
    if (x, key, index) != (types.float32, types.int32, types.int64):
        return None

    def codegen(context, builder, signature, args):
        return _narrow_bfloat16_sr(builder, *args)

    return types.uint16(types.float32, types.int32, types.int64), codegen


@intrinsic
def sr_param_key(typingctx, hi, lo, pid):
    """A parameter's key (int32) from the step's key halves (float32) and its id (int64)."""
    if (hi, lo, pid) != (types.float32, types.float32, types.int64):
        return None

    def codegen(context, builder, signature, args):
        return _sr_param_key(builder, *args)

    return types.int32(types.float32, types.float32, types.int64), codegen


def _conversion(name, build, arg_type, result_type, f16c=None):
    """The intrinsic ``name(x)``: ``build(builder, x, f16c)``; ``f16c`` None: whether numba's
    target has F16C (without it, LLVM would lower ``half`` to a runtime call)."""

    def conversion(typingctx, x):
        if x != arg_type:
            return None

        def codegen(context, builder, signature, args):
            has_f16c = "f16c" in target_features() if f16c is None else f16c
            return build(builder, args[0], has_f16c)

        return result_type(arg_type), codegen

    conversion.__name__ = name
    return intrinsic(conversion)


def _nan_conversion(name, build, result_type, f16c=None):
    """The intrinsic ``name(x, nan)``: ``build(builder, x, nan, f16c)``, ``nan`` an int64."""

    def conversion(typingctx, x, nan):
        if x != types.float32 or nan != types.int64:
            return None

        def codegen(context, builder, signature, args):
            has_f16c = "f16c" in target_features() if f16c is None else f16c
            return build(builder, args[0], args[1], has_f16c)

        return result_type(types.float32, types.int64), codegen

    conversion.__name__ = name
    return intrinsic(conversion)


def _narrow_bfloat16_nan(builder, x, nan, f16c):
    return _with_nan(_narrow_bfloat16, _kept_bfloat16)(builder, x, nan, f16c)


def _narrow_float16_nan(builder, x, nan, f16c):
    return _with_nan(_narrow_float16, _narrow_float16)(builder, x, nan, f16c)


def _round_bfloat16_nan(builder, x, nan, f16c):
    return _widen_bfloat16(builder, _narrow_bfloat16_nan(builder, x, nan, f16c), f16c)


def _round_float16_nan(builder, x, nan, f16c):
    return _widen_float16(builder, _narrow_float16_nan(builder, x, nan, f16c), f16c)


def conversion_intrinsics(f16c=None) -> dict:
    """The conversions by name; ``f16c``: True or False forces one form (for tests).
    ``round_<dtype>``: float32 to the dtype and back (a low-precision program's op rounding);
    ``bits_<dtype>``: the bits of a float32 that holds a value of the dtype, NaNs as they are
    (float16's narrowing keeps a quiet NaN's sign and payload; bfloat16's would not);
    ``narrow_<dtype>_nan``/``round_<dtype>_nan``: a NaN made the 16-bit pattern of the second
    argument, or kept (its sign and payload, quieted) where that is -1."""
    u16, f32 = types.uint16, types.float32
    return {
        "widen_bfloat16": _conversion("widen_bfloat16", _widen_bfloat16, u16, f32, f16c),
        "widen_float16": _conversion("widen_float16", _widen_float16, u16, f32, f16c),
        "narrow_bfloat16": _conversion("narrow_bfloat16", _narrow_bfloat16, f32, u16, f16c),
        "narrow_float16": _conversion("narrow_float16", _narrow_float16, f32, u16, f16c),
        "round_bfloat16": _conversion("round_bfloat16", _round_bfloat16, f32, f32, f16c),
        "round_float16": _conversion("round_float16", _round_float16, f32, f32, f16c),
        "bits_bfloat16": _conversion("bits_bfloat16", _bits_bfloat16, f32, u16, f16c),
        "bits_float16": _conversion("bits_float16", _narrow_float16, f32, u16, f16c),
        "narrow_bfloat16_nan": _nan_conversion("narrow_bfloat16_nan", _narrow_bfloat16_nan, u16, f16c),
        "narrow_float16_nan": _nan_conversion("narrow_float16_nan", _narrow_float16_nan, u16, f16c),
        "round_bfloat16_nan": _nan_conversion("round_bfloat16_nan", _round_bfloat16_nan, f32, f16c),
        "round_float16_nan": _nan_conversion("round_float16_nan", _round_float16_nan, f32, f16c),
    }


_target_form = conversion_intrinsics()
widen_bfloat16 = _target_form["widen_bfloat16"]
widen_float16 = _target_form["widen_float16"]
narrow_bfloat16 = _target_form["narrow_bfloat16"]
narrow_float16 = _target_form["narrow_float16"]
round_bfloat16 = _target_form["round_bfloat16"]
round_float16 = _target_form["round_float16"]
bits_bfloat16 = _target_form["bits_bfloat16"]
bits_float16 = _target_form["bits_float16"]
narrow_bfloat16_nan = _target_form["narrow_bfloat16_nan"]
narrow_float16_nan = _target_form["narrow_float16_nan"]
round_bfloat16_nan = _target_form["round_bfloat16_nan"]
round_float16_nan = _target_form["round_float16_nan"]
