"""Mixed precision end to end (``roundpipe/optim/amp.py``): the float16 recipe (GradScaler and
clipping) and the bfloat16 recipe (clipping) train a small model with fp32 masters bit for bit
as the same loop written with torch.optim and explicit casts, on every backend; torch's own
GradScaler refuses a step it cannot see through; the clip norm, its options and its errors."""

import copy

import pytest
import torch

import roundpipe.optim as ro
from roundpipe.optim import amp, backends


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


def _torch_loop(dtype, scaler_cls):
    """The same loop with torch.optim and explicit casts: fp32 masters stepped by torch's
    for-loop AdamW, their gradients widened from the model's, written back rounded."""
    model = Net(dtype)
    params = list(model.parameters())
    masters = [p.detach().float() if p.dtype != torch.float32 else p for p in params]
    opt = torch.optim.AdamW(masters, lr=0.01, weight_decay=0.1, foreach=False)
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=3) if scaler_cls else None
    history = []
    for step in range(STEPS):
        loss = _loss(model, step, scaler is not None)
        (scaler.scale(loss) if scaler else loss).backward()
        for m, p in zip(masters, params, strict=True):
            if m is not p:
                m.grad = p.grad.float()
        if scaler:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)
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
    return model, history


def _bits(t):
    return t.detach().reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize(
    "dtype, scaled", [(torch.float16, True), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_recipe_matches_torch_composition(backend, dtype, scaled):
    ours, our_history = _roundpipe_loop(dtype, backend, ro.GradScaler if scaled else None)
    theirs, their_history = _torch_loop(dtype, torch.amp.GradScaler if scaled else None)
    if not _exact(backend):
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)
        return
    assert our_history == their_history  # clip norms and the loss scale, step by step
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


def test_clip_norm_types_and_nonfinite():
    model, masters = _mixed(torch.bfloat16)
    opt = ro.AdamW(masters)
    loss = model[1](model[0](torch.randn(4, 8).bfloat16()).float()).pow(2).sum()
    loss.backward()
    widened = [(ro.partner_of(m) if ro.partner_of(m) is not None else m).grad.float() for m in masters]
    for norm_type in (2.0, 1.0, float("inf"), 3):
        expected = torch.nn.utils.get_total_norm(widened, norm_type)
        assert torch.equal(opt.clip_grad_norm_(1e9, norm_type=norm_type), expected)
    assert not amp.pending(opt), "a coefficient of 1 records no factor"
    ro.partner_of(masters[0]).grad.view(-1)[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert ro.clip_grad_norm_(opt, 1.0).isnan()


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
