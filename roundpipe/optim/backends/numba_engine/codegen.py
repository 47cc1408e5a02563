"""The kernel module's source: a spec program's records (``lowering.py``) written out as two
loops over a step's slices, ``kernel_parallel`` (``prange``) and ``kernel_serial``.

Each part of a kernel has its emitter; every emitter returns its lines at its own depth, and
the caller indents them (``_indent``). What the kernels compute and why they are shaped so
(chunks, passes, padded copies): docs/numba-engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...spec.modes import param_rounding
from .config import (
    EMULATION_INTRINSICS,
    GENERATOR_VERSION,
    LOW_PRECISION,
    PREFETCH_CHUNKS,
    SQRT_CHUNK,
    SQRT_KINDS,
    SQRT_LANES,
)
from .lowering import KernelLowering, local_name, sqrt_passes

_PACKAGE = "roundpipe.optim.backends.numba_engine"
_CHUNK_BYTES = 4 * SQRT_CHUNK  # a chunk of float32


@dataclass(frozen=True)
class KernelSource:
    """The generated kernel module and the layout of its ``scalar_rows``."""

    source: str
    tensors: tuple  # program tensor names: the rows of ``addresses``
    scalars: tuple  # scalar_env() keys: the first columns of ``scalar_rows``
    consts: tuple  # np.float32 constants: the last columns of ``scalar_rows``
    tails: bool = False  # its items carry a tail flag (layout.partition with ``tails``)
    # the row of ``addresses`` that holds each parameter's id, not an address (stochastic rounding)
    ids_row: int | None = None


@dataclass
class KernelParts:
    """What the emitters share: the lowered program and how each tensor is stored."""

    lowering: KernelLowering
    targets: tuple
    tensors: tuple  # the rows of ``addresses``: the program's tensors, then any partner
    # tensor -> its low-precision dtype (a pairing's gradient or partner; every tensor of a
    # low-precision program; a widened program's 16-bit tensors)
    low: dict
    partner_dtype: str | None
    stochastic: bool = False  # the parameter stored rounded stochastically (``sr_key``: its key)

    def view(self, tensor: str) -> str:
        return self.lowering.views[tensor]

    def element_size(self, tensor: str) -> int:
        return 2 if tensor in self.low else 4

    def load(self, tensor: str, index: str) -> str:
        """The expression reading ``tensor``'s element ``index`` as float32."""
        element = f"{self.view(tensor)}[{index}]"
        return f"widen_{self.low[tensor]}({element})" if tensor in self.low else element

    def stores(self, tensors, index: str = "start + i") -> list:
        """The lines writing each of ``tensors``' final values (rounded to a low-precision
        tensor's dtype; a stochastic kernel's parameter from the random bits of its element
        ``index`` in the parameter), then any partner (the final ``param``, rounded to the
        partner's dtype)."""
        current = self.lowering.current
        bits = getattr(self.lowering, "bits", {})  # (a low-precision value's bits, as computed)
        lines = []
        for t in tensors:
            value = current[t]
            if value in bits:
                value = bits[value]
            elif t == "param" and self.stochastic:
                value = f"narrow_bfloat16_sr({value}, sr_key, {index})"
            elif t in self.low:
                value = f"narrow_{self.low[t]}({value})"
            lines.append(f"{self.view(t)}[i] = {value}")
        if self.partner_dtype:
            lines.append(f"{self.view('partner')}[i] = narrow_{self.partner_dtype}({current['param']})")
        return lines


def generate(
    program,
    variant: tuple,
    fused=frozenset(),
    sqrt_kind: str = "routine",
    dtype_names=("float32", None),
    low=None,
    stored=(),
) -> KernelSource:
    """The kernel source for ``program`` and a lerp variant (``formulas.lerp_variant``);
    ``fused``: the IR functions (``add``, ``addcmul``, ``lerp``) torch computes with an FMA;
    ``sqrt_kind``: how a chunk's roots are taken (``SQRT_KINDS``); ``dtype_names``: ``(grad dtype,
    partner dtype or None)`` by name: a ``bfloat16``/``float16`` gradient is widened as it is
    read, and a partner (the last row of ``addresses``) written with the final ``param``,
    rounded to its dtype. ``low``: the ``low_precision.Rounding`` of a program whose tensors are
    all of that bfloat16 or float16 dtype: each read widened, each op rounded to the dtype as
    torch rounds it (formulas.py), each target stored in it; no pairing then. ``stored``: a
    program stored widened (``Program.storage``): ``(tensor, dtype name)`` of each of its
    bfloat16 or float16 tensors, read widened and stored rounded to it (a stochastic program's
    parameter stochastically, its id in the row after the tensors')."""
    if sqrt_kind not in SQRT_KINDS:
        raise ValueError(f"sqrt_kind {sqrt_kind!r} is not one of {SQRT_KINDS}")
    grad_dtype, partner_dtype = dtype_names
    if grad_dtype not in ("float32", *LOW_PRECISION) or partner_dtype not in (None, *LOW_PRECISION):
        raise ValueError(f"dtype_names {dtype_names!r}: dtypes must be float32, bfloat16 or float16")
    if low is not None and (grad_dtype, partner_dtype) != ("float32", None):
        raise ValueError("a low-precision program has no pairing: dtype_names must be the default")
    if low is not None:
        storage = {t: low.name for t in program.tensors}
    else:
        storage = {t: d for t, d in (("grad", grad_dtype), ("partner", partner_dtype)) if d in LOW_PRECISION}
        storage.update(_stored(program, stored))
    # a widened program's own 16-bit gradient (of the parameter's dtype; not a partner's)
    own = storage.get("grad") if program.storage and storage.get("grad") == storage.get("param") else None
    lowering = KernelLowering(program, variant, fused, low, own)
    tensors = tuple(program.tensors) + (("partner",) if partner_dtype else ())
    lowering.views.setdefault("partner", local_name("view", len(tensors) - 1, "partner"))
    stochastic = param_rounding(program.storage) == "stochastic"
    kernel = KernelParts(lowering, tuple(program.targets), tensors, storage, partner_dtype, stochastic)
    if stochastic:  # (its scalars: the step's key)
        lowering.scalar("sr_hi")
        lowering.scalar("sr_lo")
    row_names = (*sorted(lowering.scalars), *sorted(lowering.consts))
    if lowering.sqrt_cuts:
        scratch, inner, intrinsics = _chunk_loop(kernel, sqrt_kind)
        emulations = [EMULATION_INTRINSICS[sqrt_kind]] if sqrt_kind in EMULATION_INTRINSICS else []
    else:
        scratch, inner, intrinsics, emulations = [], _slice_loop(kernel), [], []
    setup = _item_setup(row_names, lowering.uses_tail, len(tensors) if stochastic else None)
    lines = [
        *_header(program, variant, lowering, sqrt_kind, dtype_names, storage),
        "import numpy as np",
        "from numba import carray, prange",
        "",
        *_imports(kernel, intrinsics, emulations),
        "",
        "",
        *_kernel_function("kernel_parallel", "prange", scratch, setup, inner),
        *_kernel_function("kernel_serial", "range", scratch, setup, inner),
    ]
    consts = tuple(np.float32(lowering.consts[c]) for c in sorted(lowering.consts))
    scalars = tuple(sorted(lowering.scalars))
    ids_row = len(tensors) if stochastic else None
    source = "\n".join(lines).rstrip() + "\n"
    return KernelSource(source, tensors, scalars, consts, lowering.uses_tail, ids_row)


def _stored(program, stored) -> dict:
    """A widened program's 16-bit tensors (``generate``'s ``stored``), checked."""
    storage = dict(stored)
    if storage and not program.storage:
        raise ValueError("stored dtypes are for a program stored widened (Program.storage)")
    rows = (*program.tensors, "partner")
    bad = {t: d for t, d in storage.items() if d not in LOW_PRECISION or t not in rows}
    if bad or (param_rounding(program.storage) == "stochastic" and storage.get("param") != "bfloat16"):
        raise ValueError(f"stored {stored!r}: bfloat16 or float16 tensors of the program (a bfloat16 param)")
    return storage


def _indent(lines, depth: int = 1) -> list:
    pad = "    " * depth
    return [pad + line for line in lines]


def _header(program, variant, lowering, sqrt_kind, dtype_names, kernel_low=None) -> list:
    grad_dtype, partner_dtype = dtype_names
    lines = [
        f"# Generated by {_PACKAGE} (do not edit): one parallel loop over",
        "# every slice of every tensor of a step, running this spec program,",
        "#",
        *(f"#   {line}" for line in str(program).splitlines()),
        "#",
        f"# lerp variant {tuple(variant)!r}, fused multiply-adds in {sorted(lowering.fused)!r}, "
        f"sqrt {sqrt_kind},",
    ]
    if grad_dtype in LOW_PRECISION or partner_dtype in LOW_PRECISION:
        lines.append(f"# gradients {grad_dtype}, partners {partner_dtype} (written with the final param),")
    if lowering.low is not None:
        lines.append(f"# every tensor {lowering.low.name}, each op rounded to it as torch rounds it")
        lines.append(f"# ({lowering.low.what}),")
    if program.storage:
        stored = ", ".join(f"{t} {d}" for t, d in sorted(kernel_low.items())) or "none"
        lines.append(f"# computed in float32 ({program.storage}); stored in 16 bits: {stored},")
    return lines + [
        f"# generator version {GENERATOR_VERSION}. The same loop twice: kernel_parallel (njit with",
        "# parallel=True) and kernel_serial (one thread). Arguments: nthreads; layout (int64: each",
        "# thread's items, each item's parameter, start and stop, each parameter's row of",
        "# scalar_rows: numba_engine/layout.py); addresses (int64: a row of data_ptr() per tensor, a",
        "# column per parameter); scalar_rows (float32: the scalars s_*, then the constants c_*: a",
        "# Python float literal would make numba compute in float64); sqrt_routine (the address of",
        "# torch's sqrt routine, vmsSqrt, or 0: the correctly rounded sqrt). Locals: view<r>_<tensor>",
        "# (its elements in the slice or chunk), val<r>_<tensor>_<n> (its n-th value, 0 as read),",
        "# let<n>_<name>, tmp<n> (a sub-expression used twice), arg<k> (the k-th sqrt's argument;",
        "# args<k> and roots<k>: a chunk's arguments and roots). See docs/numba-engine.md.",
    ]


def _imports(kernel: KernelParts, chunk_intrinsics: list, emulations: list) -> list:
    """The intrinsics the kernels call, from the modules that define them."""
    lowering, low = kernel.lowering, kernel.low
    intrinsics = [
        "f32ptr",
        *(["fma"] if lowering.uses_fma else []),
        *chunk_intrinsics,
        *(["u16ptr"] if low else []),
        "wide_vectors",
    ]
    written = [t for t in kernel.targets if t in low and not (t == "param" and kernel.stochastic)]
    conversions = [
        *sorted({f"widen_{low[t]}" for t in lowering.loads if t in low}),
        *sorted(
            {f"narrow_{low[t]}" for t in written}
            | ({f"narrow_{kernel.partner_dtype}"} if kernel.partner_dtype else set())
        ),
        *([f"round_{lowering.low.name}"] if lowering.uses_round else []),
        *([f"bits_{lowering.low.name}"] if lowering.uses_bits else []),
        *([f"round_{lowering.low.name}_nan", f"narrow_{lowering.low.name}_nan"] if lowering.uses_nan else []),
        *([f"round_{lowering.grad_rounding}"] if lowering.uses_grad_rounding else []),
        *(["narrow_bfloat16_sr", "sr_param_key"] if kernel.stochastic else []),
    ]
    lines = [f"from {_PACKAGE}.intrinsics import {', '.join(intrinsics)}"]
    if emulations:
        lines.append(f"from {_PACKAGE}.sqrt_emulation import {', '.join(emulations)}")
    if conversions:
        lines.append(f"from {_PACKAGE}.conversions import {', '.join(conversions)}")
    return lines


def _kernel_function(name, loop, scratch, setup, inner) -> list:
    """One kernel: each of ``nthreads`` threads (``thread``) runs its items (``item``: a slice
    of one parameter's tensors; ``layout``: see ``layout.pack_layout``)."""
    return [
        f"def {name}(nthreads, layout, addresses, scalar_rows, sqrt_routine):",
        f"    for thread in {loop}(nthreads):",
        "        wide_vectors()",
        *_indent(scratch, 2),
        "        for item in range(layout[2 + thread], layout[3 + thread]):",
        *_indent(setup, 3),
        *_indent(inner, 3),
        # numba frees an array after its last use, and the loop reaches the scratch by address
        # only: used here, it lives until the thread's items are done (test_scratch_lifetime)
        *(["        scratch[0] = 0"] if scratch else []),
        "",
        "",
    ]


def _item_setup(row_names, tails=False, ids_row=None) -> list:
    """An item's parameter, its row of scalars, and its slice ``[start, start + count)``; with
    ``tails``, its flag ``tail`` too (the item lies in torch's scalar tail: layout.partition);
    with ``ids_row``, its parameter's key ``sr_key`` (stochastic rounding)."""
    return [
        f"item_at = layout[0] + {4 if tails else 3} * item",
        "param_index = layout[item_at]",
        "row = layout[layout[1] + param_index]",
        *(f"{name} = scalar_rows[row, {k}]" for k, name in enumerate(row_names)),
        "start = layout[item_at + 1]",
        "count = layout[item_at + 2] - start",
        *(["tail = layout[item_at + 3] != 0"] if tails else []),
        *([] if ids_row is None else [f"sr_key = sr_param_key(s_sr_hi, s_sr_lo, {_ids(ids_row)})"]),
        # the slice's own pointer and a loop from 0: numba then knows no index is negative (no
        # wraparound code), and LLVM vectorizes the loop
    ]


def _ids(row: int) -> str:
    """An item's parameter's id (its random bits' key: stochastic rounding)."""
    return f"addresses[{row}, param_index]"


def _pointer(kernel: KernelParts, tensor: str) -> str:
    return "u16ptr" if tensor in kernel.low else "f32ptr"


def _slice_loop(kernel: KernelParts) -> list:
    """A program without a sqrt: one loop over the slice, every input read once, every target
    written once."""
    lowering = kernel.lowering
    views = [
        f"{kernel.view(t)} = carray({_pointer(kernel, t)}(addresses[{r}, param_index] + "
        f"{kernel.element_size(t)} * start), count)"
        for r, t in enumerate(kernel.tensors)
    ]
    body = [
        *(f"{lowering.value(t, 0)} = {kernel.load(t, 'i')}" for t in lowering.loads),
        *(rec.line for rec in lowering.records),
        *kernel.stores(kernel.targets),
    ]
    return [*views, "for i in range(count):", *_indent(body)]


def _chunk_address(row: int, tensor: str) -> str:
    """The local holding the address of the tensor's chunk (or of its padded copy)."""
    return local_name("addr", row, tensor)


def _padded_address(row: int, tensor: str) -> str:
    """The local holding the address of the tensor's zero-padded copy of a partial chunk."""
    return local_name("pad", row, tensor)


def _chunk_loop(kernel: KernelParts, sqrt_kind: str):
    """A program with a sqrt: ``(scratch, loop, intrinsics)``, the slice walked in chunks of
    SQRT_CHUNK elements (see docs/numba-engine.md: the passes of a chunk). A slice's last,
    partial chunk runs the same passes on zero-padded copies, then copies back what it wrote."""
    # (a 16-bit target is stored once, rounded: the passes after the first read its float32
    # value recomputed, not stored early)
    late = tuple(t for t in kernel.targets if t in kernel.low)
    early, passes = sqrt_passes(kernel.lowering, kernel.targets, late)
    body, buffers = chunk_passes(kernel, early, passes, sqrt_kind)
    size = {t: kernel.element_size(t) for t in kernel.tensors}
    addr = {t: _chunk_address(r, t) for r, t in enumerate(kernel.tensors)}
    pad = {t: _padded_address(r, t) for r, t in enumerate(kernel.tensors)}
    at = {
        t: f"addresses[{r}, param_index] + {size[t]} * (start + chunk_start)"
        for r, t in enumerate(kernel.tensors)
    }
    prefetch = {t: f"prefetch{_CHUNK_BYTES // 4 * size[t] // 64}" for t in kernel.tensors}
    written = [t for t in kernel.tensors if t in {*kernel.targets, "partner"}]
    loop = [
        f"for chunk_start in range(0, count, {SQRT_CHUNK}):",
        *_indent(
            [
                f"chunk_count = min(count - chunk_start, {SQRT_CHUNK})",
                *(f"{addr[t]} = {at[t]}" for t in kernel.tensors),
                # every line of the chunk PREFETCH_CHUNKS ahead (a hint: never faults)
                *(
                    f"{prefetch[t]}({addr[t]} + {PREFETCH_CHUNKS * _CHUNK_BYTES // 4 * size[t]})"
                    for t in kernel.tensors
                ),
                # a partial chunk: zero-padded copies (a partner is only written: nothing to copy in)
                f"if chunk_count < {SQRT_CHUNK}:",
                *_indent(
                    f"{addr[t]} = "
                    + (
                        pad[t]
                        if t == "partner"
                        else f"pad_copy({pad[t]}, {addr[t]}, {size[t]} * chunk_count, {_CHUNK_BYTES})"
                    )
                    for t in kernel.tensors
                ),
                *body,
                f"if chunk_count < {SQRT_CHUNK}:",
                *_indent(
                    f"pad_copy({at[t]}, {pad[t]}, {size[t]} * chunk_count, {size[t]} * chunk_count)"
                    for t in written
                ),
            ]
        ),
    ]
    scratch = _scratch(kernel, buffers, pad)
    return scratch, loop, ["call_sqrt_at", "pad_copy", *sorted(set(prefetch.values()))]


def _scratch(kernel: KernelParts, buffers: list, pad: dict) -> list:
    """One allocation per thread (each np.empty adds to the compile time): the chunks' argument
    and root buffers, then a zero-padded copy of a partial chunk per tensor."""
    return [
        f"scratch = np.empty({SQRT_CHUNK * (len(buffers) + len(kernel.tensors))}, np.float32)",
        "scratch_at = scratch.ctypes.data",
        *(
            f"{buf} = carray(f32ptr(scratch_at + {_CHUNK_BYTES * n}), {SQRT_CHUNK})"
            for n, buf in enumerate(buffers)
        ),
        *(
            f"{pad[t]} = scratch_at + {_CHUNK_BYTES * (len(buffers) + r)}"
            for r, t in enumerate(kernel.tensors)
        ),
    ]


def chunk_passes(kernel: KernelParts, early: list, passes: list, sqrt_kind: str, size: int = SQRT_CHUNK):
    """``(lines, buffers)``: a chunk's views, its passes (pass ``k`` stores the ``k``-th
    sqrt's arguments in ``args<k>``, the roots are taken into ``roots<k>``; the last pass runs
    with every root and stores the targets), and the scratch buffers they use. ``size``: the
    chunk's elements (the 8-bit kernels' blocks are the quantization blocks, ``blockwise``)."""
    lowering = kernel.lowering
    lines = [
        f"{kernel.view(t)} = carray({_pointer(kernel, t)}({_chunk_address(r, t)}), {size})"
        for r, t in enumerate(kernel.tensors)
    ]
    buffers = []
    for k, one in enumerate(passes[:-1]):
        arg = f"arg{k}"
        # a root of a value pass 0 stores (Adam's exp_avg_sq.sqrt()) is taken from the target's
        # own chunk, not from a copy in args<k>
        stored = [
            t
            for t in (early if k == 0 else ())
            if any(rec.local == arg and rec.expr == lowering.current[t] for rec in one.records)
        ]
        args = kernel.view(stored[0]) if stored else f"args{k}"
        loads = (
            _pass_loads(kernel, early, one)
            if k
            else [f"{lowering.value(t, 0)} = {kernel.load(t, 'i')}" for t in one.loads]
        )
        body = [
            *loads,
            *(rec.line for rec in one.records if not (stored and rec.local == arg)),
            *([] if stored else [f"args{k}[i] = {arg}"]),
            # pass 0 also stores the targets whose final value it has computed
            *(f"{kernel.view(t)}[i] = {lowering.current[t]}" for t in (early if k == 0 else ())),
        ]
        lines += [f"for i in range({size}):", *_indent(body), *_roots(sqrt_kind, args, f"roots{k}", size)]
        buffers += [*([] if stored else [f"args{k}"]), f"roots{k}"]
    last = passes[-1]
    body = [
        *_pass_loads(kernel, early, last),
        *(rec.line for rec in last.records),
        *kernel.stores([t for t in kernel.targets if t not in early], "start + chunk_start + i"),
    ]
    return lines + [f"for i in range({size}):", *_indent(body)], buffers


def _pass_loads(kernel: KernelParts, early: list, one) -> list:
    """A later pass's loads: its inputs, and the values pass 0 stored that it reads back."""
    lowering = kernel.lowering
    needed = frozenset().union(*(rec.uses for rec in one.records))
    return [
        *(f"{lowering.value(t, 0)} = {kernel.load(t, 'i')}" for t in one.loads),
        *(f"{lowering.current[t]} = {kernel.view(t)}[i]" for t in early if lowering.current[t] in needed),
    ]


def _roots(kind: str, args: str, roots: str, size: int = SQRT_CHUNK) -> list:
    """The lines that take a chunk's roots, ``args`` -> ``roots`` (SQRT_CHUNK elements, of which
    the first ``chunk_count`` are the slice's: the rest is a partial chunk's zero padding)."""
    if kind == "routine":  # sqrt_routine == 0: torch's sqrt is correctly rounded
        return [
            "if sqrt_routine == 0:",
            f"    for i in range({size}):",
            f"        {roots}[i] = np.sqrt({args}[i])",
            "else:",
            f"    call_sqrt_at(sqrt_routine, chunk_count, {args}.ctypes.data, {roots}.ctypes.data)",
        ]
    # a chunk with any lane off the emulation's path goes to the routine whole: no call inside
    # the loop, whose vector constants then stay in registers (a call clobbers them all). The
    # last (chunk_count % SQRT_LANES) elements of a partial chunk go to the routine on their
    # own (the emulation is MKL's main loop; these are its remainder).
    return [
        f"args_at = {args}.ctypes.data",
        f"roots_at = {roots}.ctypes.data",
        "off_path = 0",
        f"for i in range(0, {size}, {SQRT_LANES}):",
        f"    off_path |= {EMULATION_INTRINSICS[kind]}(args_at + 4 * i, roots_at + 4 * i)",
        "if off_path:",
        f"    call_sqrt_at(sqrt_routine, {size}, args_at, roots_at)",
        f"grouped = chunk_count - (chunk_count & {SQRT_LANES - 1})",
        "if grouped < chunk_count:",
        "    call_sqrt_at(sqrt_routine, chunk_count - grouped, args_at + 4 * grouped,"
        " roots_at + 4 * grouped)",
    ]
