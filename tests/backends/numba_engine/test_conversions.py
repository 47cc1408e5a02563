"""A pairing's dtype conversions (``numba_engine/conversions.py``), bit for bit torch's."""

import numba
import numpy as np
import pytest
import torch

from roundpipe.optim.backends.numba_engine import probes
from tests._util import assert_bits_equal


def _conversion_inputs():
    """float32 whose narrowing is hard: every float16/bfloat16 value widened, and each of them
    with the low bits just below, at and just above the halfway point (ties both ways), the
    subnormal and overflow edges, signed zeros and infinities, NaNs with payloads (quiet and
    signalling, both signs), and a million random bit patterns."""
    h = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    widened = torch.cat([h.view(torch.float16).float(), h.view(torch.bfloat16).float()]).view(torch.int32)
    near = [widened + d for d in (0, 1, -1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x7FFF, 0x8000, 0x8001)]
    g = torch.Generator().manual_seed(7)
    rand = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor(
        [0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00001, 0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF, 0x80000000]
        + [0x477FE000, 0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001, 0x387FC000, 0x38800000],
        dtype=torch.int64,
    ).to(torch.int32)
    x = torch.cat([*near, rand, edges])
    pad = -x.numel() % 64  # torch's vectorized loops only, as the engine's kernels see
    return torch.cat([x, torch.zeros(pad, dtype=torch.int32)]).view(torch.float32)


@pytest.mark.parametrize("f16c", [False, True], ids=["integer-sequences", "f16c"])
def test_low_precision_conversions_are_torchs(f16c):
    """The pairing's conversions (``conversion_intrinsics``: float32 -> bfloat16/float16 bits as
    ``partner.copy_(master)`` rounds, and back as ``.float()`` widens) equal torch's vectorized
    CPU conversions bit for bit on ``_conversion_inputs`` and on all 2**16 bit patterns, in both
    forms: the integer sequences every x86-64 runs and F16C's instructions (where numba's target
    has them). (Checked once over all 2**32 float32 on an Intel Xeon: equal.)"""
    from roundpipe.optim.backends.numba_engine import conversions

    if f16c and "f16c" not in probes.target_features():
        pytest.skip("numba's target lacks F16C")
    conv = conversions.conversion_intrinsics(f16c)
    narrow_bf16, narrow_f16 = conv["narrow_bfloat16"], conv["narrow_float16"]
    widen_bf16, widen_f16 = conv["widen_bfloat16"], conv["widen_float16"]

    @numba.njit
    def narrow(x, bf, hf):
        for i in range(x.size):
            bf[i] = narrow_bf16(x[i])
            hf[i] = narrow_f16(x[i])

    @numba.njit
    def widen(h, bf, hf):
        for i in range(h.size):
            bf[i] = widen_bf16(h[i])
            hf[i] = widen_f16(h[i])

    x = _conversion_inputs()
    bf, hf = torch.empty(x.shape, dtype=torch.int16), torch.empty(x.shape, dtype=torch.int16)
    narrow(x.numpy(), bf.numpy().view(np.uint16), hf.numpy().view(np.uint16))
    # compared as integers: NaNs by their bits too
    assert_bits_equal(bf, x.to(torch.bfloat16).view(torch.int16), "narrow to bfloat16")
    assert_bits_equal(hf, x.to(torch.float16).view(torch.int16), "narrow to float16")
    h = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    wb, wh = torch.empty(h.shape), torch.empty(h.shape)
    widen(h.numpy().view(np.uint16), wb.numpy(), wh.numpy())
    want_b, want_h = h.view(torch.bfloat16).float(), h.view(torch.float16).float()
    assert_bits_equal(wb.view(torch.int32), want_b.view(torch.int32), "widen bfloat16")
    assert_bits_equal(wh.view(torch.int32), want_h.view(torch.int32), "widen float16")
