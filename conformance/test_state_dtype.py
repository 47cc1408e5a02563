"""roundpipe.optim with ``state_dtype`` and ``stochastic_rounding`` against the composition
written with torch.optim (``state_dtype.py``), bit for bit: parameters and state after every
step, on every backend that steps them (fast:numexpr refuses them: tests/storage).

Test ids read ``<Optimizer>-<kwargs>[-state_<dtype>][-sr]-<param dtype>-<backend>``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import roundpipe.optim
from roundpipe.optim.spec import SPECS
from roundpipe.optim.storage import stochastic_round
from roundpipe.optim.threads import torch_threads

from . import deviations
from .harness import bits_mismatch, conformance_threads, exact_backend, gradients, make_params, param_label
from .state_dtype import BACKENDS, CASES, TORCH_ENGINE

_TORCH_ENGINE = {c.id for c in TORCH_ENGINE}


def _stored_entries(name, state):
    """The state entries the state dtype applies to: tensors that are not the 0-d ``step`` kind."""
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and k not in SPECS[name].scalar_state]


def _state_dtype(case, dtype):
    """The state dtype of a parameter of ``dtype``."""
    return case.state_dtype if case.state_dtype is not None else dtype


def _round_state(case, opt, params):
    with torch.no_grad():
        for p, spec in zip(params, case.params, strict=True):
            st = opt.state.get(p, {})
            for k in _stored_entries(case.optimizer, st):
                st[k].copy_(st[k].to(_state_dtype(case, spec.dtype)))


def _snapshot(case, params, opt, torch_run):
    """Each parameter's value and state, in the dtypes roundpipe keeps them."""
    out = []
    for p, spec in zip(params, case.params, strict=True):
        value = p.detach().to(spec.dtype).clone()
        st = opt.state.get(p, {})
        state = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                stored = k in _stored_entries(case.optimizer, st)
                state[k] = (
                    v.detach().to(_state_dtype(case, value) if torch_run and stored else v.dtype).clone()
                )
        out.append((value, state))
    return out


_composed: dict = {}  # the latest case's snapshots (its tests on every backend compose it once)


def compose(case, seed):
    key = (case.id, seed)
    if key not in _composed:
        _composed.clear()
        _composed[key] = _compose(case, seed)
    return _composed[key]


def _compose(case, seed):
    """The composition's snapshots after each step (see ``state_dtype.py``): torch.optim's
    for-loop on float32 copies of the parameters, the state rounded to the state dtype before
    and after each step, the parameters rounded to their dtype after it."""
    low = make_params(case.params)
    params = [torch.nn.Parameter(p.detach().float()) for p in low]
    opt = getattr(torch.optim, case.optimizer)(params, **case.make_kwargs(), foreach=False)
    snapshots = []
    for step in range(case.steps):
        for p, g in zip(params, gradients(step, case.params), strict=True):
            p.grad = None if g is None else g.float()
        _round_state(case, opt, params)
        opt.step()
        _round_state(case, opt, params)
        with torch.no_grad():
            for pid, (p, spec) in enumerate(zip(params, case.params, strict=True)):
                if p.grad is None or spec.dtype is torch.float32:
                    continue
                if case.stochastic:
                    p.copy_(stochastic_round(p, seed, step, pid))
                else:
                    p.copy_(p.to(spec.dtype))
        snapshots.append(_snapshot(case, params, opt, torch_run=True))
    return snapshots


def _compare(case, step, ours, theirs, exact, signless):
    for i, ((pa, sa), (pb, sb)) in enumerate(zip(ours, theirs, strict=True)):
        where = f"{case.id} step {step}: {param_label(i, case.params)}"
        pairs = [("value", pa, pb)]
        assert set(sa) == set(sb), f"{where}: state keys {sorted(sa)} vs torch's {sorted(sb)}"
        pairs += [(f"state[{k!r}]", sa[k], sb[k]) for k in sb]
        for what, a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape, (
                f"{where} {what}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
            )
            if exact:
                problem = bits_mismatch(a + 0.0, b + 0.0) if signless else bits_mismatch(a, b)
                assert problem is None, f"{where} {what}: not bit for bit: {problem}"
            else:
                label = f"{where} {what}"
                torch.testing.assert_close(a, b, msg=lambda m, label=label: f"{label}: {m}")


def _params():
    for case in CASES:
        for backend in BACKENDS:
            if (
                backend != "fast:torch"
                or case.id in _TORCH_ENGINE
                or case.stochastic
                or case.state_dtype is not torch.bfloat16
            ):
                yield pytest.param(case, backend, id=f"{case.id}-{backend}")


@pytest.mark.parametrize("case, backend", list(_params()))
def test_state_dtype(case, backend):
    with torch_threads(conformance_threads()):
        _run(case, backend)


def _run(case, backend):
    params = make_params(case.params)
    with torch.random.fork_rng():  # the stream's seed, drawn from torch's generator: the case's own
        torch.manual_seed(zlib.crc32(case.id.encode()))
        opt = getattr(roundpipe.optim, case.optimizer)(
            params, **case.make_kwargs(), **case.storage_kwargs(), backend=backend
        )
    seed = opt.state_dict()["stochastic_rounding"]["seed"] if case.stochastic else 0
    exact = exact_backend(backend)[0] and deviations.lookup(case, backend) is None
    # torch's lerp(+0, -0, 1) (beta1 = 0) signs its zero by where the element falls (its scalar
    # tail): deviations.LERP_SIGNED_ZERO, met here by bfloat16 gradients rounded to -0
    signless = any(d.matches(case, backend) for d in deviations.PARTNER_SIGNED_ZERO)
    theirs = compose(case, seed)
    for step in range(case.steps):
        for p, g in zip(params, gradients(step, case.params), strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
        _compare(case, step, _snapshot(case, params, opt, torch_run=False), theirs[step], exact, signless)
