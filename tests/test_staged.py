"""The staged optimizers (Adafactor, Muon: ``spec/staged.py``) combined with what a user combines
them with: fp32 masters paired with bf16/fp16 parameters, loss scaling, clipping, DTensors; and
the numba engine's staged kernels on the shapes that take each of their paths. Bit for bit
against torch's for-loop throughout (the conformance suite covers every option:
``conformance/test_staged.py``)."""

from __future__ import annotations

import pytest
import torch

import roundpipe.optim as ro
from roundpipe.optim.backends.numba_engine import staged as numba_staged
from roundpipe.optim.backends.numba_engine import staged_probes
from roundpipe.optim.spec import STAGED_SPECS
from tests._util import assert_bits_equal

BACKENDS = ["reference", "fast:numba", "fast:torch"]
NAMES = sorted(STAGED_SPECS)
KWARGS = {"Adafactor": dict(lr=0.05, weight_decay=0.1), "Muon": dict(lr=0.02)}
SHAPES = {"Adafactor": [(6, 8), (3, 5), (8,), (2, 4, 16)], "Muon": [(6, 8), (9, 4)]}


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_masters_step_as_the_composition(name, backend, dtype):
    """fp32 masters paired with 16-bit partners: the partner's gradient widened, torch's step on
    the master, the master rounded into the partner."""
    shapes = SHAPES[name]
    partners = [_randn(s, i, dtype).requires_grad_() for i, s in enumerate(shapes)]
    masters = ro.fp32_masters(partners)
    opt = getattr(ro, name)(masters, backend=backend, **KWARGS[name])
    ref_masters = [p.detach().float().requires_grad_() for p in partners]
    ref = getattr(torch.optim, name)(ref_masters, **KWARGS[name])
    for step in range(4):
        for i, (q, m) in enumerate(zip(partners, ref_masters, strict=True)):
            q.grad = _randn(q.shape, 100 * step + i, dtype)
            m.grad = q.grad.float()
        opt.step()
        ref.step()
        for q, p, m in zip(partners, masters, ref_masters, strict=True):
            assert_bits_equal(p, m)
            assert_bits_equal(q, m.to(dtype))
    for p, m in zip(masters, ref_masters, strict=True):
        for key, value in ref.state[m].items():
            assert_bits_equal(opt.state[p][key], value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_grad_scaler_and_clipping_fold_into_the_step(name, backend):
    """torch's composition: ``scaler.unscale_`` (in place), ``clip_grad_norm_``, step; with
    roundpipe's GradScaler and clip both fold into the step's passes, bit for bit."""
    shapes = SHAPES[name]
    params = [_randn(s, i).requires_grad_() for i, s in enumerate(shapes)]
    ours = [p.detach().clone().requires_grad_() for p in params]
    opt = getattr(ro, name)(ours, backend=backend, **KWARGS[name])
    ref = getattr(torch.optim, name)(params, **KWARGS[name])
    scaler = ro.GradScaler("cpu", init_scale=1024.0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(())), ref_scaler.scale(torch.ones(()))  # (a scaler starts at its first scale)
    for step in range(3):
        for i, (p, q) in enumerate(zip(params, ours, strict=True)):
            p.grad = _randn(p.shape, 50 * step + i) * 1024.0
            q.grad = p.grad.clone()
        scaler.unscale_(opt)
        ours_total = opt.clip_grad_norm_(0.5)
        ref_scaler.unscale_(ref)
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.testing.assert_close(ours_total, total, rtol=1e-6, atol=0)
        # the numba engine's one-pass norm is torch's to rounding (tests/test_amp.py): the
        # composition clips with the norm it returned, and the step is compared bit for bit
        torch.nn.utils.clip_grads_with_norm_(params, 0.5, ours_total)
        ref_scaler.step(ref)
        scaler.step(opt)
        ref_scaler.update()
        scaler.update()
        for p, q in zip(params, ours, strict=True):
            assert_bits_equal(q, p)


@pytest.mark.parametrize("name", NAMES)
def test_a_skipped_step_under_an_inf_moves_nothing(name):
    params = [_randn(s, i).requires_grad_() for i, s in enumerate(SHAPES[name])]
    opt = getattr(ro, name)(params, **KWARGS[name])
    scaler = ro.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    for p in params:
        p.grad = torch.ones_like(p)
    params[0].grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in params]
    scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert not opt.state


@pytest.mark.parametrize("name", NAMES)
def test_a_dtensor_is_refused_before_anything_moves(name, monkeypatch):
    """The row and column statistics of a sharded matrix span ranks: a DTensor parameter is
    refused with a clear error, and nothing moves."""
    from roundpipe.optim.plan import staged as plan_staged

    params = [_randn(s, i).requires_grad_() for i, s in enumerate(SHAPES[name])]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = getattr(ro, name)(params, **KWARGS[name])
    monkeypatch.setattr(plan_staged, "is_dtensor", lambda t: t is params[-1])
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="DTensor"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert not opt.state


def test_muon_needs_a_torch_that_has_it(monkeypatch):
    """On a torch without torch.optim.Muon (before 2.9), importing it names the torch version."""
    monkeypatch.delattr(ro, "Muon", raising=False)
    with pytest.raises(ImportError, match=r"torch\.optim\.Muon.*2\.9.*" + torch.__version__.split("+")[0]):
        from roundpipe.optim import Muon  # noqa: F401


# -- the numba engine's staged kernels ------------------------------------------------------------


def test_the_probe_finds_torchs_reduction_order():
    """On x86-64 torch the whole-tensor and row norms add 8 lanes, then their tail unrolled by
    four (the last ones fused where torch's kernels have FMA); columns add down the rows."""
    found = staged_probes.torch_reductions()
    assert found is not None and found[0] == 8


@pytest.mark.parametrize(
    "shape",
    [(1,), (5,), (8,), (4099,), (1, 1), (3, 5), (300, 7), (33, 17), (64, 40), (2, 8, 24), (2, 3, 11)]
    + [(9, 1), (1, 9)],
)
def test_each_kernel_path_gives_torchs_norms(shape):
    """The aligned (blocked) path, the element-by-element path (rows not a whole number of
    lanes), single rows, single elements, and column vectors (their column norm falls back to
    torch's ops) against torch.norm, bit for bit, at scales where a square underflows."""
    program = staged_probes._probe_program()
    order = staged_probes.torch_reductions()
    for scale in (1.0, 1e-20, 3e18):
        x = _randn(shape, 7) * scale
        x2 = x if x.dim() >= 2 else x.reshape(1, -1)
        launch = numba_staged.prepare(program, [{}], [{"param": x2}], (), *order, 1, _torch_norms)
        got = launch()[0]
        assert_bits_equal(numba_staged.as_tensor(got["all"]), x2.norm(2))
        assert_bits_equal(got["rows"], torch.norm(x2, dim=-1, keepdim=True))
        assert_bits_equal(got["cols"], torch.norm(x2, dim=-2, keepdim=True))


def _torch_norms(program, scalars, tensors):
    from roundpipe.optim.backends.reference import run_staged

    return run_staged(program, scalars, tensors)


def test_a_thread_count_changes_nothing():
    """Reductions run one parameter a thread in a fixed order: 1 and 2 threads, the same bits
    (enough elements that two threads are worth waking: the parallel kernels run)."""
    shapes = [(512, 128), (128, 512), (40000,), (3, 40, 24)]
    grads = [[_randn(s, 10 * k + i) for i, s in enumerate(shapes)] for k in range(3)]
    results = []
    for threads in (1, 2):
        params = [_randn(s, i).requires_grad_() for i, s in enumerate(shapes)]
        opt = ro.Adafactor(params, lr=0.05)
        before = ro.get_num_threads()
        ro.set_num_threads(threads)
        try:
            for gs in grads:
                for p, g in zip(params, gs, strict=True):
                    p.grad = g.clone()
                opt.step()
        finally:
            ro.set_num_threads(before)
        results.append(params)
        layouts = [
            layout
            for cache in opt.__dict__["_roundpipe_staged_plan"].launch_caches.values()
            for launch in cache["variants"].values()
            for layout in launch["layouts"].values()
        ]
        parallel = [layout[0] in numba_staged._parallel for layout in layouts]
        assert any(parallel) == (threads == 2), parallel
    for a, b in zip(*results, strict=True):
        assert_bits_equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_what_changes_between_steps_is_seen(name):
    """The staged plan is checked every step: a hyperparameter that switches a statement, a
    gradient that goes and comes back, a new param group, a state_dict loaded, a state entry
    replaced; each step equals torch's."""
    shapes = SHAPES[name]
    params = [_randn(s, i).requires_grad_() for i, s in enumerate(shapes)]
    ours = [p.detach().clone().requires_grad_() for p in params]
    ref = getattr(torch.optim, name)(params[:-1], **KWARGS[name])
    opt = getattr(ro, name)(ours[:-1], **KWARGS[name])
    changes = [
        lambda o, ps: None,
        lambda o, ps: o.param_groups[0].update(weight_decay=0.0),
        lambda o, ps: setattr(ps[0], "grad", None),
        lambda o, ps: o.param_groups[0].update(weight_decay=0.2, lr=0.03),
        lambda o, ps: o.add_param_group({"params": [ps[-1]]}),
        lambda o, ps: o.load_state_dict(o.state_dict()),
        lambda o, ps: o.state[ps[1]].update({k: v.clone() for k, v in o.state[ps[1]].items()}),
        lambda o, ps: None,
    ]
    for step, change in enumerate(changes):
        for i, (p, q) in enumerate(zip(params, ours, strict=True)):
            p.grad = _randn(p.shape, 30 * step + i)
            q.grad = p.grad.clone()
        change(ref, params)
        change(opt, ours)
        ref.step()
        opt.step()
        for p, q in zip(params, ours, strict=True):
            assert_bits_equal(q, p, f"step {step}")
        for p, q in zip(params, ours, strict=True):
            for key, value in ref.state.get(p, {}).items():
                assert_bits_equal(opt.state[q][key], value, f"step {step}, state {key}")


def test_a_bad_gradient_later_is_refused_before_anything_moves():
    params = [_randn(s, i).requires_grad_() for i, s in enumerate(SHAPES["Adafactor"])]
    opt = ro.Adafactor(params, lr=0.05)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in opt.state[params[0]].items()}
    params[0].grad = torch.ones(8, 6).t()  # (6, 8), not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in state.items())


def test_reductions_spread_over_the_threads_by_size():
    """Each parameter's reductions run on one thread; the schedule gives each thread an equal
    run of rows (numba's parallel loop hands out equal runs), the largest parameters first to
    the least loaded thread: one large matrix does not share a thread with half the rest."""
    dims = [(1, 4096, 4096)] + [(1, 1024, 1024)] * 8 + [(1, 1, 512)] * 3
    items = numba_staged.thread_schedule(dims, 2)
    width = len(items) // 2
    shares = [[p for p in items[th * width : (th + 1) * width, 0] if p >= 0] for th in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(len(dims)))
    loads = [sum(int(a * b * c) for a, b, c in (dims[p] for p in share)) for share in shares]
    assert min(loads) >= 0.49 * max(loads), loads
    assert numba_staged.thread_schedule([], 2).shape == (0, 5)


@pytest.mark.parametrize("name", NAMES)
def test_self_check_on_a_release_the_suite_did_not_check(name, monkeypatch):
    """The staged optimizers were checked on fewer torch releases than the rest: on another one
    inside the range they check themselves (a matrix, since Muon steps nothing else), and on
    this one they pass the check."""
    from roundpipe.optim import torch_support

    monkeypatch.setattr(torch_support, "torch_release", lambda version=None: (2, 7))
    assert not torch_support._followed(getattr(ro, name))
    assert torch_support._followed(ro.AdamW)
    cls = getattr(ro, name)
    assert torch_support._difference(cls, cls.spec.torch_class, dict(KWARGS[name])) is None


def test_more_threads_than_numbas_pool_steps():
    """roundpipe's thread count above numba's pool (NUMBA_NUM_THREADS) runs on the pool's."""
    params = [_randn(s, i).requires_grad_() for i, s in enumerate(SHAPES["Adafactor"])]
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt, ref_opt = ro.Adafactor(params, lr=0.05), torch.optim.Adafactor(ref, lr=0.05)
    before = ro.get_num_threads()
    ro.set_num_threads(64)
    try:
        for step in range(2):
            for i, (p, q) in enumerate(zip(params, ref, strict=True)):
                p.grad = _randn(p.shape, 40 * step + i)
                q.grad = p.grad.clone()
            opt.step()
            ref_opt.step()
    finally:
        ro.set_num_threads(before)
    for p, q in zip(params, ref, strict=True):
        assert_bits_equal(p, q)


def test_a_torch_without_muon(tmp_path):
    """On a torch without torch.optim.Muon (before 2.9), roundpipe.optim imports, star-imports,
    and ``from roundpipe.optim import Muon`` raises an ImportError naming the torch version."""
    import subprocess
    import sys

    code = (
        "import torch, torch.optim\n"
        "del torch.optim.Muon\n"
        "from roundpipe.optim import *\n"
        "import roundpipe.optim as ro\n"
        "assert 'Muon' not in ro.__all__ and 'Adafactor' in ro.__all__\n"
        "try:\n"
        "    from roundpipe.optim import Muon\n"
        "except ImportError as e:\n"
        "    assert torch.__version__ in str(e) and '2.9' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('Muon imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def _factored_last_pass():
    spec = STAGED_SPECS["Adafactor"]
    last = spec.stages({"maximize": False, "weight_decay": False, "factored": True})[-1]
    return last.program


def _spread_floats(n, seed, lo_exp, hi_exp):
    """Float32 of random significands over ``[2**lo_exp, 2**hi_exp)``."""
    gen = torch.Generator().manual_seed(seed)
    significand = 1 + torch.rand(n, generator=gen, dtype=torch.float64)
    exponent = torch.randint(lo_exp, hi_exp, (n,), generator=gen).double()
    return (significand * torch.pow(2.0, exponent)).float()


@pytest.mark.parametrize(
    "eps1_sq",
    [2.0**-126, 1e-14, 0.0, 2.0**-140],
    ids=["smallest-normal", "default", "zero", "subnormal"],
)
def test_adafactors_clamped_quotient_is_torchs(eps1_sq):
    """``clamp_min(row * col / row_scale, eps1 ** 2)``: through a float64 reciprocal where the floor
    is a normal float32 (``staged.clamped_quotients``), by float32 division below it; either way
    torch's bits, quotients spread over every exponent, subnormal ones included."""
    program = _factored_last_pass()
    assert numba_staged.clamped_quotients(program) == ("eps1_sq",)
    m, n = 64, 1024
    row = _spread_floats(m, 1, -80, 20).reshape(m, 1)
    col = _spread_floats(n, 2, -80, 20).reshape(1, n)
    # products 49 * (2k + 1) * 2**-149 and 103 * (2k + 1) * 2**-149: over 98 and 206, subnormal
    # quotients exactly halfway between two subnormals, where float64's reciprocal rounds some the
    # wrong way (found by search)
    row[:4] = 2.0**-100
    odd = torch.arange(1, 2 * 32, 2, dtype=torch.float64)
    col[0, :32], col[0, 32:64] = (49 * odd * 2.0**-49).float(), (103 * odd * 2.0**-49).float()
    grad = _randn((m, n), 3)
    for scale in (0.37, 3.0e-20, 2.5e15, 98.0, 206.0):
        row_scale = torch.tensor([[scale]], dtype=torch.float32)
        param = _randn((m, n), 4)
        expected = param.clone()
        var = (row @ col).div_(row_scale).clamp_(min=torch.tensor(eps1_sq, dtype=torch.float32).item())
        expected.add_(var.rsqrt_().mul_(grad), alpha=-0.01)
        scalars = {"eps1_sq": eps1_sq, "neg_step": -0.01, "weight_decay_factor": 1.0}
        tensors = {"param": param, "grad": grad, "row_factor": row, "col_factor": col, "row_scale": row_scale}
        ro.backends.get("fast:numba").prepare_staged(program, [scalars], [tensors])()
        assert_bits_equal(param, expected)
    fast = numba_staged.floor_variant({"eps1_sq": eps1_sq}, ("eps1_sq",)) == (True,)
    assert fast == (eps1_sq >= 2.0**-126)


def test_a_repeated_launch_sees_what_changed(monkeypatch):
    """A one-parameter step repeats its last launch (``staged._Launch.rebind``) with the new
    scalars and gradient (a new tensor, or the same one written in place); a parameter moved to
    new storage takes the full prepare; every step stays torch's."""
    rebinds = []
    real = numba_staged._Launch.rebind

    def counted(self, *args):
        ok = real(self, *args)
        rebinds.append(ok)
        return ok

    monkeypatch.setattr(numba_staged._Launch, "rebind", counted)
    p = _randn((4099,), 0).requires_grad_()
    q = p.detach().clone().requires_grad_()
    opt, ref = ro.Adafactor([p], lr=0.05, backend="fast:numba"), torch.optim.Adafactor([q], lr=0.05)

    def step(seed, same_grad=False):
        g = _randn((4099,), seed)
        if same_grad:
            p.grad.copy_(g)
            q.grad.copy_(g)
        else:
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert_bits_equal(p, q)
        for key, value in ref.state[q].items():
            assert_bits_equal(opt.state[p][key], value)

    for seed in range(1, 6):  # (the lerp weight 1 - beta2_t falls below 0.5 at step 3: another kernel)
        step(seed)
    assert rebinds[-2:] == [True, True], rebinds  # both passes repeated
    with torch.no_grad():
        p.data, q.data = p.data.clone(), q.data.clone()  # the same tensors, new storage
    rebinds.clear()
    step(10)
    assert rebinds == [False, False]
    step(11)
    step(12, same_grad=True)
    assert rebinds[-2:] == [True, True]
