"""torch's sqrt in the kernels (``numba_engine/sqrt_emulation.py``, ``probes.py``): the routine
the probe picks, and each emulation of MKL's kernels, bit for bit on a million floats.
"""

import functools
import os
import subprocess

import pytest
import torch

from roundpipe.optim.backends import numba_engine
from roundpipe.optim.backends.numba_engine import probes
from roundpipe.optim.spec.ir import ProgramBuilder, sqrt
from tests._util import assert_bits_equal


def _random_floats(n, seed=0):
    """``n`` float32 of uniformly random bit patterns (every sign, exponent and class), plus
    the probe's values."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    return torch.cat([bits.to(torch.int32).view(torch.float32), probes.probe_values()])


def _rootinputs(seed=0):
    """What a sqrt test takes: 768 Ki positive normal float32 from 2**-72 to 2**127 (exponents
    uniform: the emulations' own path, run sixteen lanes at a time), then 256 Ki random bit
    patterns and the probe's values (lanes handed on to the routine), with block remainders."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.empty(3 << 18).uniform_(-50.0, 88.0, generator=gen).exp()
    x = torch.cat([normal, _random_floats(1 << 18, seed)])
    return x[: x.numel() - x.numel() % numba_engine.SQRT_CHUNK - 7]


@pytest.mark.parametrize("kind", numba_engine.SQRT_KINDS)
def test_sqrt_is_torchs(kind):
    """The probe picks the routine torch's sqrt runs (on x86-64 MKL builds, vmsSqrt) and, where
    it finds one, an emulation of MKL's kernel for this CPU; the kernels' sqrt then equals
    torch.sqrt bit for bit (NaNs by position), blocks and remainders included, on a million
    floats (``_root_inputs``). (Checked once over all 2**32 float32 for the SSE emulation on an AMD
    EPYC: no difference.)"""
    address, what, exact = numba_engine.torch_sqrt()
    assert exact, what
    assert bool(address) == ("vmsSqrt" in what)
    chosen = numba_engine.sqrt_kind()
    assert chosen in numba_engine.SQRT_KINDS
    if kind != "routine" and kind != chosen:
        pytest.skip(f"torch.sqrt here is not the {kind} sequence (the probe chose {chosen})")
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), sqrt(b.tensor("grad")))
    kernel = numba_engine.compile_kernel(b.build(), (), sqrt=kind)
    x = _rootinputs()
    out = torch.zeros_like(x)
    kernel.run({"param": out, "grad": x}, {})
    assert_bits_equal(out, torch.sqrt(x), f"sqrt {kind}")


# MKL's float32 HA sqrt kernel that each emulation reproduces, by its symbol's ISA suffix
_MKL_KERNELS = {"emulated": "EX", "emulated-avx": "H8", "emulated-fma": "L9", "emulated-avx512": "Z0"}


def _mkl_kernel(suffix):
    """MKL's own ``mkl_vml_kernel_sSqrt_<suffix>HAynn`` in the loaded libtorch_cpu (a local
    symbol: its address is vmsSqrt's, exported, plus the distance ``nm`` reads between the two),
    as a ctypes function ``(n, src, dst)``; or None (no nm, no such symbol, not MKL)."""
    import ctypes
    import shutil

    vms = probes.vml_sqrt_address()
    nm = shutil.which("nm")
    if not vms or nm is None:
        return None
    symbols = _sqrt_symbols(nm)
    base, kernel = symbols.get("vmsSqrt"), symbols.get(f"mkl_vml_kernel_sSqrt_{suffix}HAynn")
    if base is None or kernel is None:
        return None
    return ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p)(vms - base + kernel)


@functools.lru_cache(maxsize=1)
def _sqrt_symbols(nm) -> dict:
    """libtorch_cpu's sqrt symbols (name -> offset), read once (nm takes seconds on it)."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    out = subprocess.run([nm, lib], capture_output=True, text=True, check=False).stdout
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "Tt" and (parts[2] == "vmsSqrt" or "_sSqrt_" in parts[2]):
            found[parts[2]] = int(parts[0], 16)
    return found


@pytest.mark.parametrize("kind", sorted(_MKL_KERNELS))
def test_sqrt_emulation_is_mkls_kernel(kind):
    """Each emulation equals the MKL kernel it reads (called directly, whatever MKL would pick
    on this CPU) bit for bit on a million floats (``_root_inputs``), on every CPU that has the
    emulation's instructions: so a kind the probe does not pick here is still checked (the
    AVX-512 one was also checked over all 2**32 float32 on an AMD EPYC with AVX-512, and against
    torch.sqrt on an Intel Xeon that picks it: equal)."""
    if kind not in probes.probe_order():
        pytest.skip(f"this CPU lacks {kind}'s instructions")
    mkl = _mkl_kernel(_MKL_KERNELS[kind])
    if mkl is None:
        pytest.skip("no MKL sqrt kernels found in libtorch_cpu (or no nm)")
    b = ProgramBuilder(("param", "grad"))
    b.assign(b.tensor("param"), sqrt(b.tensor("grad")))
    kernel = numba_engine.compile_kernel(b.build(), (), sqrt=kind)
    x = _rootinputs()
    out, want = torch.zeros_like(x), torch.zeros_like(x)
    mkl(x.numel(), x.data_ptr(), want.data_ptr())
    # the lanes an emulation hands on go to the same kernel
    kernel.run({"param": out, "grad": x}, {}, 1, _address(mkl))
    assert_bits_equal(out, want, f"sqrt {kind} vs MKL's {_MKL_KERNELS[kind]} kernel")


def _address(fn) -> int:
    import ctypes

    return ctypes.cast(fn, ctypes.c_void_p).value
