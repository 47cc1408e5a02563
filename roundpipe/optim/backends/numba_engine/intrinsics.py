"""The LLVM intrinsics the generated kernels call (besides the sqrt emulations and the dtype
conversions, in modules of their own). Imported by the generated kernel modules only, so numba
is imported when the first kernel is compiled, not with roundpipe.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .config import VML_MODE
from .probes import target_features

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def _integers(*args) -> bool:
    return all(isinstance(x, types.Integer) for x in args)


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` in float32, rounded once (``llvm.fma.f32``)."""
    if not all(x == types.float32 for x in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.fma", [ir.FloatType()] * 3)
        return builder.call(fn, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 ``bits`` (a bitcast: no memory between them)."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def call_sqrt_at(typingctx, routine, n, src, dst):
    """``routine(n, src, dst, VML_MODE)``: the sqrt routine at address ``routine`` (vmsSqrt's
    signature: int32 count, float32 in, float32 out, int64 mode) on ``n`` elements, the arrays
    given by their addresses."""
    if not _integers(routine, n, src, dst):
        return None

    def codegen(context, builder, signature, args):
        address, count, src_at, dst_at = args
        f32p = ir.FloatType().as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [_I32, f32p, f32p, _I64])
        target = builder.inttoptr(address, fnty.as_pointer())
        count32 = builder.trunc(count, _I32)
        mode = ir.Constant(_I64, VML_MODE)
        builder.call(target, [count32, builder.inttoptr(src_at, f32p), builder.inttoptr(dst_at, f32p), mode])
        return context.get_dummy_value()

    return types.void(routine, n, src, dst), codegen


@intrinsic
def pad_copy(typingctx, dst, src, n, total):
    """Copies ``n`` bytes from address ``src`` to ``dst``, zeroes ``dst``'s bytes from ``n`` up
    to ``total``, and returns ``dst``."""
    if not _integers(dst, src, n, total):
        return None

    def codegen(context, builder, signature, args):
        dst_at, src_at, count, total_bytes = args
        dp, sp = builder.inttoptr(dst_at, _I8P), builder.inttoptr(src_at, _I8P)
        not_volatile = ir.Constant(ir.IntType(1), 0)
        memcpy = builder.module.declare_intrinsic("llvm.memcpy", [_I8P, _I8P, _I64])
        memset = builder.module.declare_intrinsic("llvm.memset", [_I8P, _I64])
        builder.call(memcpy, [dp, sp, count, not_volatile])
        rest = builder.gep(dp, [count])
        zero = ir.Constant(ir.IntType(8), 0)
        builder.call(memset, [rest, zero, builder.sub(total_bytes, count), not_volatile])
        return dst_at

    return types.int64(dst, src, n, total), codegen


@intrinsic
def wide_vectors(typingctx):
    """Asks LLVM to vectorize the function it is called in with 512-bit registers where the
    target has AVX-512 (``"prefer-vector-width"="512"``): LLVM's tuning for recent Intel CPUs
    otherwise stops at 256 bits, while torch's kernels run AVX-512 there. The same bits (every
    operation is per element). Only this function changes: numba's target, which the user's own
    numba code shares, is left as it is. (A string attribute, which llvmlite's attribute set
    does not list: added to the set directly.)"""

    def codegen(context, builder, signature, args):
        if "avx512f" in target_features():
            set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(), codegen


def _prefetch(lines: int):
    """An intrinsic ``prefetch<lines>(address)``: prefetches (for reading, into every cache
    level: ``prefetcht0``) the ``lines`` 64-byte cache lines from ``address`` on."""

    def prefetch(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32])
            fn = builder.module.declare_intrinsic("llvm.prefetch", [_I8P], fnty=fnty)
            for k in range(lines):
                at = builder.inttoptr(builder.add(args[0], ir.Constant(args[0].type, 64 * k)), _I8P)
                # read, locality 3 (keep in all levels), data cache
                builder.call(fn, [at, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
            return context.get_dummy_value()

        return types.void(address), codegen

    prefetch.__name__ = f"prefetch{lines}"
    return intrinsic(prefetch)


def _pointer(element):
    """An intrinsic: the pointer to ``element`` at an integer address."""
    ptr = types.CPointer(element)

    def pointer(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(address), codegen

    pointer.__name__ = f"{element}ptr"
    return intrinsic(pointer)


# a chunk of float32 is 4 cache lines, one of bfloat16/float16 bits 2
prefetch4 = _prefetch(4)
prefetch2 = _prefetch(2)
# the float32 / uint16 (bfloat16, float16 bits) pointer at a tensor's data_ptr()
f32ptr = _pointer(types.float32)
u16ptr = _pointer(types.uint16)
u8ptr = _pointer(types.uint8)  # an 8-bit state's codes and its lookup table (blockwise)
i32ptr = _pointer(types.int32)  # a quantization block's table positions (blockwise)


def _lane_add(lanes: int):
    """An intrinsic ``lane_add<lanes>(acc, src, count)``: for each group of ``lanes`` float32 at
    address ``src`` in order (``count`` a multiple of ``lanes``), ``acc[l] += src[q + l]``, the
    ``lanes`` sums at address ``acc`` kept in one vector register: each lane's additions in
    order and rounded one by one, as torch's vectorized reductions add (numba leaves LLVM's SLP
    vectorizer off, so the scalar form of this loop stays scalar)."""

    def lane_add(typingctx, acc, src, count):
        if not _integers(acc, src, count):
            return None

        def codegen(context, builder, signature, args):
            acc_at, src_at, n = args
            vec = ir.VectorType(ir.FloatType(), lanes)
            vp = vec.as_pointer()
            accp = builder.inttoptr(acc_at, vp)
            srcp = builder.inttoptr(src_at, vp)
            groups = builder.udiv(n, ir.Constant(_I64, lanes))
            start = builder.load(accp, align=4)
            entry = builder.block
            loop = builder.append_basic_block("lane_add.loop")
            body = builder.append_basic_block("lane_add.body")
            done = builder.append_basic_block("lane_add.done")
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(_I64)
            total = builder.phi(vec)
            k.add_incoming(ir.Constant(_I64, 0), entry)
            total.add_incoming(start, entry)
            builder.cbranch(builder.icmp_unsigned("<", k, groups), body, done)
            builder.position_at_end(body)
            value = builder.load(builder.gep(srcp, [k]), align=4)
            added = builder.fadd(total, value)
            k.add_incoming(builder.add(k, ir.Constant(_I64, 1)), body)
            total.add_incoming(added, body)
            builder.branch(loop)
            builder.position_at_end(done)
            builder.store(total, accp, align=4)
            return context.get_dummy_value()

        return types.void(acc, src, count), codegen

    lane_add.__name__ = f"lane_add{lanes}"
    return intrinsic(lane_add)


lane_add8 = _lane_add(8)
lane_add16 = _lane_add(16)
