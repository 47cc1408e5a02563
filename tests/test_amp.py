"""Mixed precision end to end (``roundpipe/optim/amp.py``): the float16 recipe (GradScaler and
clipping) and the bfloat16 recipe (clipping) train a small model with fp32 masters bit for bit
as the same loop written with torch.optim and explicit casts, on every backend; torch's own
GradScaler refuses a step it cannot see through; the clip norm, its options and its errors."""

import copy

import pytest
import torch

import roundpipe.optim as ro
from conformance.harness import assert_norm_close, exact_norm
from roundpipe.optim import amp, backends
from tests._util import assert_unchanged, snapshot


def _exact(backend) -> bool:
    """The backend claims torch's for-loop bit for bit (fast:numexpr rounds otherwise: there the
    runs are compared with assert_close; conformance/test_amp.py checks it bit for bit against
    its own composition)."""
    return bool(getattr(backends.get(backend), "exact", False))


STEPS = 8
MAX_NORM = 0.5


class Net(torch.nn.Module):
    """A low-precision Linear pair beside an fp32 LayerNorm, as mixed-precision models are."""

    def __init__(self, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = torch.nn.Linear(16, 32).to(dtype)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 4).to(dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.dtype = dtype

    def forward(self, x):
        h = self.fc1(x.to(self.dtype)).float()
        h = torch.relu(self.norm(h))
        return self.fc2(h.to(self.dtype)).float()


def _batch(step, poison):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 16, generator=g)
    y = torch.randn(8, 4, generator=g)
    if poison and step == 3:
        x[0, 0] = float("inf")  # a step whose gradients overflow: skipped, the scale backs off
    return x, y


def _loss(model, step, poison):
    x, y = _batch(step, poison)
    return torch.nn.functional.mse_loss(model(x), y) * 50.0


def _roundpipe_loop(dtype, backend, scaler_cls):
    """The README's loop: masters, roundpipe's GradScaler and clip."""
    model = Net(dtype)
    masters = ro.fp32_masters(model)
    opt = ro.AdamW(masters, lr=0.01, weight_decay=0.1, backend=backend)
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=3) if scaler_cls else None
    history = []
    for step in range(STEPS):
        loss = _loss(model, step, scaler is not None)
        if scaler is None:
            loss.backward()
            norm = opt.clip_grad_norm_(MAX_NORM)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = opt.clip_grad_norm_(MAX_NORM)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        history.append((repr(norm.item()), scaler.get_scale() if scaler else None))
    return model, history


def _torch_loop(dtype, scaler_cls, norms=None):
    """The same loop with torch.optim and explicit casts: fp32 masters stepped by torch's
    for-loop AdamW, their gradients widened from the model's, written back rounded. ``norms``
    (repr strings, a step each): clip with these total norms (``clip_grads_with_norm_``) instead
    of torch's, which the history still records: the one-pass norm of the numba engine is
    torch's to rounding only (its own summation order), and the step is compared bit for bit
    where the coefficients are equal."""
    model = Net(dtype)
    params = list(model.parameters())
    masters = [p.detach().float() if p.dtype != torch.float32 else p for p in params]
    opt = torch.optim.AdamW(masters, lr=0.01, weight_decay=0.1, foreach=False)
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=3) if scaler_cls else None
    history, exacts = [], []
    for step in range(STEPS):
        loss = _loss(model, step, scaler is not None)
        (scaler.scale(loss) if scaler else loss).backward()
        for m, p in zip(masters, params, strict=True):
            if m is not p:
                m.grad = p.grad.float()
        if scaler:
            scaler.unscale_(opt)
        grads = [m.grad for m in masters if m.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        exacts.append(exact_norm(grads))
        used = norm if norms is None else torch.tensor(float(norms[step]), dtype=torch.float32)
        torch.nn.utils.clip_grads_with_norm_(masters, MAX_NORM, used)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params, strict=True):
                if m is not p:
                    p.copy_(m)
        for t in (*masters, *params):
            t.grad = None
        history.append((repr(norm.item()), scaler.get_scale() if scaler else None))
    return model, history, exacts


def _bits(t):
    return t.detach().reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize(
    "dtype, scaled", [(torch.float16, True), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_recipe_matches_torch_composition(backend, dtype, scaled):
    ours, our_history = _roundpipe_loop(dtype, backend, ro.GradScaler if scaled else None)
    our_norms = [norm for norm, _ in our_history]
    theirs, their_history, exacts = _torch_loop(dtype, torch.amp.GradScaler if scaled else None, our_norms)
    if not _exact(backend):
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)
        return
    assert [s for _, s in our_history] == [s for _, s in their_history]  # the loss scale
    for step, ((mine, _), (torchs, _), exact) in enumerate(
        zip(our_history, their_history, exacts, strict=True)
    ):
        assert_norm_close(float(mine), float(torchs), exact, backend, f"step {step}")
    if scaled:
        scales = [s for _, s in our_history]
        assert any(b < a for a, b in zip(scales, scales[1:], strict=False)), (
            f"the scale never backed off: {scales}"
        )
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert p.dtype == q.dtype
        assert torch.equal(_bits(p), _bits(q)), name


def _mixed(dtype=torch.float16):
    """Problem 1 of the issue: a float16 Linear and an fp32 LayerNorm with masters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).to(dtype), torch.nn.LayerNorm(8))
    masters = ro.fp32_masters(model)
    return model, masters


def _backward(model, scaler):
    x = torch.randn(4, 8)
    loss = model[1](model[0](x.half()).float()).pow(2).sum()
    scaler.scale(loss).backward()


def test_torch_gradscaler_refuses_partners_before_anything_moves():
    model, masters = _mixed()
    opt = ro.SGD(masters, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _backward(model, scaler)
    before = [m.detach().clone() for m in masters]
    with pytest.raises(RuntimeError, match="roundpipe.optim.GradScaler"):
        scaler.step(opt)
    assert all(torch.equal(m, b) for m, b in zip(masters, before, strict=True))
    assert not opt.state


def test_roundpipe_gradscaler_steps_the_mixed_model_unscaled():
    model, masters = _mixed()
    opt = ro.SGD(masters, lr=0.1)
    scaler = ro.GradScaler("cpu", init_scale=1024.0)
    _backward(model, scaler)
    widened = [(m, (ro.partner_of(m) if ro.partner_of(m) is not None else m).grad.float()) for m in masters]
    before = [m.detach().clone() for m in masters]
    scaler.step(opt)
    scaler.update()
    for (m, g), b in zip(widened, before, strict=True):
        expected = b - 0.1 * (g * (1 / 1024.0))
        torch.testing.assert_close(m.detach(), expected, rtol=1e-6, atol=1e-7)


def test_torch_gradscaler_works_without_partners(backend):
    """Unpaired fp32 parameters: torch's GradScaler hands the unscale to the step
    (``_step_supports_amp_scaling``); the result is the for-loop composition's."""
    results = []
    for cls in (ro.SGD, torch.optim.SGD):
        torch.manual_seed(1)
        model = torch.nn.Linear(6, 3)
        kwargs = {"backend": backend} if cls is ro.SGD else {"foreach": False}
        opt = cls(model.parameters(), lr=0.1, momentum=0.9, **kwargs)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        for step in range(4):
            x = torch.randn(5, 6)
            if step == 2:
                x[0, 0] = float("nan")
            scaler.scale(model(x).pow(2).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (ours, our_scale), (theirs, their_scale) = results
    assert our_scale == their_scale
    for p, q in zip(ours, theirs, strict=True):
        if _exact(backend):
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q)


def test_clip_norm_types_and_nonfinite(backend):
    model, masters = _mixed(torch.bfloat16)
    opt = ro.AdamW(masters, backend=backend)
    loss = model[1](model[0](torch.randn(4, 8).bfloat16()).float()).pow(2).sum()
    loss.backward()
    widened = [(ro.partner_of(m) if ro.partner_of(m) is not None else m).grad.float() for m in masters]
    for norm_type in (2.0, 1.0, float("inf"), 3):
        expected = torch.nn.utils.get_total_norm(widened, norm_type)
        norm = opt.clip_grad_norm_(1e9, norm_type=norm_type)
        assert norm.dtype == torch.float32 and norm.shape == ()
        exact = exact_norm(widened, norm_type)
        assert_norm_close(norm.item(), expected.item(), exact, backend, f"norm_type {norm_type}", norm_type)
    assert not amp.pending(opt), "a coefficient of 1 records no factor"
    ro.partner_of(masters[0]).grad.view(-1)[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert ro.clip_grad_norm_(opt, 1.0).isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf")])
def test_one_pass_norm_is_the_float64_norm_rounded(dtype, norm_type):
    """The numba engine's norm over many chunks and tensors of each dtype, partners' and own
    gradients mixed: within an ulp of the float64 norm of the widened gradients."""
    g = torch.Generator().manual_seed(5)
    sizes = (0, 1, 31, 2**15 - 1, 2**15, 2**15 + 1, 100_003)
    params = [torch.zeros(n, requires_grad=True) for n in sizes if n or norm_type != float("inf")]
    partners = [torch.zeros(p.shape, dtype=dtype) for p in params]
    for p, q in zip(params, partners, strict=True):
        if dtype is torch.float32:
            p.grad = torch.randn(p.shape, generator=g) * 3
        else:
            ro.pair(p, q)
            q.grad = (torch.randn(p.shape, generator=g) * 3).to(dtype)
    opt = ro.SGD(params, lr=0.1, backend="fast:numba")
    grads = [p.grad if p.grad is not None else ro.partner_of(p).grad for p in params]
    norm = opt.clip_grad_norm_(1.0, norm_type=norm_type)
    torchs = torch.nn.utils.get_total_norm([t.float() for t in grads], norm_type)
    exact = exact_norm(grads, norm_type)
    assert_norm_close(norm.item(), torchs.item(), exact, "fast:numba", norm_type=norm_type)


def test_clip_after_a_write_to_the_checked_gradients_reads_them_again():
    """The inf check's sums serve a clip before the step only while the gradients are unchanged
    (their version counters)."""
    model, masters = _mixed(torch.float16)
    opt = ro.SGD(masters, lr=0.1, backend="fast:numba")
    scaler = ro.GradScaler("cpu", init_scale=4.0)
    _backward(model, scaler)
    scaler.unscale_(opt)
    ro.partner_of(masters[0]).grad.fill_(8.0)  # the user edits a gradient after the check
    grads = [(ro.partner_of(m) if ro.partner_of(m) is not None else m).grad for m in masters]
    unscaled = [g.float() / 4 if g.dtype is torch.float16 else g for g in grads]
    expected = torch.nn.utils.get_total_norm(unscaled)
    norm = opt.clip_grad_norm_(1e9).item()
    assert_norm_close(norm, expected.item(), exact_norm(unscaled), "fast:numba")


def test_zero_grad_drops_a_pending_clip():
    model, masters = _mixed(torch.bfloat16)
    opt = ro.SGD(masters, lr=0.1)
    model[1](model[0](torch.randn(4, 8).bfloat16()).float()).pow(2).sum().backward()
    opt.clip_grad_norm_(1e-3)
    assert amp.pending(opt)
    opt.zero_grad()
    assert not amp.pending(opt)


def test_clip_with_no_gradients_is_zero():
    opt = ro.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)
    assert opt.clip_grad_norm_(1.0).item() == 0.0
    copy.deepcopy(opt)  # nothing pending that cannot be copied


def _half_backward(model, seed=0, scaler=None):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).half()
    loss = model[1](model[0](x).float()).pow(2).sum()
    (scaler.scale(loss) if scaler is not None else loss).backward()


def _nothing_recorded(opt, *tensors):
    assert not amp.pending(opt)
    for t in tensors:
        assert not any(k.startswith("_roundpipe_grad") for k in t.__dict__), "state put on a tensor"


@pytest.mark.parametrize(
    "what", ["model.parameters()", "masters", "one master", "one partner", "torch.optim optimizer"]
)
def test_clip_refuses_parameters_naming_the_call(what):
    """torch's habit, clip_grad_norm_(model.parameters(), max_norm), raises TypeError naming
    opt.clip_grad_norm_ (the clip belongs to the optimizer whose step applies it), recording
    nothing; a torch.optim optimizer, whose step would never apply the clip, is refused too."""
    model, masters = _mixed()
    opt = ro.AdamW(masters)
    _half_backward(model)
    arg = {
        "model.parameters()": lambda: model.parameters(),
        "masters": lambda: masters,
        "one master": lambda: masters[0],
        "one partner": lambda: model[0].weight,
        "torch.optim optimizer": lambda: torch.optim.SGD(masters, lr=0.1),
    }[what]()
    call = (
        r"torch\.nn\.utils\.clip_grad_norm_\(params"
        if what.startswith("torch")
        else r"opt\.clip_grad_norm_\("
    )
    with pytest.raises(TypeError, match=call):
        ro.clip_grad_norm_(arg, 1.0)
    _nothing_recorded(opt, *masters, *model.parameters())


@pytest.mark.parametrize("max_norm", ["model.parameters()", "a one-element parameter", "a list"])
def test_clip_method_refuses_parameters_as_max_norm(max_norm):
    """opt.clip_grad_norm_(model.parameters(), 1.0), torch's arguments given to the method: a
    TypeError saying to pass max_norm alone, not a float() error or a parameter read as max_norm."""
    model, masters = _mixed()
    opt = ro.AdamW(masters)
    _half_backward(model)
    arg = {
        "model.parameters()": lambda: model.parameters(),
        "a one-element parameter": lambda: torch.nn.Parameter(torch.ones(1)),
        "a list": lambda: [1.0],
    }[max_norm]()
    with pytest.raises(TypeError, match=r"max_norm must be a number.*opt\.clip_grad_norm_\(max_norm\)"):
        opt.clip_grad_norm_(arg, 1.0)
    _nothing_recorded(opt)
    assert opt.clip_grad_norm_(torch.tensor(1e9)).isfinite()  # a 0-d tensor is a number, as in torch


def _mixed_run(misplaced_clip):
    """backward, step, (a clip after the step), opt.zero_grad(), backward, step."""
    model, masters = _mixed()
    opt = ro.AdamW(masters, lr=0.1)
    _half_backward(model, 0)
    opt.step()
    if misplaced_clip:
        opt.clip_grad_norm_(1e-3)
    opt.zero_grad()
    _half_backward(model, 1)
    opt.step()
    return [p.detach().clone() for p in (*masters, *model.parameters())]


def test_clip_between_step_and_zero_grad_is_dropped_as_in_torch():
    """torch's clip after the step scales gradients the step has read, which zero_grad then
    drops: no step is clipped. opt.zero_grad() drops the pending coefficient the same way."""
    for a, b in zip(_mixed_run(True), _mixed_run(False), strict=True):
        assert torch.equal(a, b)


STALE = {
    # how the gradients a pending clip measured stop being the ones the next step reads
    "model.zero_grad() then backward": lambda model, opt: (model.zero_grad(), _half_backward(model, 1)),
    "another backward (accumulated)": lambda model, opt: _half_backward(model, 1),
    "a gradient written in place": lambda model, opt: model[0].weight.grad.mul_(2),
    "a gradient replaced": lambda model, opt: setattr(model[1].bias, "grad", model[1].bias.grad * 2),
}


@pytest.mark.parametrize("case", list(STALE))
def test_clip_of_other_gradients_raises_before_anything_moves(case):
    """A coefficient pending for gradients that have changed since (a clip after step() with
    model.zero_grad() instead of opt.zero_grad(), another backward, an edit after the clip)
    would scale other gradients than torch's clip did: the step, and another clip, raise
    naming the order to use, and nothing moves; opt.zero_grad() drops it."""
    model, masters = _mixed()
    opt = ro.AdamW(masters, lr=0.1)
    _half_backward(model, 0)
    opt.step()
    opt.clip_grad_norm_(1e-3)
    STALE[case](model, opt)
    before, partner = snapshot(opt), model[0].weight.detach().clone()
    for call in (opt.step, lambda: opt.clip_grad_norm_(1.0)):
        with pytest.raises(
            RuntimeError, match=r"clip_grad_norm_ after the last backward, right before the step"
        ):
            call()
    assert_unchanged(opt, before)
    assert torch.equal(model[0].weight.detach(), partner)
    opt.zero_grad()
    _half_backward(model, 2)
    opt.clip_grad_norm_(1e-3)
    opt.step()
    assert not torch.equal(model[0].weight.detach(), partner)


def _two_optimizer_run(ours, steps=4):
    """A float16 Linear (fp32 masters; roundpipe) or its fp32 copies (torch's composition) and an
    fp32 LayerNorm, each in its own optimizer, one GradScaler: unscale_ one, step both, update.
    Step 1 puts an inf into the Linear's gradient only: that optimizer's step is skipped."""
    model, masters = _mixed()
    if ours:
        opts = [ro.SGD(masters[:2], lr=0.1, momentum=0.9), ro.Adam(masters[2:], lr=0.01)]
        scaler = ro.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    else:
        masters[:2] = [m.detach().clone() for m in masters[:2]]
        opts = [
            torch.optim.SGD(masters[:2], lr=0.1, momentum=0.9, foreach=False),
            torch.optim.Adam(masters[2:], lr=0.01, foreach=False),
        ]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    halves = list(model[0].parameters())
    scales = []
    for step in range(steps):
        _half_backward(model, step, scaler)
        if step == 1:
            halves[0].grad.view(-1)[3] = float("inf")
        if not ours:
            for m, q in zip(masters[:2], halves, strict=True):
                m.grad = q.grad.float()
        scaler.unscale_(opts[0])
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        if not ours:
            with torch.no_grad():
                for m, q in zip(masters[:2], halves, strict=True):
                    q.copy_(m)
        for opt in opts:
            opt.zero_grad()
        model.zero_grad()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in (*masters, *model.parameters())], scales


def test_one_scaler_with_two_optimizers_as_torch():
    """torch's GradScaler keeps per-optimizer state: one unscaled explicitly, one by its step,
    a step skipped for the optimizer whose gradients overflowed only, one update. With masters
    in one of them, the same steps and scales as the composition with torch.optim."""
    (ours, our_scales), (theirs, their_scales) = _two_optimizer_run(True), _two_optimizer_run(False)
    assert our_scales == their_scales and their_scales[1] < their_scales[0]
    for a, b in zip(ours, theirs, strict=True):
        if _exact(backends.resolve(None)):
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b)


def test_unscale_after_step_raises_torchs_error():
    model, masters = _mixed()
    opt = ro.SGD(masters, lr=0.1)
    scaler = ro.GradScaler("cpu", init_scale=4.0)
    _backward(model, scaler)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(opt)
    _nothing_recorded(opt)


REFUSED = {
    # the scaler, and what makes the optimizer's step refuse (in begin_step, or in its plan)
    "torch.amp.GradScaler": (torch.amp.GradScaler, lambda model, opt, scaler: None),
    "roundpipe's, a stale clip": (
        ro.GradScaler,
        lambda model, opt, scaler: (opt.clip_grad_norm_(1e-3), _half_backward(model, 1, scaler)),
    ),
    "roundpipe's, a bad gradient": (
        ro.GradScaler,
        lambda model, opt, scaler: setattr(model[0].bias.grad, "data", torch.zeros(9, dtype=torch.float16)),
    ),
}


def _scaled_then(model, opt, first, recover):
    """An iteration whose scaler.step raises, opt.zero_grad(), then one ``recover`` iteration."""
    scaler_cls, spoil = REFUSED[first]
    scaler = scaler_cls("cpu", init_scale=2.0**10)
    _half_backward(model, 0, scaler)
    spoil(model, opt, scaler)
    with pytest.raises((RuntimeError, ValueError)):
        scaler.step(opt)
    assert "grad_scale" not in opt.__dict__ and "found_inf" not in opt.__dict__
    opt.zero_grad()
    recover(model, opt)


def _plain_iteration(model, opt):
    _half_backward(model, 2)
    opt.step()


def _scaled_iteration(model, opt):
    scaler = ro.GradScaler("cpu", init_scale=2.0**6)
    _half_backward(model, 2, scaler)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("first", list(REFUSED))
@pytest.mark.parametrize("then", ["a plain step", "roundpipe.optim.GradScaler"])
def test_a_refused_step_under_a_scaler_leaves_no_scale_behind(first, then):
    """The scaler sets grad_scale and found_inf on the optimizer for its step and deletes them
    after; a step that refuses (torch's GradScaler with masters, a stale clip) must not leave
    them, or the next step (plain, or the next scaler's, which multiplies them in) unscales by
    a stale scale. After the error and opt.zero_grad(), the next iteration is a fresh one's."""
    recover = _plain_iteration if then == "a plain step" else _scaled_iteration
    model, masters = _mixed()
    opt = ro.SGD(masters, lr=0.1)
    _scaled_then(model, opt, first, recover)
    fresh_model, fresh_masters = _mixed()
    recover(fresh_model, ro.SGD(fresh_masters, lr=0.1))
    for a, b in zip(
        (*masters, *model.parameters()), (*fresh_masters, *fresh_model.parameters()), strict=True
    ):
        assert torch.equal(a, b)
