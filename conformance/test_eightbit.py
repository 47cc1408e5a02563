"""The 8-bit family against its ground truth, bitsandbytes 0.50's CPU step: every optimizer over
its options, on tensors around the block (256) and ``min_8bit_size`` (4096) boundaries, odd 2-D
and 3-D shapes, for 24 steps of gradients with zeros, block-setting outliers, tiny and huge
magnitudes; parameters and every state entry (codes, absmax, codebooks, the int step) compared
bit for bit after every step, on every backend; and ``state_dict`` both ways mid-run.

bitsandbytes is a test dependency (the ``test`` extra); the library never imports it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import roundpipe.optim as ro
from roundpipe.optim.spec import EIGHTBIT_SPECS
from roundpipe.optim.spec.eightbit_classes import REQUIRED

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")

try:  # the ground truth (the test extra); an import that fails otherwise than ImportError skips too
    import bitsandbytes as bnb
except Exception as err:  # noqa: BLE001
    pytest.skip(
        f"bitsandbytes, the 8-bit family's ground truth, cannot be imported: {err}", allow_module_level=True
    )

BACKENDS = ("reference", "fast")
SHAPES = [(255,), (256,), (257,), (4095,), (4096,), (4097,), (33, 129), (3, 7, 401), (2, 3000)]
STEPS = 24
# every class of the registry: its defaults (where its signature requires no argument: not
# SGD8bit's, which requires lr), then its cases here
MORE_CASES = {
    "Adam8bit": [dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)],
    "AdamW8bit": [dict(lr=3e-3, weight_decay=0.0, min_8bit_size=256)],
    "PagedAdamW8bit": [dict(weight_decay=0.3)],
    "Lion8bit": [dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=0.1)],
    "SGD8bit": [dict(lr=0.01, momentum=0.9), dict(lr=0.1, momentum=0.5, weight_decay=0.01)],
    "RMSprop8bit": [dict(lr=1e-3, alpha=0.9, eps=1e-6, weight_decay=0.1)],
    "Adagrad8bit": [dict(lr=0.1, weight_decay=0.1, eps=1e-8)],
    "AdEMAMix8bit": [dict(lr=1e-2, alpha=2.0, t_alpha=10, t_beta3=10, weight_decay=0.0)],
    "PagedAdEMAMix8bit": [dict(betas=(0.8, 0.99, 0.999), min_8bit_size=256)],
}
REQUIRES_ARGUMENTS = {n for n, s in EIGHTBIT_SPECS.items() if any(d is REQUIRED for _, d in s.parameters)}
CASES = [
    (name, kwargs)
    for name in EIGHTBIT_SPECS
    for kwargs in ([] if name in REQUIRES_ARGUMENTS else [{}]) + MORE_CASES.get(name, [])
]


def _ids(case):
    name, kwargs = case
    return name + ("-" + "-".join(f"{k}={v}" for k, v in kwargs.items()) if kwargs else "")


def gradient(p, step, gen):
    g = torch.randn(p.shape, generator=gen)
    kind = step % 6
    flat = g.view(-1)
    if kind == 1:
        flat[::3] = 0.0  # zeros, whole blocks of them at the start
        flat[: min(512, flat.numel())] = 0.0
    elif kind == 2:
        flat[::97] *= 1e4  # outliers that set their block's absmax
    elif kind == 3:
        g *= 1e-20  # tiny: normalized values of many magnitudes
    elif kind == 4:
        g *= 1e20  # huge
    return g


def make(name, params, kwargs, backend=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Paged classes warn on the CPU, both of them
        if backend is None:
            return getattr(bnb.optim, name)(params, **kwargs)
        return getattr(ro, name)(params, backend=backend, **kwargs)


def same(a, b) -> bool:
    if torch.is_tensor(b):
        return (
            torch.is_tensor(a)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        )
    return type(a) is type(b) and a == b


def compare(ours, theirs, qs, ps, where):
    for i, (q, p) in enumerate(zip(qs, ps, strict=True)):
        assert same(q.detach(), p.detach()), f"{where}: param {i} {tuple(p.shape)} differs"
        st_q, st_p = ours.state[q], theirs.state[p]
        assert set(st_q) == set(st_p), f"{where}: param {i}: state keys {sorted(st_q)} != {sorted(st_p)}"
        for key, value in st_p.items():
            assert same(st_q[key], value), f"{where}: param {i} {tuple(p.shape)}: state {key!r} differs"


def pairs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    return [t.clone().requires_grad_() for t in start], [t.clone().requires_grad_() for t in start]


def step_all(opts, groups, step, seed):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    grads = [gradient(p, step, gen) for p in groups[0]]
    for params in groups:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
    for opt in opts:
        opt.step()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_steps_as_bitsandbytes(case, backend):
    name, kwargs = case
    ours_params, their_params = pairs()
    ours, theirs = make(name, ours_params, kwargs, backend), make(name, their_params, kwargs)
    for step in range(STEPS):
        step_all([ours, theirs], [ours_params, their_params], step, seed=1)
        compare(ours, theirs, ours_params, their_params, f"{name} {kwargs} on {backend}, step {step + 1}")


FIRST_CASES = [next(c for c in CASES if c[0] == name) for name in EIGHTBIT_SPECS]  # one per class


def test_every_registered_class_has_cases():
    assert {name for name, _ in CASES} == set(EIGHTBIT_SPECS) and set(MORE_CASES) <= set(EIGHTBIT_SPECS)


@pytest.mark.parametrize("case", FIRST_CASES, ids=[_ids(c) for c in FIRST_CASES])
def test_state_dict_both_ways(case):
    """After 10 steps, each optimizer's state_dict loads into a fresh one of the other library,
    and all four continue in lockstep for 10 more steps."""
    name, kwargs = case
    ours_params, their_params = pairs()
    ours, theirs = make(name, ours_params, kwargs, "fast"), make(name, their_params, kwargs)
    for step in range(10):
        step_all([ours, theirs], [ours_params, their_params], step, seed=2)
    # ours -> bitsandbytes, bitsandbytes -> ours, each on copies of the other's parameters
    their_copy = [p.detach().clone().requires_grad_() for p in ours_params]
    ours_copy = [p.detach().clone().requires_grad_() for p in their_params]
    theirs_loaded, ours_loaded = make(name, their_copy, kwargs), make(name, ours_copy, kwargs, "fast")
    theirs_loaded.load_state_dict(ours.state_dict())
    ours_loaded.load_state_dict(theirs.state_dict())
    groups = [ours_params, their_params, their_copy, ours_copy]
    for step in range(10, 20):
        step_all([ours, theirs, theirs_loaded, ours_loaded], groups, step, seed=2)
        where = f"{name} {kwargs}, step {step + 1}"
        compare(ours, theirs, ours_params, their_params, where)
        compare(ours_loaded, theirs_loaded, ours_copy, their_copy, where + " (loaded both ways)")
        compare(ours_loaded, theirs, ours_copy, their_params, where + " (bitsandbytes' loaded into ours)")


def test_state_dict_layout_is_bitsandbytes():
    """The same keys, nesting and tensors: the quantization entries under bitsandbytes' key."""
    ours_params, their_params = pairs()
    ours, theirs = make("AdamW8bit", ours_params, {}, "fast"), make("AdamW8bit", their_params, {})
    step_all([ours, theirs], [ours_params, their_params], 0, seed=3)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for k, entry in b["state"].items():
        assert a["state"][k].keys() == entry.keys()
        for key, value in entry.items():
            if isinstance(value, dict):
                assert a["state"][k][key].keys() == value.keys()
                assert all(same(a["state"][k][key][n], v) for n, v in value.items())
            else:
                assert same(a["state"][k][key], value)
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert {k: v for k, v in ga.items() if k != "min_8bit_size"} == gb


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("position", [0, 7, 100, 254])
def test_non_finite_gradients_as_bitsandbytes(bad, position):
    """A NaN or inf in a gradient: bitsandbytes' result (its block max skips a NaN wherever it
    lies in the block), never a block zeroed on its own."""
    ours_params, their_params = pairs()
    ours, theirs = make("AdamW8bit", ours_params, {}, "fast"), make("AdamW8bit", their_params, {})
    gen = torch.Generator().manual_seed(position)
    for step in range(3):
        for a, b in zip(ours_params, their_params, strict=True):
            g = torch.randn(a.shape, generator=gen)
            if step == 1:
                g.view(-1)[position] = bad
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        compare(ours, theirs, ours_params, their_params, f"{bad} at {position}, step {step + 1}")


def test_loss_scaling_and_a_scheduler_as_bitsandbytes():
    """``ro.GradScaler`` (the unscale folded into the step) and a scheduler against torch's
    GradScaler (in-place unscale) and the same scheduler on bitsandbytes, bit for bit; a step
    with an inf gradient is skipped by both."""
    ours_params, their_params = pairs()
    ours, theirs = make("AdamW8bit", ours_params, {}, "fast"), make("AdamW8bit", their_params, {})
    scalers = ro.GradScaler("cpu", init_scale=2.0**12), torch.amp.GradScaler("cpu", init_scale=2.0**12)
    lambdas = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.9**t) for o in (ours, theirs)]
    gen = torch.Generator().manual_seed(4)
    for step in range(8):
        grads = [torch.randn(p.shape, generator=gen) * 2.0**12 for p in ours_params]
        if step == 3:
            grads[2].view(-1)[5] = float("inf")
        runs = zip((ours, theirs), (ours_params, their_params), scalers, lambdas, strict=True)
        for opt, params, scaler, sched in runs:
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            scaler.scale(torch.ones(()))  # (what a backward's loss would be scaled by)
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            sched.step()
        compare(ours, theirs, ours_params, their_params, f"GradScaler and LambdaLR, step {step + 1}")
