"""MKL's float32 sqrt kernels (torch's CPU ``sqrt`` on the x86-64 wheels), emulated: each
intrinsic ``emulated_sqrt_<isa>(src, dst)`` computes, on the ``SQRT_LANES`` float32 at address
``src``, the sequence one of MKL's HA kernels runs on its main path, stores the roots at
``dst`` and returns non-zero when a lane is off that path (the kernel then hands the whole
chunk to torch's routine). A kernel uses one only where the probe (``probes.find_sqrt_kind``)
finds it equal to ``torch.sqrt`` bit for bit. The sequences, and how they were checked:
docs/numba-engine.md.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .config import SQRT_LANES

_F32 = ir.FloatType()
_I32 = ir.IntType(32)


def _splat(ty, value):
    """A constant vector of ``ty`` with every lane ``value``."""
    return ir.Constant(ty, [value] * ty.count)


def _indices(values):
    return ir.Constant(ir.VectorType(_I32, len(values)), list(values))


def _emulated_sqrt(name: str, main_path, width: int = SQRT_LANES):
    """The intrinsic ``name(src, dst)`` over ``main_path(builder, x, fma)`` (``x``: ``width``
    lanes; ``fma``: ``llvm.fma`` on such vectors), which returns ``(roots, on_path)``. Zeros are
    returned as they are (``sqrt(+-0)`` is ``+-0``) and count as on the path."""

    def emulated_sqrt(typingctx, src, dst):
        if not (isinstance(src, types.Integer) and isinstance(dst, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            vf = ir.VectorType(_F32, width)
            fma_fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{width}f32"
            )

            def fma(a, b, c):
                return builder.call(fma_fn, [a, b, c])

            any_off_path = ir.Constant(_I32, 0)
            for lo in range(0, SQRT_LANES, width):
                src_at = builder.add(args[0], ir.Constant(args[0].type, 4 * lo))
                dst_at = builder.add(args[1], ir.Constant(args[1].type, 4 * lo))
                x = builder.load(builder.inttoptr(src_at, vf.as_pointer()), align=4)
                root, on_path = main_path(builder, x, fma)
                zero = builder.fcmp_ordered("==", x, _splat(vf, 0.0))
                builder.store(
                    builder.select(zero, x, root), builder.inttoptr(dst_at, vf.as_pointer()), align=4
                )
                off_path = builder.not_(builder.or_(on_path, zero))
                lane_bits = builder.zext(builder.bitcast(off_path, ir.IntType(width)), _I32)
                any_off_path = builder.or_(any_off_path, lane_bits)
            return any_off_path

        return types.int32(src, dst), codegen

    emulated_sqrt.__name__ = name
    return intrinsic(emulated_sqrt)


def _rsqrt_estimate(builder, x, rsqrt_lanes: int):
    """``rsqrtps`` of all ``SQRT_LANES`` lanes of ``x``, taken ``rsqrt_lanes`` (4: SSE, 8: AVX)
    at a time as MKL's kernel takes it (each lane's estimate is the CPU's table entry)."""
    vr = ir.VectorType(_F32, rsqrt_lanes)
    name = "llvm.x86.sse.rsqrt.ps" if rsqrt_lanes == 4 else "llvm.x86.avx.rsqrt.ps.256"
    rsqrt = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(vr, [vr]))
    parts = [
        builder.call(rsqrt, [builder.shuffle_vector(x, x, _indices(range(lo, lo + rsqrt_lanes)))])
        for lo in range(0, SQRT_LANES, rsqrt_lanes)
    ]
    while len(parts) > 1:  # concatenate pairwise back to SQRT_LANES lanes
        width = 2 * parts[0].type.count
        parts = [
            builder.shuffle_vector(parts[k], parts[k + 1], _indices(range(width)))
            for k in range(0, len(parts), 2)
        ]
    return parts[0]


def _sse_avx_main_path(rsqrt_lanes: int, with_fma: bool):
    """MKL's SSE/AVX/AVX2 HA kernels' main path: ``y = rsqrtps(x)``, ``s = x * y``, ``h = 0.5 *
    y``, ``e = 0.5 - s * h``, ``s1 = s + s * e``, ``h1 = h + e * h``, ``r = x - s1 * s1``,
    ``sqrt = s1 + r * h1`` (``with_fma``: each ``a +- b * c`` rounded once, as the AVX2 kernel;
    else after each operation, as the SSE kernel), on positive normal x below 0x7f7ff000 (MKL's
    own test: ``bits + 0x7f800000 > 0xfefff000`` as int32 is off it). Computed on all
    SQRT_LANES at once, which LLVM lowers to the widest vectors the CPU has."""

    def main_path(builder, x, fma):
        vf, vi = x.type, ir.VectorType(_I32, SQRT_LANES)
        off_path = builder.icmp_signed(
            ">", builder.add(builder.bitcast(x, vi), _splat(vi, 0x7F800000)), _splat(vi, -16781312)
        )
        y = _rsqrt_estimate(builder, x, rsqrt_lanes)
        half = _splat(vf, 0.5)
        s = builder.fmul(x, y)
        h = builder.fmul(y, half)
        if with_fma:
            e = fma(builder.fneg(s), h, half)
            s1 = fma(s, e, s)
            h1 = fma(e, h, h)
            r = fma(builder.fneg(s1), s1, x)
            root = fma(h1, r, s1)
        else:
            e = builder.fsub(half, builder.fmul(s, h))
            s1 = builder.fadd(builder.fmul(s, e), s)
            h1 = builder.fadd(builder.fmul(e, h), h)
            r = builder.fsub(x, builder.fmul(s1, s1))
            root = builder.fadd(builder.fmul(r, h1), s1)
        return root, builder.not_(off_path)

    return main_path


def _avx512_main_path(builder, x, fma):
    """MKL's AVX-512 HA kernel's main path (``mkl_vml_kernel_sSqrt_Z0HAynn``): ``y =
    vrsqrt14ps(x)``, ``h = y * 0.5``, ``s = y * x``, ``r = fma(-s, s, x)``, ``sqrt = fma(r, h,
    s)``, on 0 < x < inf with ``y <= 2**39`` (MKL rescales smaller x). Sixteen lanes at once (one
    zmm register), with the fewest checks that select the same lanes: ``x < inf and y <=
    2**39`` (a negative x or NaN has a NaN estimate, +0 and subnormals an infinite one; -0's
    estimate is -inf, and zeros are returned as they are anyway)."""
    vf = x.type
    fnty = ir.FunctionType(vf, [vf, vf, ir.IntType(16)])
    rsqrt14 = builder.module.declare_intrinsic("llvm.x86.avx512.rsqrt14.ps.512", fnty=fnty)
    y = builder.call(rsqrt14, [x, _splat(vf, 0.0), ir.Constant(ir.IntType(16), -1)])
    h = builder.fmul(y, _splat(vf, 0.5))
    s = builder.fmul(y, x)
    root = fma(fma(builder.fneg(s), s, x), h, s)
    on_path = builder.and_(
        builder.fcmp_ordered("<", x, _splat(vf, float("inf"))),
        builder.fcmp_ordered("<=", y, _splat(vf, 2.0**39)),
    )
    return root, on_path


# the kinds of config.SQRT_KINDS, by MKL kernel: SSE (rounded at each step, rsqrtps four lanes
# wide), AVX (the same, eight lanes wide), AVX2 (with FMAs), AVX-512
emulated_sqrt_sse = _emulated_sqrt("emulated_sqrt_sse", _sse_avx_main_path(4, with_fma=False))
emulated_sqrt_avx = _emulated_sqrt("emulated_sqrt_avx", _sse_avx_main_path(8, with_fma=False))
emulated_sqrt_fma = _emulated_sqrt("emulated_sqrt_fma", _sse_avx_main_path(8, with_fma=True))
emulated_sqrt_avx512 = _emulated_sqrt("emulated_sqrt_avx512", _avx512_main_path, width=16)
