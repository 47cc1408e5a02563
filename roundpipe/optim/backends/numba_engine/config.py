"""What the numba engine is built with: its tuned constants, the ways of taking a square root,
and numba's import. Why each number has its value, with the measurements: docs/numba-engine.md.
"""

from __future__ import annotations

CACHE_ENV_VAR = "ROUNDPIPE_CACHE_DIR"
INSTALL_HINT = "pip install numba (roundpipe declares it; a wheel, no compiler needed)"
# Keys the on-disk kernel cache: bump it when generated code changes meaning without its text
# changing (or to drop every cached kernel).
GENERATOR_VERSION = 14
# error_model="numpy": x / 0 is IEEE (inf or NaN), not ZeroDivisionError; no fastmath: LLVM
# must neither reassociate nor contract a * b + c (torch's rounding, bit for bit).
JIT_OPTIONS = dict(parallel=True, fastmath=False, error_model="numpy", nogil=True, boundscheck=False)

# A step runs fewer threads when a thread would get fewer elements than this: waking a thread
# must cost much less than its share (about 20 us at memory speed).
PARALLEL_MIN_NUMEL = 1 << 15
# Thread shares are cut at multiples of this many elements (64 bytes: no cache line shared).
ALIGN = 16

# Elements per chunk of a program with a sqrt: every pass over a chunk stays in L1. A multiple
# of SQRT_LANES.
SQRT_CHUNK = 64
# A chunk's passes prefetch every cache line of the chunk this many chunks ahead in each tensor
# (the hardware prefetchers alone leave the interleaved streams short of memory bandwidth).
PREFETCH_CHUNKS = 4
# Lanes an emulated sqrt takes a call (one zmm register, two ymm).
SQRT_LANES = 16
# vmsSqrt's mode argument, as torch's ATen/cpu/vml.h passes it:
# VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
VML_MODE = 0x2 | 0x00140000 | 0x100

# How a kernel takes the roots of a chunk: ``routine`` calls torch's sqrt routine through its
# address (or, where that address is 0, the correctly rounded sqrt); each ``emulated*`` kind
# computes the main path of one of MKL's float32 sqrt kernels (``sqrt_emulation.py``) and hands
# any chunk with a lane off that path to the routine whole.
SQRT_KINDS = ("routine", "emulated-avx", "emulated", "emulated-fma", "emulated-avx512")
# emulated kind -> its intrinsic (``sqrt_emulation.py``), which takes SQRT_LANES roots a call
EMULATION_INTRINSICS = {
    "emulated-avx": "emulated_sqrt_avx",
    "emulated": "emulated_sqrt_sse",
    "emulated-fma": "emulated_sqrt_fma",
    "emulated-avx512": "emulated_sqrt_avx512",
}
# what each needs of numba's target (its rsqrt instruction): LLVM aborts the process, rather
# than raising, when asked for an instruction the target lacks, so the probe never compiles those
EMULATION_FEATURES = {
    "emulated-avx": "avx",
    "emulated": "sse",
    "emulated-fma": "fma",
    "emulated-avx512": "avx512f",  # vrsqrt14ps on zmm registers
}

# How a staged kernel takes torch's ``rsqrt`` (``1 / sqrt``, each rounded): ``divider`` with
# the CPU's root and division instructions; each ``exact-*`` kind a chunk at a time from the
# CPU's estimates (``exact_root.py``), where ``probes.find_root_kind`` finds it bit for bit
ROOT_KINDS = ("divider", "exact-avx512", "exact-avx")
# Whether staged kernels probe for an exact kind at all: off, because where it was measured the
# divider computes the two roundings faster than the estimates and their corrections do
# (docs/numba-engine.md); the same bits either way
EXACT_ROOT = False
ROOT_INTRINSICS = {"exact-avx512": "exact_rsqrt_avx512", "exact-avx": "exact_rsqrt_avx"}
# what each needs of numba's target (as EMULATION_FEATURES: never compiled where missing)
ROOT_FEATURES = {"exact-avx512": ("avx512f",), "exact-avx": ("avx", "fma")}

# the low-precision dtypes of a pairing (masters.py: bfloat16/float16 gradients and partners)
LOW_PRECISION = ("bfloat16", "float16")


def import_numba():
    """The numba module, or ImportError saying how to install it."""
    try:
        import numba
    except ImportError as e:
        raise ImportError(
            f"roundpipe.optim's numba engine needs numba, which could not be imported ({e}); "
            f"install it with: {INSTALL_HINT}"
        ) from e
    return numba
