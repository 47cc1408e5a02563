"""The minimal memory traffic of a step, derived from the spec program it runs (for a staged
spec, Adafactor and Muon: from each of its passes, ``staged_bytes``)."""

from __future__ import annotations

import torch

from roundpipe.optim.spec import SPECS, STAGED_SPECS
from roundpipe.optim.spec.core import Options
from roundpipe.optim.spec.ir import Assign, Tensor, walk
from roundpipe.optim.spec.staged import Pass

from .workloads import OPTIONS

ELEMENT_BYTES = torch.float32.itemsize  # every workload is fp32
STEADY_STEP = 10  # the step whose program gives the traffic: past every optimizer's first steps


def steady_program(name: str):
    """The spec program a step of ``name`` runs with ``OPTIONS[name]`` once past its first steps.

    Its options come from the group (``spec.options``), its flags from ``init_state`` (a step
    that finds the state already there) and from ``scalars`` at step ``STEADY_STEP``, as the
    optimizer's own step computes them.
    """
    spec = SPECS[name]
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    group = spec.torch_class([p], **OPTIONS[name]).param_groups[0]
    state: dict = {}
    spec.init_state(group, p, state)  # the first step creates the state ...
    flags = dict(spec.init_state(group, p, state) or {})  # ... the later ones find it
    scalar_state = {k: state[k] for k in spec.scalar_state}
    for _ in range(STEADY_STEP):
        values = spec.scalars(group, scalar_state)
    flags.update((k, v) for k, v in values.items() if isinstance(v, bool))
    return spec.program({**spec.options(group), **flags})


def traffic(program) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(read, written)``: the tensors a one-pass step must load, and those it must store.

    A tensor is loaded if a statement uses it before any statement assigns it (after that its
    value is the one just computed); every target is stored.
    """
    read: list[str] = []
    assigned: set[str] = set()
    for st in program.statements:
        for node in walk(st.expr):
            name = node.name if isinstance(node, Tensor) else None
            if name in program.tensors and name not in assigned and name not in read:
                read.append(name)
        if isinstance(st, Assign):
            assigned.add(st.target)
    return tuple(read), tuple(program.targets)


def bytes_per_element(name: str) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
    """Minimal bytes a steady-state step of ``name`` moves per fp32 element, and what it reads
    and writes."""
    read, written = traffic(steady_program(name))
    return ELEMENT_BYTES * (len(read) + len(written)), read, written


def partner_bytes(name: str, dtype: torch.dtype, amp: bool = False) -> dict[str, int]:
    """Minimal bytes per element of a steady-state step of ``name`` on fp32 masters paired with
    ``dtype`` partners (``--partners``), by configuration: ``fused``, the one pass, moves the
    master's traffic with the gradient read at ``dtype``'s size instead of 4, plus the partner's
    write; ``composition`` (and ``torch composition``) is the master's step plus the widen pass
    (read the partner's gradient, write the fp32 one) and the round-back pass (read the master,
    write the partner).

    ``amp`` (``--amp``): clipping, and with float16 loss scaling, around the step. The
    composition adds the norm (read 4) and the clip (read 4, write 4), and with float16 the
    unscale with its inf check (read 4, write 4); ``fused`` adds one read of the low-precision
    gradients, which serves both the inf check and the norm."""
    master, read, written = bytes_per_element(name)
    if "grad" not in read or "param" not in written:
        raise ValueError(f"{name}'s program does not read grad and write param: {read} -> {written}")
    low = dtype.itemsize
    fused = master - ELEMENT_BYTES + low + low
    composition = master + (low + ELEMENT_BYTES) + (ELEMENT_BYTES + low)
    if amp:
        scaled = dtype is torch.float16
        composition += 3 * ELEMENT_BYTES + (2 * ELEMENT_BYTES if scaled else 0)
        fused += low
    return {"composition": composition, "fused": fused, "torch composition": composition}


# A staged pass's tensors are float32 but for these scratch tensors: Muon's update, rounded to
# bfloat16 for torch's Newton-Schulz, and what that returns (``spec/muon.py``).
NARROW_BYTES = {("Muon", "update"): 2, ("Muon", "ortho"): 2}


def staged_bytes(name: str, shape) -> tuple[int, tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]]:
    """Minimal bytes per element a step of staged optimizer ``name`` moves on a parameter of
    ``shape``, and each pass's ``(read, written)``.

    Each pass (``spec/staged.py``) is a sweep over the parameter's full-size tensors: its
    ``traffic`` (a tensor used before it is assigned is read once, an assigned one written
    once) at 4 bytes an element (2 for Muon's bfloat16 scratch, ``NARROW_BYTES``), summed over
    the passes. Broadcast inputs (Adafactor's row and column statistics, ``Program.kinds``) are
    left out: ``m + n`` elements against ``m * n``; so are the ``Between`` stages' torch ops
    (on those statistics, or Muon's Newton-Schulz matmuls). An Adafactor matrix: param + grad
    (norms), grad (the update's norm), grad + param read and param written: 24 bytes.
    """
    spec = STAGED_SPECS[name]
    p = torch.nn.Parameter(torch.zeros(shape))
    group = spec.torch_class([p], **OPTIONS[name]).param_groups[0]
    o = spec.options(group, p)
    passes, total = [], 0
    for stage in spec.stages(dict(Options(o))):
        if not isinstance(stage, Pass):
            continue
        program = stage.program
        broadcast = dict(program.kinds)
        read, written = (tuple(n for n in names if n not in broadcast) for names in traffic(program))
        passes.append((read, written))
        total += sum(NARROW_BYTES.get((name, n), ELEMENT_BYTES) for n in (*read, *written))
    return total, tuple(passes)


def workload_bytes(name: str, shapes) -> tuple[float, tuple[str, ...], tuple[str, ...]]:
    """Minimal bytes per element a step of ``name`` moves over tensors of ``shapes``, and what
    it reads and writes: ``bytes_per_element`` for an elementwise optimizer; for a staged one
    ``staged_bytes`` of each tensor weighted by its elements (Adafactor's matrices and vectors
    differ), the reads and writes those of the tensor with the most elements, pass by pass
    (``"1:param"``: pass 1 reads param)."""
    if name in SPECS:
        return bytes_per_element(name)
    total = numel = 0
    largest, most = (), -1
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        nbytes, passes = staged_bytes(name, tuple(shape))
        total, numel = total + nbytes * n, numel + n
        if n > most:
            largest, most = passes, n
    per = total / numel if numel else 0.0
    reads = tuple(f"{k}:{t}" for k, (r, _) in enumerate(largest, 1) for t in r)
    writes = tuple(f"{k}:{t}" for k, (_, w) in enumerate(largest, 1) for t in w)
    return (int(per) if per == int(per) else round(per, 2)), reads, writes
