"""``fused_kernels``: the step of torch's fused kernels' scalar remainder, held against a second
measurement on another kernel, and a probe that finds none where the kernels do not contract."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from roundpipe.optim import fused_kernels


def _f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32)


def test_the_remainder_step_is_where_adams_kernel_contracts_otherwise():
    """A second measurement, on Adam's float32 kernel (the probe runs SGD's): after two steps
    of random gradients, ``exp_avg_sq`` is ``fma(c2 * g, g, v * beta2)`` before each
    parameter's last ``numel % step`` elements and ``fma(v, beta2, c2 * g * g)`` in them."""
    step = fused_kernels.remainder_step(torch.float32)
    assert step in (4, 8, 16)
    n, count, beta2 = 127, 64, 0.999
    gen = torch.Generator().manual_seed(0)
    params = [torch.zeros(n, requires_grad=True) for _ in range(count)]
    opt = torch.optim.Adam(params, betas=(0.9, beta2), fused=True)
    grads = [[torch.randn(n, generator=gen) for _ in params] for _ in range(2)]
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    b2, c2 = np.float32(beta2), np.float32(1 - beta2)
    body_only, remainder_only = np.zeros(n, bool), np.zeros(n, bool)
    for i, p in enumerate(params):
        g1, g2 = grads[0][i].numpy(), grads[1][i].numpy()
        v = _f32(_f32(c2 * g1) * g1.astype(np.float64))  # (both contractions agree at v = 0)
        square = _f32(_f32(c2 * g2).astype(np.float64) * g2)
        body = _f32(_f32(c2 * g2).astype(np.float64) * g2 + _f32(v.astype(np.float64) * b2))
        remainder = _f32(v.astype(np.float64) * b2 + square)
        got = opt.state[p]["exp_avg_sq"].numpy()
        body_only |= (got == body) & (got != remainder)
        remainder_only |= (got == remainder) & (got != body)
    start = n - n % step
    assert body_only[:start].any() and not body_only[start:].any()
    assert remainder_only[start:].all() and not remainder_only[:start].any()


def test_the_probe_finds_no_step_where_the_kernels_contract_alike():
    """torch's generic kernels (``ATEN_CPU_CAPABILITY=default``) contract nowhere: the probe
    says so (None: the remainder is not modelled) instead of guessing a step."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    code = (
        "import torch; from roundpipe.optim import fused_kernels as f; print(f.remainder_step(torch.float32))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_16bit_remainder_step(dtype):
    """Measured on a torch whose 16-bit SGD kernel is right; twice float32's (the fixed
    release's, measured) where it is known wrong."""
    step = fused_kernels.remainder_step(dtype)
    if fused_kernels.known_wrong("SGD", dtype):
        assert step == 2 * fused_kernels.remainder_step(torch.float32)
    else:
        assert step == fused_kernels._measure(dtype) and step in (8, 16, 32)


def test_known_wrong_names_16bit_kernels_only():
    assert not fused_kernels.known_wrong("SGD", torch.float32)
    assert not fused_kernels.known_wrong("Adam", torch.bfloat16)
