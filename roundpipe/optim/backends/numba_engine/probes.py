"""What the kernels must reproduce of this process's torch and CPU, measured once per process:
which functions torch fuses into a multiply-add, which routine its ``sqrt`` runs, what numba's
target CPU has, and which emulation of MKL's sqrt kernel equals ``torch.sqrt``.

Nothing here compiles a kernel: the sqrt emulation probe is handed a function that runs one
(``find_sqrt_kind``), so compiling (``kernels.py``) depends on the probes, never the reverse.
Results are computed once under a lock, then read-only.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch

from .config import EMULATION_FEATURES, SQRT_CHUNK, SQRT_KINDS, VML_MODE, import_numba

logger = logging.getLogger("roundpipe.optim")

_F32 = np.float32
_lock = threading.Lock()
_fusion = None
_sqrt = None


# -- torch's fused multiply-adds ----------------------------------------------------------------


def torch_fusion():
    """``(fused, exact)``: which of ``add`` (with alpha), ``addcmul`` and ``lerp`` this torch
    computes with a fused multiply-add, and whether each matched one of the two formulas exactly.

    torch's vectorized CPU kernels (AVX2, AVX-512) compute ``add(a, b, alpha)`` as
    ``fma(alpha, b, a)``, ``addcmul`` as ``fma(value * b, c, a)`` and ``lerp`` as
    ``fma(w, end - start, start)`` (or from the end); its generic build does not. The kernels
    call ``fma`` exactly where this torch does.
    """
    global _fusion
    if _fusion is None:
        with _lock:
            if _fusion is None:
                _fusion = _measure_fusion()
    return _fusion


def _fma(x, y, z):
    """float32 ``x * y + z`` rounded once (the float64 product and sum of float32 are exact)."""
    f64 = np.float64
    return (np.asarray(x, f64) * np.asarray(y, f64) + np.asarray(z, f64)).astype(_F32)


def _measure_fusion():
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4099, generator=gen) for _ in range(3))
    A, B, C = (x.numpy() for x in (a, b, c))
    s, w, v = _F32(0.3), _F32(0.3), _F32(0.7)
    v_comp = v - _F32(1)
    cases = {  # name: (torch's result, the formula rounded at each op, the same with an FMA)
        "add": (torch.add(a, b, alpha=0.3), A + s * B, _fma(s, B, A)),
        "addcmul": (torch.addcmul(a, b, c, value=0.3), A + (s * B) * C, _fma(s * B, C, A)),
        "lerp": (
            torch.cat([torch.lerp(a, b, float(w)), torch.lerp(a, b, float(v))]).numpy(),
            np.concatenate([A + w * (B - A), v_comp * (B - A) + B]),
            np.concatenate([_fma(w, B - A, A), _fma(v_comp, B - A, B)]),
        ),
    }
    fused, exact = set(), True
    for name, (got, rounded_twice, rounded_once) in cases.items():
        got = np.asarray(got)
        if np.array_equal(got, rounded_twice):
            continue
        fused.add(name)
        if not np.array_equal(got, rounded_once):
            exact = False
            logger.warning("torch.%s rounds neither like a*b+c nor like fma(a, b, c) here", name)
    return frozenset(fused), exact


# -- torch's sqrt -------------------------------------------------------------------------------


def vml_sqrt_address() -> int:
    """The address of MKL's ``vmsSqrt`` in the libtorch this process loaded, or 0."""
    import ctypes

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        path = os.path.join(lib_dir, name)
        if not os.path.exists(path):
            continue
        try:
            fn = ctypes.CDLL(path).vmsSqrt
        except (OSError, AttributeError):
            return 0
        return ctypes.cast(fn, ctypes.c_void_p).value or 0
    return 0


def probe_values() -> torch.Tensor:
    """The sqrt probes' 131,080 float32: subnormal to huge, uniform on [0, 10), and specials."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.empty(1 << 16).uniform_(-104.0, 89.0, generator=gen).exp()  # subnormal to huge
    unit = torch.rand(1 << 16, generator=gen) * 10
    special = torch.tensor([0.0, -0.0, -1.0, float("inf"), -float("inf"), float("nan"), 1e-45, 4.0])
    return torch.cat([wide, unit, special])


def float_bits(x: np.ndarray) -> np.ndarray:
    """float32 bits, every NaN as one pattern (payloads are not compared)."""
    bits = x.view(np.int32).copy()
    bits[np.isnan(x)] = 0x7FC00000
    return bits


def torch_sqrt():
    """``(address, what, exact)``: the sqrt routine this torch's CPU ``sqrt`` runs.

    ``address`` is that of MKL's ``vmsSqrt`` when it gives torch's bits exactly on the probe
    values (the x86-64 wheels), else 0: the kernels then take the correctly rounded sqrt.
    ``exact`` says whether the chosen one equals torch's ``sqrt`` on every probe value.
    """
    global _sqrt
    if _sqrt is None:
        with _lock:
            if _sqrt is None:
                _sqrt = _measure_sqrt()
    return _sqrt


def _measure_sqrt():
    import ctypes

    x = probe_values()
    want = float_bits(torch.sqrt(x).numpy())
    address = vml_sqrt_address()
    if address:
        fn = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)
        out = torch.empty_like(x)
        for lo in range(0, x.numel(), SQRT_CHUNK):  # in the kernels' chunks
            n = min(SQRT_CHUNK, x.numel() - lo)
            fn(n, x.data_ptr() + 4 * lo, out.data_ptr() + 4 * lo, VML_MODE)
        if np.array_equal(float_bits(out.numpy()), want):
            return address, "MKL vmsSqrt, as torch.sqrt (bit for bit on the probe)", True
    with np.errstate(invalid="ignore"):
        rounded = float_bits(np.sqrt(x.numpy()))
    if np.array_equal(rounded, want):
        return 0, "correctly rounded, as torch.sqrt (bit for bit on the probe)", True
    differ = int((rounded != want).sum())
    msg = (
        f"correctly rounded; torch.sqrt here is neither that nor MKL's vmsSqrt ({differ} of "
        f"{x.numel()} probe values differ): programs with a sqrt may differ from torch by an ulp"
    )
    logger.warning("roundpipe.optim numba engine: sqrt is %s", msg)
    return 0, msg, False


# -- the CPU numba compiles for -----------------------------------------------------------------


def target_features() -> frozenset:
    """The CPU features numba compiles for (names without the ``+``): this CPU's, unless
    ``NUMBA_CPU_NAME`` names another target (e.g. ``generic``, for caches shared between
    machines): then only those ``NUMBA_CPU_FEATURES`` lists. numba keys its disk cache on the
    same target, so code chosen by these features is never loaded where they are missing."""
    import llvmlite.binding as llvm

    numba = import_numba()
    if numba.config.CPU_NAME and numba.config.CPU_NAME != "host":
        listed = numba.config.CPU_FEATURES or ""
    else:
        listed = llvm.get_host_cpu_features().flatten()
    return frozenset(f[1:] for f in listed.split(",") if f.startswith("+"))


def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``), or ``""``."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def probe_order() -> list:
    """The emulations numba's target can run, the likeliest match first: MKL runs its AVX-512
    kernel on Intel CPUs that have AVX-512, and its SSE/AVX kernels on other vendors' (an AMD
    EPYC with AVX-512 takes the SSE sequence)."""
    features = target_features()
    kinds = [k for k in SQRT_KINDS[1:] if EMULATION_FEATURES[k] in features]
    if "emulated-avx512" in kinds and cpu_vendor() == "GenuineIntel":
        kinds.insert(0, kinds.pop(kinds.index("emulated-avx512")))
    return kinds


# -- which emulation of MKL's sqrt kernel equals torch.sqrt ------------------------------------


def find_sqrt_kind(run_root_kernel) -> str:
    """The first emulation (``probe_order``) whose kernel equals ``torch.sqrt`` bit for bit on
    every probe value, else ``routine`` (also where torch's sqrt is not MKL's, or not on x86-64).

    ``run_root_kernel(kind, out, x, address)`` compiles the kernel ``param = sqrt(grad)`` with
    that ``kind`` and runs it on ``grad=x``, ``param=out`` with the routine at ``address``.
    """
    import platform

    address = torch_sqrt()[0]
    if not address or platform.machine().lower() not in ("x86_64", "amd64"):
        return "routine"
    x = probe_values()
    want = float_bits(torch.sqrt(x).numpy())
    for kind in probe_order():
        out = torch.empty_like(x)
        try:
            run_root_kernel(kind, out, x, address)
        except Exception as err:  # an intrinsic this LLVM or CPU lacks: the next one
            logger.debug("roundpipe.optim numba engine: sqrt %s unavailable: %s", kind, err)
            continue
        if np.array_equal(float_bits(out.numpy()), want):
            logger.debug("roundpipe.optim numba engine: sqrt %s equals torch.sqrt on the probe", kind)
            return kind
        logger.debug("roundpipe.optim numba engine: sqrt %s differs from torch.sqrt on the probe", kind)
    return "routine"


# -- which exact rsqrt equals torch.rsqrt ----------------------------------------------------


def root_probe_values() -> torch.Tensor:
    """The exact rsqrt probe's float32: every float in [1, 4) (two binades: the root of ``4 * x``
    is that of ``x`` times two, every step scaled exactly), every 61st in the lowest binades the
    fast path takes and in the top one, every 257th subnormal, random bit patterns, and specials
    (zero, inf, NaN, negatives, the largest float)."""
    full = torch.arange(0x3F800000, 0x40800000, dtype=torch.int32)
    low = torch.arange(0x0D800000, 0x0E800000, 61, dtype=torch.int32)  # [2**-100, 2**-98)
    top = torch.arange(0x7F000000, 0x7F800000, 61, dtype=torch.int32)  # [2**127, max]
    subnormal = torch.arange(0, 0x00800000, 257, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    random = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int32)
    inf, largest = float("inf"), 3.4028234663852886e38
    special = torch.tensor([0.0, -0.0, -1.0, inf, -inf, float("nan"), largest, -largest, 2.0**-126, 2**-100])
    bits = torch.cat([full, low, top, subnormal, random])
    return torch.cat([bits.view(torch.float32), special])


def find_root_kind(run_root_kernel) -> str:
    """The first exact rsqrt (``config.ROOT_KINDS``) numba's target can run whose results equal
    ``torch.rsqrt`` bit for bit on every ``root_probe_values``, else ``divider`` (the root and the
    division as instructions, which are torch's by construction).

    ``run_root_kernel(kind, x, out)`` runs that kind's intrinsic on ``x`` into ``out``.
    """
    from .config import ROOT_FEATURES, ROOT_KINDS

    x = root_probe_values()
    want = float_bits(torch.rsqrt(x).numpy())
    features = target_features()
    for kind in ROOT_KINDS[1:]:
        if not all(f in features for f in ROOT_FEATURES[kind]):
            continue
        out = torch.empty_like(x)
        try:
            run_root_kernel(kind, x, out)
        except Exception as err:  # an intrinsic this LLVM lacks: the next one
            logger.debug("roundpipe.optim numba engine: rsqrt %s unavailable: %s", kind, err)
            continue
        if np.array_equal(float_bits(out.numpy()), want):
            logger.debug("roundpipe.optim numba engine: rsqrt %s equals torch.rsqrt on the probe", kind)
            return kind
        logger.debug("roundpipe.optim numba engine: rsqrt %s differs from torch.rsqrt on the probe", kind)
    return "divider"
