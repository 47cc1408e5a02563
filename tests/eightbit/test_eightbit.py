"""The 8-bit family's contract beyond the steps (conformance/test_eightbit.py): signatures and
errors as bitsandbytes', refusals where its CPU step leaves something out, bad state refused
before anything moves, and the quantizer's choices where they matter."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch

import roundpipe.optim as ro
from roundpipe.optim.spec import EIGHTBIT_SPECS, codebooks
from roundpipe.optim.spec.eightbit_classes import REFUSED

NAMES = list(EIGHTBIT_SPECS)  # the registry: every class roundpipe steps, the Paged ones too


def test_every_class_of_the_registry_is_public():
    assert set(NAMES) | set(REFUSED) <= set(ro.__all__)
    for name in NAMES:
        assert getattr(ro, name).spec is EIGHTBIT_SPECS[name]


@pytest.mark.parametrize("name", NAMES + list(REFUSED))
def test_signature_is_bitsandbytes(name):
    bnb = pytest.importorskip("bitsandbytes")
    ours = inspect.signature(getattr(ro, name).__init__).parameters
    theirs = inspect.signature(getattr(bnb.optim, name).__init__).parameters
    if name in REFUSED:
        return  # refused at construction: the class exists so that the import works
    assert [p for p in ours if p != "backend"] == list(theirs)
    assert {k: p.default for k, p in ours.items() if k != "backend"} == {
        k: p.default for k, p in theirs.items()
    }


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda p: ro.Adam8bit(p, amsgrad=True), ValueError, "does not support amsgrad"),
        (lambda p: ro.AdamW8bit(p, optim_bits=8), ValueError, "only supports optim_bits=32"),
        (lambda p: ro.Adam8bit(p, lr=-1.0), ValueError, "Invalid learning rate"),
        (lambda p: ro.Adam8bit(p, betas=(0.9, 1.0)), ValueError, "Invalid beta parameter at index 1"),
        (lambda p: ro.Lion8bit(p, weight_decay=-1), ValueError, "Invalid weight_decay"),
        (lambda p: ro.SGD8bit(p, lr=0.1), NotImplementedError, "without momentum"),
        (lambda p: ro.SGD8bit(p, lr=0.1, momentum=0.9, nesterov=True), ValueError, "neither"),
        (lambda p: ro.RMSprop8bit(p, centered=True), NotImplementedError, "Centered"),
        (lambda p: ro.RMSprop8bit(p, momentum=0.9), ValueError, "applies no momentum"),
        (lambda p: ro.Adagrad8bit(p, lr_decay=0.1), ValueError, "Lr Decay"),
        (lambda p: ro.Adam8bit(p, args=object()), ValueError, "args= is not supported"),
        (lambda p: ro.LAMB8bit(p), NotImplementedError, "no trust ratio"),
        (lambda p: ro.LARS8bit(p, lr=0.1, momentum=0.9), NotImplementedError, "no trust ratio"),
        (lambda p: ro.AdEMAMix8bit(p, betas=(0.9, 0.999, 1.0)), ValueError, "Invalid beta parameter at"),
    ],
)
def test_refused_at_construction(make, error, match):
    with pytest.raises(error, match=match):
        make([torch.zeros(4096, requires_grad=True)])


BAD = [dict(lr=-1.0), dict(weight_decay=-0.5)]
BAD_EPS = [dict(eps=-1e-8)]
BAD_BY_CLASS = {
    "Adam8bit": [dict(amsgrad=True), dict(optim_bits=8), dict(betas=(0.9, 1.5)), *BAD_EPS],
    "Lion8bit": [dict(betas=(-0.1, 0.99))],
    "SGD8bit": [dict(lr=0.1), dict(lr=-1.0, momentum=0.9), dict(lr=0.1, momentum=0.9, dampening=1.0)],
    "RMSprop8bit": [dict(alpha=0), dict(centered=True), dict(alpha=1.0), *BAD_EPS],
    "Adagrad8bit": [dict(initial_accumulator_value=0.1), dict(lr_decay=0.1), dict(optim_bits=32), *BAD_EPS],
    "AdEMAMix8bit": [dict(betas=(0.9, 0.999, 1.0)), *BAD_EPS],
}
BAD_CASES = [
    (name, kwargs)
    for name in NAMES
    for kwargs in BAD_BY_CLASS[name.removeprefix("Paged").replace("AdamW", "Adam")]
    + (BAD if name != "SGD8bit" else [])
]


@pytest.mark.parametrize("name, kwargs", BAD_CASES, ids=[f"{n}-{k}" for n, k in BAD_CASES])
def test_constructor_errors_are_bitsandbytes_word_for_word(name, kwargs):
    bnb = pytest.importorskip("bitsandbytes")
    errors = []
    for cls in (getattr(ro, name), getattr(bnb.optim, name)):
        with pytest.raises(Exception) as caught, warnings.catch_warnings():  # noqa: PT011 - compared below
            warnings.simplefilter("ignore")
            cls([torch.zeros(4096, requires_grad=True)], **kwargs)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]


def test_betas_as_a_string_as_bitsandbytes():
    """bitsandbytes' two-state classes take ``betas='(0.9, 0.99)'`` and keep the parsed list."""
    bnb = pytest.importorskip("bitsandbytes")
    groups = [
        cls([torch.zeros(8, requires_grad=True)], betas="(0.8, 0.95)").param_groups[0]
        for cls in (ro.Adam8bit, bnb.optim.Adam8bit)
    ]
    assert groups[0]["betas"] == groups[1]["betas"] == [0.8, 0.95]


def _stepped(opt_cls=ro.AdamW8bit, n=5000, **kwargs):
    p = torch.randn(n, requires_grad=True)
    opt = opt_cls([p], **kwargs)
    p.grad = torch.randn(n)
    opt.step()
    return p, opt


def _snapshot(p, opt):
    st = opt.state[p]
    return p.detach().clone(), {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}


def _unchanged(p, opt, before):
    p0, st0 = before
    assert torch.equal(p.detach(), p0)
    for k, v in st0.items():
        now = opt.state[p][k]
        assert torch.equal(now, v) if torch.is_tensor(v) else now == v, k


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda st: st.__setitem__("state1", st["state1"].float()), "'state[12]'"),
        (lambda st: st.__setitem__("absmax1", st["absmax1"][:-1].clone()), "'absmax1'"),
        (lambda st: st.pop("absmax2"), "'absmax2'"),
        (lambda st: st.__setitem__("qmap1", st["qmap1"][:128].clone()), "'qmap1'"),
        (lambda st: st.__setitem__("step", 2.0), "'step'"),
    ],
)
def test_corrupt_state_raises_naming_the_entry_and_moves_nothing(corrupt, match):
    p, opt = _stepped(backend="fast")
    corrupt(opt.state[p])
    before = _snapshot(p, opt)
    p.grad = torch.randn_like(p)
    with pytest.raises((RuntimeError, KeyError, TypeError), match=match):
        opt.step()
    _unchanged(p, opt, before)


def test_low_precision_parameters_are_refused_with_the_masters_hint():
    p = torch.randn(5000, dtype=torch.bfloat16, requires_grad=True)
    opt = ro.AdamW8bit([p])
    p.grad = torch.randn_like(p)
    with pytest.raises(TypeError, match="float32"):
        opt.step()
    assert not opt.state


def test_fp32_masters_step_with_8bit_state():
    """A bf16 model with fp32 masters: the step reads the partner's gradient widened and writes
    the partner; the same as stepping the master with that gradient in float32."""
    model = torch.nn.Linear(128, 64).to(torch.bfloat16)
    masters = ro.fp32_masters(model)
    twin = [m.detach().clone().requires_grad_() for m in masters]
    opt, ref = ro.AdamW8bit(masters, min_8bit_size=1024), ro.AdamW8bit(twin, min_8bit_size=1024)
    for _ in range(3):
        model(torch.randn(8, 128, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        for t, q in zip(twin, model.parameters(), strict=True):
            t.grad = q.grad.float()
        opt.step(), ref.step()
        opt.zero_grad(), ref.zero_grad()
    for m, t, q in zip(masters, twin, model.parameters(), strict=True):
        assert torch.equal(m, t) and torch.equal(q, t.detach().to(torch.bfloat16))
    assert opt.state[masters[0]]["state1"].dtype == torch.uint8


def test_state_bytes_per_parameter():
    p, opt = _stepped(n=1 << 20)
    st = opt.state[p]
    nbytes = sum(
        v.numel() * v.element_size() for k, v in st.items() if torch.is_tensor(v) and "qmap" not in k
    )
    assert nbytes / p.numel() <= 2.05


def test_paged_classes_warn_once_as_bitsandbytes_does():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ro.PagedAdamW8bit([torch.zeros(8, requires_grad=True)])
    assert [str(w.message) for w in caught] == [
        "Paged optimizers are not supported on CPU. Falling back to non-paged optimizer behavior."
    ]


def test_codebooks_and_lookup_table_against_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes")
    for signed in (True, False):
        ours = codebooks.dynamic_map(signed)
        assert torch.equal(
            ours.view(torch.int32), bnb.functional.create_dynamic_map(signed=signed).view(torch.int32)
        )
    # the quantizer is a table lookup, not the nearest code: where the two differ, the wheel
    # takes the table's choice (a test that sees a nearest-code quantizer)
    code = codebooks.dynamic_map(True)
    x = torch.tensor([1.0, -3.45e-7, 2.0e-6, -0.5, 0.00137, 0.33], dtype=torch.float32)
    q, absmax = torch.ops.bitsandbytes.quantize_blockwise(x, code, 256)
    table = codebooks.lookup_table(code)
    ours = table[codebooks.lut_position(x.numpy() / np.float32(1.0))]
    assert ours.tolist() == q.tolist()
    nearest = (x[:, None] - code[None, :]).abs().argmin(1)
    assert nearest.tolist() != q.tolist()


@pytest.mark.parametrize(
    "name, kwargs",
    [("AdamW8bit", {}), ("Lion8bit", {}), ("RMSprop8bit", {}), ("AdamW8bit", {"min_8bit_size": 1 << 30})],
    ids=["AdamW8bit", "Lion8bit", "RMSprop8bit", "AdamW8bit-32-bit-state"],
)
def test_the_compiled_pass_in_parallel_is_the_reference(name, kwargs):
    """The numba engine's blockwise kernel on two threads (parameters large enough for its
    parallel loop, a partial last block) against the reference backend, bit for bit; with
    32-bit state too (bitsandbytes' 32-bit update, its roots MKL's, runs in the same kernel)."""
    torch.manual_seed(0)
    sizes = [70001, 300 * 256 + 17]
    ours = [torch.randn(n, requires_grad=True) for n in sizes]
    refs = [p.detach().clone().requires_grad_() for p in ours]
    fast = getattr(ro, name)(ours, backend="fast:numba", **kwargs)
    ref = getattr(ro, name)(refs, backend="reference", **kwargs)
    before = ro.get_num_threads()
    ro.set_num_threads(2)
    try:
        for _ in range(5):
            for p, q in zip(ours, refs, strict=True):
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
            fast.step()
            ref.step()
    finally:
        ro.set_num_threads(before)
    for p, q in zip(ours, refs, strict=True):
        assert torch.equal(p, q)
        for key, value in ref.state[q].items():
            mine = fast.state[p][key]
            assert torch.equal(mine, value) if torch.is_tensor(value) else mine == value, key
