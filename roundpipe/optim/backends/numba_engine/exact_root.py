"""torch's ``rsqrt`` of float32 (``1 / sqrt(x)``: the root correctly rounded, then the quotient
correctly rounded, as ATen computes it) from the CPU's reciprocal-root estimate instead of its
divider: ``rsqrt14`` on AVX-512, ``rsqrtps`` on AVX, Newton steps with FMA to within an ulp of
the root, then of its reciprocal, each followed by a last step that picks the correctly rounded
one of the result and its neighbour.

The intrinsic ``exact_rsqrt_<isa>(src, dst, count)`` takes the ``count`` float32 at address
``src``, a vector at a time, and stores the results at ``dst`` (``src`` may be ``dst``). A vector
with a lane outside ``[2**-100, largest float]`` (zero, subnormal, negative, inf, NaN, tiny)
takes ``1 / sqrt(x)`` with the root and division instructions; so do the last
``count % lanes``. A kernel uses one only where ``probes.find_root_kind`` finds it equal to
``torch.rsqrt`` bit for bit.

Why the last step is exact (``s`` within an ulp of ``sqrt(x)``, ``n`` its neighbour on the side
of the residual ``r = x - s * s``, which one FMA computes exactly): the root lies beyond the
midpoint of ``s`` and ``n`` exactly when ``t = x - s * n = r - s * (n - s)`` has the sign of
``r`` (``t`` is a multiple of ``ulp(s)**2`` and differs from ``x - mid**2`` by less than one,
so one FMA gives its sign; from ``2**-100`` up no such multiple rounds to zero). For ``q`` within
an ulp of ``1 / s``, with ``r = 1 - s * q`` (exact in one FMA): beyond the midpoint of ``q`` and
``n`` exactly when ``r - s * (n - q) / 2`` has the sign of ``r`` (never zero: a reciprocal is
never a midpoint).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)

# the fast path's range (see the module docstring); the largest float overflows nothing
_SMALLEST = 2.0**-100
_LARGEST = float.fromhex("0x1.fffffep127")


def _splat(ty, value):
    return ir.Constant(ty, [value] * ty.count)


def _estimate(builder, x, isa: str):
    """The CPU's estimate of ``1 / sqrt(x)``, within 2**-14 (``rsqrt14``); ``rsqrtps`` (within
    1.5 * 2**-12) is taken one Newton step further, to about 2**-22."""
    vf = x.type
    if isa == "avx512":
        fnty = ir.FunctionType(vf, [vf, vf, ir.IntType(16)])
        rsqrt14 = builder.module.declare_intrinsic("llvm.x86.avx512.rsqrt14.ps.512", fnty=fnty)
        return builder.call(rsqrt14, [x, _splat(vf, 0.0), ir.Constant(ir.IntType(16), -1)])
    rsqrtps = builder.module.declare_intrinsic("llvm.x86.avx.rsqrt.ps.256", fnty=ir.FunctionType(vf, [vf]))
    return builder.call(rsqrtps, [x])


def _to_nearest(builder, value, residual, gap_scale, fma):
    """``value`` or its float32 neighbour on the side of ``residual``'s sign (below for a zero
    residual), whichever is nearer the exact result: ``residual - gap_scale * (next - value)``
    says on which side of their midpoint it lies (see the module docstring)."""
    vf = value.type
    vi = ir.VectorType(_I32, vf.count)
    zero = _splat(vf, 0.0)
    above = builder.fcmp_ordered(">", residual, zero)
    step = builder.select(above, _splat(vi, 1), _splat(vi, -1))
    nxt = builder.bitcast(builder.add(builder.bitcast(value, vi), step), vf)
    t = fma(builder.fneg(gap_scale), builder.fsub(nxt, value), residual)
    return builder.select(builder.icmp_unsigned("==", above, builder.fcmp_ordered(">", t, zero)), nxt, value)


def exact_rsqrt_vector(builder, x, fma, isa: str):
    """``1 / sqrt(x)`` of a vector of floats in ``[2**-100, largest float]``, the root and the
    quotient each correctly rounded. ``fma``: ``llvm.fma`` on such vectors."""
    vf = x.type
    half, one = _splat(vf, 0.5), _splat(vf, 1.0)
    y = _estimate(builder, x, isa)
    if isa != "avx512":  # y * (1.5 - 0.5 * x * y * y)
        y = fma(y, fma(builder.fneg(builder.fmul(x, y)), builder.fmul(half, y), half), y)
    s = builder.fmul(x, y)
    s = fma(fma(builder.fneg(s), s, x), builder.fmul(half, y), s)  # within an ulp of sqrt(x)
    s = _to_nearest(builder, s, fma(builder.fneg(s), s, x), s, fma)
    # y is within 2**-14 of 1 / s too: one Newton step takes it to within an ulp
    q = fma(y, fma(builder.fneg(s), y, one), y)
    return _to_nearest(builder, q, fma(builder.fneg(s), q, one), builder.fmul(half, s), fma)


def _vector_loop(builder, src_at, dst_at, groups, isa, lanes):
    """The exact rsqrt of ``groups`` vectors; a vector with a lane off the fast path's range
    divides by the root instruction's result instead."""
    module = builder.module
    vf = ir.VectorType(_F32, lanes)
    fma_fn = cgutils.get_or_insert_function(module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{lanes}f32")
    sqrt = cgutils.get_or_insert_function(module, ir.FunctionType(vf, [vf]), f"llvm.sqrt.v{lanes}f32")

    def fma(a, b, c):
        return builder.call(fma_fn, [a, b, c])

    srcp, dstp = builder.inttoptr(src_at, vf.as_pointer()), builder.inttoptr(dst_at, vf.as_pointer())
    mask = ir.IntType(lanes)
    with cgutils.for_range(builder, groups) as loop:
        x = builder.load(builder.gep(srcp, [loop.index]), align=4)
        in_range = builder.and_(
            builder.fcmp_ordered(">=", x, _splat(vf, _SMALLEST)),
            builder.fcmp_ordered("<=", x, _splat(vf, _LARGEST)),
        )
        fast_path = builder.icmp_unsigned("==", builder.bitcast(in_range, mask), ir.Constant(mask, -1))
        with builder.if_else(fast_path, likely=True) as (fast, slow):
            with fast:
                fast_root, fast_block = exact_rsqrt_vector(builder, x, fma, isa), builder.block
            with slow:
                slow_root = builder.fdiv(_splat(vf, 1.0), builder.call(sqrt, [x]))
                slow_block = builder.block
        root = builder.phi(vf)
        root.add_incoming(fast_root, fast_block)
        root.add_incoming(slow_root, slow_block)
        builder.store(root, builder.gep(dstp, [loop.index]), align=4)


def _exact_rsqrt(name: str, isa: str, lanes: int):
    def exact_rsqrt(typingctx, src, dst, count):
        if not all(isinstance(a, types.Integer) for a in (src, dst, count)):
            return None

        def codegen(context, builder, signature, args):
            src_at, dst_at, n = args
            width = ir.Constant(_I64, lanes)
            groups = builder.udiv(n, width)
            _vector_loop(builder, src_at, dst_at, groups, isa, lanes)
            # the last count % lanes, one by one
            sqrt_type = ir.FunctionType(_F32, [_F32])
            sqrt = cgutils.get_or_insert_function(builder.module, sqrt_type, "llvm.sqrt.f32")
            sp, dp = builder.inttoptr(src_at, _F32.as_pointer()), builder.inttoptr(dst_at, _F32.as_pointer())
            done = builder.mul(groups, width)
            with cgutils.for_range(builder, builder.sub(n, done)) as loop:
                k = builder.add(done, loop.index)
                root = builder.call(sqrt, [builder.load(builder.gep(sp, [k]))])
                builder.store(builder.fdiv(ir.Constant(_F32, 1.0), root), builder.gep(dp, [k]))
            return context.get_dummy_value()

        return types.void(src, dst, count), codegen

    exact_rsqrt.__name__ = name
    return intrinsic(exact_rsqrt)


# the kinds of config.ROOT_KINDS: sixteen lanes on AVX-512 (one zmm register), eight on AVX
exact_rsqrt_avx512 = _exact_rsqrt("exact_rsqrt_avx512", "avx512", 16)
exact_rsqrt_avx = _exact_rsqrt("exact_rsqrt_avx", "avx", 8)
