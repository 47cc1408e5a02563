"""bfloat16 and float16 parameters stepped directly, as a user meets them: every optimizer
against torch's for-loop on every engine that steps them (and numexpr's refusal), torch's
threads (its scalar tails move with them), loss scaling, clipping, schedulers, ``state_dict``
both ways, ``add_param_group``, and the optimizers that refuse them with a clear error."""

import pytest
import torch

import roundpipe.optim as ro
from roundpipe.optim.threads import torch_threads
from tests._util import (
    RICH_KWARGS,
    assert_bits_equal,
    assert_unchanged,
    roundtrip,
    rp_class,
    snapshot,
    torch_class,
)

DTYPES = (torch.bfloat16, torch.float16)
IDS = ["bfloat16", "float16"]
ENGINES = ("fast", "fast:torch", "reference")


def _params(dtype, shapes=((3, 5), (70001,), (31,)), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _twins(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(p.dtype) for p in params]


def _set(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def _assert_same(ours, theirs, opt, ref, where=""):
    for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
        assert_bits_equal(p.detach(), q.detach(), f"{where} param {i}")
        for k, v in ref.state[q].items():
            if isinstance(v, torch.Tensor):
                assert opt.state[p][k].dtype is v.dtype, k
                assert_bits_equal(opt.state[p][k], v, f"{where} param {i} state[{k!r}]")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("backend", ENGINES)
def test_every_optimizer_is_torchs_for_loop(name, backend, dtype):
    params = _params(dtype)
    twins = _twins(params)
    opt = rp_class(name)(params, backend=backend, **RICH_KWARGS[name])
    ref = torch_class(name)(twins, foreach=False, **RICH_KWARGS[name])
    for step in range(4):
        grads = _grads(params, step)
        _set(params, grads)
        _set(twins, grads)
        opt.step()
        ref.step()
        _assert_same(params, twins, opt, ref, f"step {step}")


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("backend", ["fast", "fast:torch"])
def test_torchs_thread_count_moves_its_tails(backend, threads):
    """torch's own bfloat16 step on 70,001 elements differs between thread counts (each chunk
    has a scalar tail); roundpipe follows the count torch has when it steps, also when it
    changes between steps (the replayed launch is not reused then)."""
    params = _params(torch.bfloat16, ((70001,),))
    twins = _twins(params)
    opt = ro.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1, backend=backend)
    ref = torch.optim.SGD(twins, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=False)
    for step, n in enumerate([threads, threads, 1, threads]):
        grads = _grads(params, step)
        _set(params, grads)
        _set(twins, grads)
        with torch_threads(n):
            opt.step()
            ref.step()
        _assert_same(params, twins, opt, ref, f"step {step} on {n} threads")
    one, many = _twins(params), _twins(params)
    for p in (*one, *many):
        p.grad = _grads(params, 9)[0]
    with torch_threads(threads):
        torch.optim.SGD(many, lr=0.1, weight_decay=0.1, foreach=False).step()
    torch.optim.SGD(one, lr=0.1, weight_decay=0.1, foreach=False).step()
    assert not torch.equal(one[0], many[0]), "torch's step no longer depends on its threads"


def test_numexpr_refuses_before_anything_moves():
    params = _params(torch.bfloat16, ((3, 5),))
    opt = ro.AdamW(params, backend="fast:numexpr")
    params[0].grad = torch.ones(3, 5, dtype=torch.bfloat16)
    snap = snapshot(opt)
    with pytest.raises(TypeError, match="fast:numexpr.*does not step torch.bfloat16"):
        opt.step()
    assert_unchanged(opt, snap)


@pytest.mark.parametrize("cls", ["Adafactor", "AdamW8bit"])
def test_staged_and_8_bit_optimizers_refuse_them(cls):
    p = torch.nn.Parameter(torch.zeros(300, 4, dtype=torch.bfloat16))
    p.grad = torch.ones(300, 4, dtype=torch.bfloat16)
    opt = getattr(ro, cls)([p])
    with pytest.raises(TypeError, match="fp32_masters"):
        opt.step()
    assert not opt.state


def test_state_of_another_dtype_raises():
    """A bfloat16 parameter with float32 state (a hand-made state_dict): refused, not mixed."""
    params = _params(torch.bfloat16, ((3, 5),))
    opt = ro.Adam(params)
    params[0].grad = torch.ones(3, 5, dtype=torch.bfloat16)
    opt.step()
    opt.state[params[0]]["exp_avg"] = opt.state[params[0]]["exp_avg"].float()
    with pytest.raises(RuntimeError, match="exp_avg.*float32, expected torch.bfloat16"):
        opt.step()


def _scaled_step(ours, twins, opt, ref, scaler, scale, step):
    """One loss-scaled step: ``scaler.step(opt)`` on ours; on torch's, the composition (torch's
    unscale in the gradients' dtype, as its kernel rounds it, then the for-loop step)."""
    scaler.scale(torch.ones(()))  # (as scaler.scale(loss).backward() would)
    grads = _grads(ours, step, scale=scale)
    if step == 2:
        grads[0].view(-1)[1] = float("inf")  # skipped: the scale backs off
    _set(ours, grads)
    _set(twins, grads)
    scaler.step(opt)
    scaler.update()
    found = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([q.grad for q in twins], found, torch.tensor(1 / scale))
    if not found:
        ref.step()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("backend", ENGINES)
def test_grad_scaler(backend, dtype):
    """torch's GradScaler: scaler.step unscales inside the step (torch.optim's for-loop would
    refuse float16 gradients), as torch's unscale kernel rounds them, and skips a step with an
    inf; scaler.unscale_ on float16 gradients raises as torch's does."""
    params = _params(dtype, ((3, 5), (70001,)))
    twins = _twins(params)
    opt = ro.AdamW(params, lr=1e-2, backend=backend)
    ref = torch.optim.AdamW(twins, lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    for step in range(5):
        scale = scaler.get_scale()
        _scaled_step(params, twins, opt, ref, scaler, scale, step)
        _assert_same(params, twins, opt, ref, f"step {step}")
    assert scaler.get_scale() != 1024.0
    if dtype is torch.float16:
        _set(params, _grads(params, 9))
        with pytest.raises(ValueError, match="FP16"):
            scaler.unscale_(opt)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("mixed", [False, True], ids=["one dtype", "with float32"])
def test_clip_grad_norm(backend, dtype, mixed):
    """opt.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_ on the same gradients (a total
    norm in their dtype, or in float32 beside float32 ones), then the step; and torch's own
    clip before roundpipe's step works as before one of torch's."""
    params = _params(dtype, ((3, 5), (70001,)))
    if mixed:
        params.append(torch.nn.Parameter(torch.randn(7, 3)))
    twins, third = _twins(params), _twins(params)
    opt = ro.Adam(params, lr=1e-2, backend=backend)
    other = ro.Adam(third, lr=1e-2, backend=backend)
    ref = torch.optim.Adam(twins, lr=1e-2, foreach=False)
    for step in range(3):
        grads = _grads(params, step, scale=10.0)
        for ps in (params, twins, third):
            _set(ps, grads)
        total = opt.clip_grad_norm_(0.5)
        theirs = torch.nn.utils.clip_grad_norm_(twins, 0.5)
        torch.nn.utils.clip_grad_norm_(third, 0.5)
        assert total.dtype is theirs.dtype and bool(total == theirs), (total, theirs)
        opt.step()
        other.step()
        ref.step()
        _assert_same(params, twins, opt, ref, f"step {step}")
        _assert_same(third, twins, other, ref, f"step {step}, torch's clip")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_scheduler_state_dict_and_add_param_group(dtype):
    params = _params(dtype, ((3, 5), (40,)))
    twins = _twins(params)
    opt = ro.AdamW(params[:1], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(twins[:1], lr=1e-2, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    for step in range(6):
        if step == 2:
            opt.add_param_group({"params": params[1:], "lr": 3e-3})
            ref.add_param_group({"params": twins[1:], "lr": 3e-3})
        n = 1 if step < 2 else 2
        grads = _grads(params[:n], step)
        _set(params[:n], grads)
        _set(twins[:n], grads)
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
        _assert_same(params[:n], twins[:n], opt, ref, f"step {step}")
    # torch's state_dict into roundpipe and roundpipe's into torch: both continue bit for bit
    mine = ro.AdamW([{"params": _twins(params[:1])}, {"params": _twins(params[1:])}])
    mine.load_state_dict(roundtrip(ref.state_dict()))  # (a checkpoint: its own tensors)
    groups = [{"params": _twins(params[:1])}, {"params": _twins(params[1:])}]
    theirs = torch.optim.AdamW(groups, foreach=False)
    theirs.load_state_dict(roundtrip(opt.state_dict()))
    ps_mine = [p for g in mine.param_groups for p in g["params"]]
    ps_theirs = [p for g in theirs.param_groups for p in g["params"]]
    for k, v in mine.state[ps_mine[0]].items():
        assert v.dtype is ref.state[twins[0]][k].dtype, k
    for step in range(6, 8):
        grads = _grads(params, step)
        for ps in (params, twins, ps_mine, ps_theirs):
            _set(ps, grads)
        for o in (opt, ref, mine, theirs):
            o.step()
        _assert_same(params, twins, opt, ref, f"step {step}")
        _assert_same(ps_mine, twins, mine, ref, f"step {step}, loaded from torch")
        _assert_same(ps_theirs, twins, theirs, ref, f"step {step}, torch loaded ours")
