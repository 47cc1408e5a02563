"""Numerical fidelity over a long run (issue 6, item 7).

For every optimizer and backend, 1,000 steps on a small least-squares problem: the distance of
roundpipe's float32 trajectory from a float64 run of torch.optim must be no larger than
torch.optim's own float32 distance from it. The default engines are bit-for-bit torch's, so
their ratio is exactly 1. The numexpr engine (opt-in) rounds an ulp differently here and there
(no FMA; see README.md's known deviations); over 1,000 steps that is amplified by the
trajectory, in either direction (measured ratios 0.93 for Adadelta up to 2.31 for NAdam), so it
gets a margin of 3: a systematic bias would exceed it, chaotic divergence does not. The
ratios are printed (``pytest -s``) and, with ``ROUNDPIPE_FIDELITY_REPORT=path``, written as
JSON.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import roundpipe.optim as ro

from ._util import OPTIMIZER_NAMES

STEPS = 1000
KWARGS = {
    "Adadelta": {},
    "Adagrad": {"lr": 0.05},
    "Adam": {"lr": 1e-2, "weight_decay": 1e-3},
    "AdamW": {"lr": 1e-2, "amsgrad": True},
    "Adamax": {"lr": 1e-2},
    "ASGD": {"lr": 1e-2, "t0": 100},
    "NAdam": {"lr": 1e-2},
    "RAdam": {"lr": 1e-2},
    "RMSprop": {"lr": 1e-3, "centered": True, "momentum": 0.5},
    "Rprop": {},
    "SGD": {"lr": 1e-2, "momentum": 0.9, "nesterov": True},
}
RESULTS: dict = {}


def _problem(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 16, generator=g, dtype=torch.float64)
    b = torch.randn(64, generator=g, dtype=torch.float64)
    w0 = torch.randn(16, generator=g, dtype=torch.float64) * 0.1
    return a.to(dtype), b.to(dtype), w0.to(dtype)


def _trajectory(make_opt, dtype):
    a, b, w0 = _problem(dtype)
    w = torch.nn.Parameter(w0.clone())
    opt = make_opt([w])
    out = torch.empty(STEPS, 16, dtype=torch.float64)
    for k in range(STEPS):
        with torch.no_grad():
            w.grad = a.t() @ (a @ w - b) / a.shape[0]  # the least-squares gradient
        opt.step()
        out[k] = w.detach().double()
    return out


def _torch_opt(name, params):
    return getattr(torch.optim, name)(params, foreach=False, **KWARGS[name])


@pytest.fixture(scope="module")
def float64_runs():
    return {
        name: _trajectory(
            lambda p, n=name: getattr(torch.optim, n)(p, foreach=False, **KWARGS[n]), torch.float64
        )
        for name in OPTIMIZER_NAMES
    }


@pytest.fixture(scope="module")
def torch_float32_distance(float64_runs):
    out = {}
    for name in OPTIMIZER_NAMES:
        t32 = _trajectory(
            lambda p, n=name: getattr(torch.optim, n)(p, foreach=False, **KWARGS[n]), torch.float32
        )
        out[name] = (t32 - float64_runs[name]).abs().max().item()
    return out


def test_long_run_is_as_close_to_float64_as_torch(name, backend, float64_runs, torch_float32_distance):
    engine = os.environ.get("ROUNDPIPE_OPTIM_ENGINE") or "torch"
    rp = _trajectory(lambda p: getattr(ro, name)(p, backend=backend, **KWARGS[name]), torch.float32)
    ours = (rp - float64_runs[name]).abs().max().item()
    theirs = torch_float32_distance[name]
    ratio = ours / theirs if theirs > 0 else (1.0 if ours == 0 else float("inf"))
    label = backend if backend == "reference" else f"{backend}-{engine}"
    RESULTS[(name, label)] = {"roundpipe": ours, "torch_float32": theirs, "ratio": ratio}
    print(f"{name:9s} {label:13s} from float64 {ours:.3e}, torch float32 {theirs:.3e}, ratio {ratio:.3f}")
    margin = 3.0 if engine == "numexpr" and backend == "fast" else 1.0
    assert ours <= theirs * margin + 1e-12, f"{name} {label}: {ours:.3e} > {margin} x torch's {theirs:.3e}"


def teardown_module(module):
    path = os.environ.get("ROUNDPIPE_FIDELITY_REPORT")
    if path and RESULTS:
        with open(path, "w") as f:
            json.dump([{"optimizer": k[0], "backend": k[1], **v} for k, v in RESULTS.items()], f, indent=1)
