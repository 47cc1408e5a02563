"""What a staged pass's kernels must reproduce, measured at first use: the order of torch's
norms (``torch_reductions``: the lanes and fused multiply-adds with which ``staged``'s kernels
give its bits, tried on probe tensors) and whether torch fuses a mixed-precision ``add_``
(``torch_mixed_fusion``).
"""

from __future__ import annotations

import numpy as np
import torch

from .kernels import keep_torch_threads
from .staged import as_tensor, prepare

_orders: list = []
_mixed: list = []


def torch_reductions():
    """``(lanes, (column fma, tail fma))`` with which the kernels reproduce this torch's ``x.norm()``,
    ``torch.norm(x, dim=-1)`` and ``torch.norm(x, dim=-2)`` bit for bit on probe tensors
    (shapes with and without a tail, batches, sizes that split across torch's threads), or None
    where no form tried does (the passes then run torch's own ops)."""
    if not _orders:
        with keep_torch_threads():  # the probe's kernels start numba's pool: torch's count kept
            _orders.append(_measure_reductions())
    return _orders[0]


def _probe_program():
    from ...spec.ir import ProgramBuilder

    b = ProgramBuilder(["param"])
    x = b.tensor("param")
    b.norm("all", x)
    b.norm("rows", x, dim=-1)
    b.norm("cols", x, dim=-2)
    return b.build()


# the shapes whose reductions the kernels take (``column_norms_reproduced``): tails of whole-tensor and
# single-row norms, batches, columns of one, rows a whole number of lanes long
_PROBE_SHAPES = (
    (1, 5),
    (1, 9),
    (1, 1),
    (2, 16),
    (3, 1, 16),
    (2, 8, 24),
    (1, 4099),
    (5000, 16),
    (1, 13),
    (64, 40),
    (300, 7),
    (40, 3),
    (33, 17),
    (2, 3, 11),
    (1, 2),
    (4, 2),
    (2, 1, 3),
)


def _measure_reductions():
    gen = torch.Generator().manual_seed(0)
    probes = [torch.randn(s, generator=gen) * 3 for s in _PROBE_SHAPES]
    probes += [x * 1e-20 for x in probes[:8]]  # squares that underflow: one element is |x|
    probes.append(torch.randn(1, 1 << 20, generator=gen))  # a whole-tensor norm torch may split
    program = _probe_program()
    expected = [
        (x.norm(2), torch.norm(x, dim=-1, keepdim=True), torch.norm(x, dim=-2, keepdim=True)) for x in probes
    ]
    for lanes in (8, 16):
        for order in ((False, True), (False, False), (True, True), (True, False)):
            launch = prepare(program, [{}] * len(probes), [{"param": x} for x in probes], (), lanes, order, 1)
            if launch is None:  # a shape these kernels do not take
                continue
            got = launch()
            if all(
                torch.equal(as_tensor(g["all"]), e[0])
                and torch.equal(g["rows"], e[1])
                and torch.equal(g["cols"], e[2])
                for g, e in zip(got, expected, strict=True)
            ):
                return lanes, order
    return None


def torch_mixed_fusion():
    """Whether torch computes ``param.add_(other, alpha=a)`` with a bfloat16 ``other`` (Muon's
    update) as one fused multiply-add (True), two roundings (False), or neither (None)."""
    if not _mixed:
        gen = torch.Generator().manual_seed(1)
        p, b = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen).bfloat16()
        alpha = -0.0123456
        got = p.clone().add_(b, alpha=alpha).numpy()
        a, bw, pw = (np.float64(np.float32(alpha)), b.double().numpy(), p.double().numpy())
        fused = (a * bw + pw).astype(np.float32)
        twice = (pw + (a * bw).astype(np.float32)).astype(np.float32)
        _mixed.append(True if np.array_equal(got, fused) else False if np.array_equal(got, twice) else None)
    return _mixed[0]
