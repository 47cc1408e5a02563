"""The probes (``numba_engine/probes.py``): which emulations of MKL's sqrt the probe may compile
on numba's target."""

import numba

from roundpipe.optim.backends.numba_engine import probes


def test_probe_order_follows_numba_target(monkeypatch):
    """The sqrt probe compiles only emulations whose instructions numba's target has (LLVM
    aborts the process on one it lacks): the host's, or those NUMBA_CPU_FEATURES lists when
    NUMBA_CPU_NAME names another target."""
    monkeypatch.setattr(numba.config, "CPU_NAME", "generic")
    monkeypatch.setattr(numba.config, "CPU_FEATURES", None)
    assert probes.probe_order() == []
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+sse,+sse2,+avx,-avx512f")
    assert probes.probe_order() == ["emulated-avx", "emulated"]
    monkeypatch.setattr(probes, "cpu_vendor", lambda: "GenuineIntel")
    # the AVX-512 emulation takes vrsqrt14ps on zmm registers: AVX512F
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+sse,+avx,+fma,-avx512f,+avx512vl")
    assert probes.probe_order() == ["emulated-avx", "emulated", "emulated-fma"]
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+sse,+avx,+fma,+avx512f")
    assert probes.probe_order() == ["emulated-avx512", "emulated-avx", "emulated", "emulated-fma"]
