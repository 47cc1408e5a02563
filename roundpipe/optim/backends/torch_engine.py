"""The torch engine of the ``fast`` backend: a spec program as a list of torch ``out=`` ops,
run over cache-sized chunks, the chunks shared out to roundpipe's threads.

torch's own for-loop allocates a full-size temporary for each intermediate (``sqrt()``,
``/``), which on tensors far above the L3 cache costs page faults and memory traffic. This
engine compiles a program once into a linear list of instructions over a few scratch slots,
then runs the list over chunks (``chunk_size``), so every intermediate stays in cache and
nothing is allocated per step apart from the small scratch slots. Each instruction is the torch
op of the same name (``torch_ops.py``), so results equal the reference backend's, op for op.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .. import threads
from ..spec.core import GRAD_FACTOR, factors_of
from ..spec.ir import Assign, Bin, Const, Let, Scalar, Tensor
from ..spec.modes import param_rounding
from ..storage import param_key, stochastic_round_
from ..tensors import LOW_PRECISION
from .low_precision import torch_chunks
from .torch_ops import BINARY, COMPARISONS, FUNCTIONS

# Elements per chunk: as many as keep a chunk's working set (each tensor the program touches,
# and each scratch slot) near WORKING_SET bytes, a power of two between MIN_CHUNK and MAX_CHUNK.
# Every chunk costs Python per op and slice, paid under the GIL, so short programs want larger
# chunks; long ones want their many operands to stay in cache (the chunk sizes measured:
# docs/benchmarks.md, "Measurements behind the code's constants").
WORKING_SET = 8 << 20
MIN_CHUNK, MAX_CHUNK = 1 << 18, 1 << 19


def chunk_size(n_arrays: int) -> int:
    """Elements per chunk for a program touching ``n_arrays`` float32 arrays (tensors, slots)."""
    fit = WORKING_SET // (4 * max(n_arrays, 1))
    return max(MIN_CHUNK, min(MAX_CHUNK, 1 << (fit.bit_length() - 1)))


@dataclass(frozen=True)
class Ref:
    kind: str  # "t" input tensor, "s" scalar, "c" constant, "r" float32 slot, "b" bool slot
    key: object


@dataclass(frozen=True)
class Instr:
    op: object  # a callable from torch_ops taking (*args, out=...)
    out: Ref
    args: tuple


@dataclass
class TorchProgram:
    instrs: tuple
    n_float: int
    n_bool: int
    chunk: int  # elements per chunk (``chunk_size``)
    targets: tuple = ()
    storage: str = ""  # the program's (ir.Program.storage): "" or stepped widened
    _local: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    def _slots(self, size: int, dtype=torch.float32):
        """This thread's scratch slots of ``size`` elements, the float ones of ``dtype`` (the
        parameter's: each op rounds to it, as the for-loop's temporaries do); kept for the next
        call."""
        cache = getattr(self._local, "slots", None)
        if cache is None:
            cache = self._local.slots = {}
        slots = cache.get(dtype)
        if slots is None or slots[0] < size:
            f = [torch.empty(size, dtype=dtype) for _ in range(self.n_float)]
            b = [torch.empty(size, dtype=torch.bool) for _ in range(self.n_bool)]
            slots = cache[dtype] = (size, f, b)
        return slots

    def run_range(self, flat: dict, start: int, stop: int, scalars: dict, pid=None):
        """Run on elements ``[start, stop)`` of ``flat`` (name -> 1-D tensor) in place. A program
        stored widened reads the chunk of each tensor that is not float32 widened (into a slot
        of its own), runs in float32 and rounds each such target back (``_store``)."""
        m = stop - start
        size, fslots, bslots = self._slots(m, torch.float32 if self.storage else flat["param"].dtype)
        env_t = {name: t[start:stop] for name, t in flat.items()}
        narrow = {}
        if self.storage:
            wide = self._wide_slots(m, [n for n, t in env_t.items() if t.dtype is not torch.float32])
            own = "grad" in wide and flat["grad"].dtype is flat["param"].dtype  # (not a partner's)
            factors = factors_of(scalars) if own else ()
            for name, slot in wide.items():
                narrow[name] = piece = env_t[name]
                for f in factors if name == "grad" else ():  # (reference.unscaled: in its dtype)
                    piece = piece * f
                env_t[name] = slot.copy_(piece)
            if factors:
                scalars = {**scalars, **{f"{GRAD_FACTOR}{i}": 1.0 for i in range(len(factors))}}
        env_r = fslots if m == size else [s[:m] for s in fslots]
        env_b = bslots if m == size else [s[:m] for s in bslots]
        for ins in self.instrs:
            args = [_get(a, env_t, env_r, env_b, scalars) for a in ins.args]
            ins.op(*args, out=_get(ins.out, env_t, env_r, env_b, scalars))
        for name in self.targets:
            if name in narrow:
                self._store(narrow[name], env_t[name], name, scalars, pid, start)

    def _store(self, out, value, name, scalars, pid, start):
        """A widened target's chunk back in its dtype: nearest even (``copy_``), or a STOCHASTIC
        program's parameter rounded stochastically (its elements from ``start`` on)."""
        if name == "param" and param_rounding(self.storage) == "stochastic":
            key = (int(scalars["sr_hi"]) << 16) | int(scalars["sr_lo"])
            stochastic_round_(out, value, param_key(key, pid), start)
        else:
            out.copy_(value)

    def _wide_slots(self, size: int, names) -> dict:
        """This thread's float32 copies of ``size`` elements of the tensors ``names`` (a widened
        program's chunks of its 16-bit tensors)."""
        cache = getattr(self._local, "wide", None)
        if cache is None or cache[0] < size:
            cache = self._local.wide = (size, {})
        slots = cache[1]
        for name in names:
            if name not in slots:
                slots[name] = torch.empty(cache[0])
        return {name: slots[name][:size] for name in names}

    def run(self, tensors: dict, scalars: dict, chunk: int | None = None):
        """Run in place on ``tensors`` (name -> real float32 tensor, all the same shape)."""
        self.run_parallel([tensors], scalars, 1, chunk)

    def run_parallel(self, units, scalars: dict, nthreads: int, chunk: int | None = None):
        """Run in place on every unit (name -> same-shaped real float32, bfloat16 or float16
        tensors) in chunks of ``chunk`` (default ``self.chunk``) elements, on ``nthreads``
        threads taking chunks as they go, with torch's intra-op pool held at one thread (so each
        op is one plain loop, no parallel region). A bfloat16 or float16 unit is cut where the
        for-loop's ops cut it on torch's threads (``low_precision.torch_chunks``), whose tails
        round otherwise, and its chunks (multiples of any vector loop's step) from there; a
        program stored widened is torch's float32 step (no such cuts). A unit's ``"sr_ids"``: its
        parameter's id (stochastic rounding)."""
        chunk = chunk or self.chunk
        torch_threads = torch.get_num_threads()
        work = []
        for unit in units:
            pid = unit.get("sr_ids")
            flat = {name: t.detach().view(-1) for name, t in unit.items() if name != "sr_ids"}
            n = flat["param"].numel()
            low = flat["param"].dtype in LOW_PRECISION and not self.storage
            spans = torch_chunks(n, torch_threads) if low else [(0, n)]
            for begin, end in spans:
                work.extend((flat, lo, min(lo + chunk, end), pid) for lo in range(begin, end, chunk))

        def one(item):
            self.run_range(item[0], item[1], item[2], scalars, item[3])

        with threads.torch_threads(1):
            threads.run_parallel(work, one, nthreads)


def _get(ref, env_t, env_r, env_b, scalars):
    k = ref.kind
    if k == "t":
        return env_t[ref.key]
    if k == "r":
        return env_r[ref.key]
    if k == "s":
        return scalars[ref.key]
    if k == "c":
        return ref.key
    return env_b[ref.key]


def _copy(x, out=None):
    return out.copy_(x)


class _Linearizer:
    def __init__(self):
        self.instrs: list = []
        self.free = {"r": [], "b": []}
        self.count = {"r": 0, "b": 0}
        self.lets: dict = {}  # let name -> Ref of its slot (never freed)

    def slot(self, kind):
        if self.free[kind]:
            return Ref(kind, self.free[kind].pop())
        self.count[kind] += 1
        return Ref(kind, self.count[kind] - 1)

    def release(self, ref):
        if ref.kind in ("r", "b") and ref not in self.lets.values():
            self.free[ref.kind].append(ref.key)

    def emit(self, e, out=None) -> Ref:
        if isinstance(e, Tensor):
            ref = self.lets.get(e.name) or Ref("t", e.name)
            if out is not None:
                self.instrs.append(Instr(_copy, out, (ref,)))
                return out
            return ref
        if isinstance(e, Scalar):
            return Ref("s", e.name)
        if isinstance(e, Const):
            return Ref("c", e.value)
        if isinstance(e, Bin):
            op, children = BINARY[e.op], (e.a, e.b)
        else:
            op, children = FUNCTIONS[e.fn], e.args
        args = tuple(self.emit(c) for c in children)
        for a in args:
            self.release(a)
        if out is None:
            out = self.slot("b" if isinstance(e, Bin) and e.op in COMPARISONS else "r")
        self.instrs.append(Instr(op, out, args))
        return out


def compile_program(program) -> TorchProgram:
    lin = _Linearizer()
    for st in program.statements:
        if isinstance(st, Let):
            ref = lin.emit(st.expr)
            if ref.kind != "r" or ref in lin.lets.values():
                # a let of a bare tensor or of another let: a snapshot in its own slot
                ref = lin.emit(st.expr, out=lin.slot("r"))
            lin.lets[st.name] = ref
        elif isinstance(st, Assign):
            lin.emit(st.expr, out=Ref("t", st.target))
    tensors = {a.key for ins in lin.instrs for a in (ins.out, *ins.args) if a.kind == "t"}
    n_arrays = len(tensors) + lin.count["r"] + (lin.count["b"] + 3) // 4  # a bool is 1 byte
    return TorchProgram(
        tuple(lin.instrs),
        lin.count["r"],
        lin.count["b"],
        chunk_size(n_arrays),
        tuple(program.targets),
        program.storage,
    )
