"""``state_dtype=`` and ``stochastic_rounding=`` as a user meets them (``roundpipe.optim.storage``):
the errors, each against the composition that defines it (torch.optim's float32 for-loop on
widened copies, the state rounded to its dtype, the parameter to its own), fp32 masters with
bfloat16 state, ``state_dict`` both ways, loss scaling, clipping, groups, schedulers and hooks;
stochastic rounding unbiased, the same on every engine and thread count, resumed bit for bit."""

import pytest
import torch

import roundpipe.optim as ro
from roundpipe.optim.spec import SPECS
from roundpipe.optim.storage import element_bits, param_key, random_bits, step_key, stochastic_round
from tests._util import assert_bits_equal, assert_unchanged, roundtrip, snapshot, torch_class

ENGINES = ("fast", "fast:torch", "reference")
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _params(dtype, shapes=((3, 5), (70001,), (31,)), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(p.dtype) for p in params]


def _set(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone()


def _seeded(cls, params, seed=7, **kwargs):
    """An optimizer whose stochastic rounding stream is drawn after ``torch.manual_seed(seed)``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls(params, **kwargs)


class Composed:
    """The definition, with torch.optim: its for-loop on float32 copies of ``params``; before and
    after each step the state rounded to ``state_dtype`` (None: each parameter's dtype), after
    it each stepped parameter rounded to its dtype (stochastically with ``seed``)."""

    def __init__(self, name, params, state_dtype=None, seed=None, groups=None, **kwargs):
        self.name, self.state_dtype, self.seed, self.steps = name, state_dtype, seed, 0
        self.dtypes = [p.dtype for p in params]
        self.params = [torch.nn.Parameter(p.detach().to(F32, copy=True)) for p in params]
        # ``groups``: (indices of params, that group's options) per param group
        found = [
            {"params": [self.params[i] for i in idx], **kw}
            for idx, kw in groups or [(range(len(params)), {})]
        ]
        self.opt = torch_class(name)(found, foreach=False, **kwargs)

    def stored(self, dtype):
        return self.state_dtype or dtype

    def _round_state(self):
        with torch.no_grad():
            for p, dtype in zip(self.params, self.dtypes, strict=True):
                for k, v in self.opt.state.get(p, {}).items():
                    if k not in SPECS[self.name].scalar_state:
                        v.copy_(v.to(self.stored(dtype)))

    def step(self, grads):
        """One step on ``grads`` (in the parameters' dtypes, as the user's run has them)."""
        for p, g in zip(self.params, grads, strict=True):
            p.grad = None if g is None else g.float()
        self._round_state()
        self.opt.step()
        self._round_state()
        with torch.no_grad():
            for pid, (p, dtype) in enumerate(zip(self.params, self.dtypes, strict=True)):
                if p.grad is not None and dtype is not F32:
                    rounded = (
                        p.to(dtype) if self.seed is None else stochastic_round(p, self.seed, self.steps, pid)
                    )
                    p.copy_(rounded)
        self.steps += 1

    def check(self, ours, opt, where=""):
        for i, (p, q, dtype) in enumerate(zip(ours, self.params, self.dtypes, strict=True)):
            assert p.dtype is dtype
            assert_bits_equal(p.detach(), q.detach().to(dtype), f"{where} param {i}")
            for k, v in self.opt.state.get(q, {}).items():
                mine = opt.state[p][k]
                if k in SPECS[self.name].scalar_state:
                    assert mine.dtype is v.dtype and torch.equal(mine, v), (where, k)
                else:
                    assert mine.dtype is self.stored(dtype), (where, k, mine.dtype)
                    assert_bits_equal(mine, v.to(mine.dtype), f"{where} param {i} state[{k!r}]")


# ----------------------------------------------------------------------------------------------
# what is refused, before anything moves


@pytest.mark.parametrize(
    "kwargs, dtype, match",
    [
        ({"state_dtype": torch.int32}, F32, "state_dtype=torch.int32 is not offered"),
        ({"state_dtype": torch.float64}, F32, "state_dtype=torch.float64 is not offered"),
        ({"state_dtype": "bfloat16"}, F32, "state_dtype must be a torch.dtype"),
        ({"stochastic_rounding": 1}, BF16, "stochastic_rounding must be True or False"),
        ({"stochastic_rounding": True}, F32, "rounds bfloat16 parameters; this one is torch.float32"),
        ({"stochastic_rounding": True}, F16, "rounds bfloat16 parameters; this one is torch.float16"),
        ({"state_dtype": BF16}, torch.complex64, "for real parameters"),
    ],
)
def test_refused_at_construction(kwargs, dtype, match):
    p = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
    with pytest.raises(TypeError, match=match):
        ro.AdamW([p], **kwargs)


@pytest.mark.parametrize("name", ["Adafactor", "Muon"])
def test_staged_optimizers_take_neither(name):
    if not hasattr(ro, name):
        pytest.skip(f"torch.optim.{name} needs a newer torch")
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(TypeError, match="does not take state_dtype or stochastic_rounding"):
        getattr(ro, name)([p], state_dtype=BF16)
    assert getattr(ro, name)([p], state_dtype=None).state_dtype is None


def test_a_parameter_added_later_is_refused_before_anything_moves():
    params = _params(BF16, ((3, 5),))
    opt = ro.AdamW(params, stochastic_rounding=True)
    _set(params, _grads(params, 0))
    opt.step()
    fp32 = torch.nn.Parameter(torch.zeros(3))
    fp32.grad = torch.ones(3)
    opt.add_param_group({"params": [fp32]})
    _set(params, _grads(params, 1))
    snap = snapshot(opt)
    with pytest.raises(TypeError, match=r"param_groups\[1\]\['params'\]\[0\].*rounds bfloat16 parameters"):
        opt.step()
    assert_unchanged(opt, snap)


@pytest.mark.parametrize("kwargs", [{"state_dtype": BF16}, {"stochastic_rounding": True}])
def test_numexpr_refuses_before_anything_moves(kwargs):
    params = _params(BF16 if kwargs.get("stochastic_rounding") else F32, ((3, 5),))
    opt = ro.AdamW(params, backend="fast:numexpr", **kwargs)
    _set(params, _grads(params, 0))
    snap = snapshot(opt)
    with pytest.raises(TypeError, match="fast:numexpr.*does not take state_dtype or stochastic_rounding"):
        opt.step()
    assert_unchanged(opt, snap)
    assert not opt.state


def test_state_of_another_dtype_raises():
    params = _params(F32, ((3, 5),))
    opt = ro.Adam(params, state_dtype=BF16)
    _set(params, _grads(params, 0))
    opt.step()
    opt.state[params[0]]["exp_avg"] = opt.state[params[0]]["exp_avg"].float()
    with pytest.raises(RuntimeError, match="exp_avg.*float32, expected torch.bfloat16"):
        opt.step()


# ----------------------------------------------------------------------------------------------
# against the composition


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize(
    "dtype, state_dtype", [(F32, BF16), (F32, F16), (BF16, F32), (F16, F32), (F16, BF16)], ids=str
)
def test_layouts(backend, dtype, state_dtype):
    """Every combination of parameter and state dtype offered: the composition, bit for bit."""
    params = _params(dtype)
    opt = ro.AdamW(params, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, backend=backend)
    ref = Composed("AdamW", params, state_dtype, lr=1e-2, weight_decay=0.1)
    for step in range(4):
        grads = _grads(params, step)
        _set(params, grads)
        opt.step()
        ref.step(grads)
        ref.check(params, opt, f"step {step}")


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("backend", ENGINES)
def test_the_parameters_dtype_is_the_default(backend, dtype):
    """On 16-bit parameters, a state_dtype of their own dtype is the default: torch's for-loop
    on them as they are, each op rounded (docs/low-precision.md), not the float32 composition."""
    params, twins = _params(dtype), _params(dtype)
    opt = ro.AdamW(params, lr=1e-2, state_dtype=dtype, backend=backend)
    ref = torch.optim.AdamW(twins, lr=1e-2, foreach=False)
    for step in range(3):
        grads = _grads(params, step)
        _set(params, grads)
        _set(twins, grads)
        opt.step()
        ref.step()
    for p, q in zip(params, twins, strict=True):
        assert_bits_equal(p.detach(), q.detach())
        assert_bits_equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


@pytest.mark.parametrize("backend", ENGINES)
def test_fp32_masters_with_bf16_state_take_10_bytes_a_parameter(backend):
    """A bfloat16 model, fp32 masters, bfloat16 moments: 2 + 4 + 2 * 2 bytes an element, and the
    composition (the partner's gradient widened, the step, the partner written) bit for bit."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 33), torch.nn.Linear(33, 7)).to(BF16)
    masters = ro.fp32_masters(model)
    opt = ro.AdamW(masters, lr=1e-2, weight_decay=0.1, state_dtype=BF16, backend=backend)
    ref = Composed("AdamW", masters, BF16, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        grads = _grads(list(model.parameters()), step)
        _set(list(model.parameters()), grads)
        opt.step()
        ref.step([g.float() for g in grads])
        ref.check(masters, opt, f"step {step}")
        for q, m in zip(model.parameters(), ref.params, strict=True):
            assert_bits_equal(q.detach(), m.detach().to(BF16), f"step {step} partner")
    numel = sum(p.numel() for p in masters)
    held = sum(p.numel() * p.element_size() for p in (*masters, *model.parameters()))
    held += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim())
    assert held == 10 * numel


def test_first_step_state_is_the_float32_steps_then_rounded():
    """Rprop creates step_size = lr, which bfloat16 does not hold: the first step reads it as the
    float32 step does, and stores it rounded after."""
    params = _params(F32, ((3, 5),))
    opt = ro.Rprop(params, lr=0.01, state_dtype=BF16)
    ref = Composed("Rprop", params, BF16, lr=0.01)
    for step in range(3):
        grads = _grads(params, step)
        _set(params, grads)
        opt.step()
        ref.step(grads)
        ref.check(params, opt, f"step {step}")
        assert opt.state[params[0]]["step_size"].dtype is BF16
        assert opt.state[params[0]]["step"].dtype is F32  # (0-d state as torch keeps it)


def test_adagrads_initial_state_is_stored_at_construction():
    params = _params(BF16, ((3, 5),))
    opt = ro.Adagrad(params, initial_accumulator_value=0.1, state_dtype=F32)
    assert opt.state[params[0]]["sum"].dtype is F32
    assert bool((opt.state[params[0]]["sum"] == torch.tensor(0.1)).all())  # (not bfloat16's 0.1)
    fp32 = _params(F32, ((3, 5),))
    assert ro.Adagrad(fp32, state_dtype=BF16).state[fp32[0]]["sum"].dtype is BF16


# ----------------------------------------------------------------------------------------------
# state_dict, pickling


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_state_dict_both_ways(backend):
    """Ours (bfloat16 state) loads into torch.optim (cast to float32) and steps on as torch's
    would from that state; torch's float32 state loads into ours rounded to bfloat16."""
    params = _params(F32)
    opt = ro.AdamW(params, lr=1e-2, state_dtype=BF16, backend=backend)
    _set(params, _grads(params, 0))
    opt.step()
    sd = roundtrip(opt.state_dict())
    assert sd["state"][0]["exp_avg"].dtype is BF16 and "stochastic_rounding" not in sd
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    theirs = torch.optim.AdamW(twins, lr=1e-2, foreach=False)
    theirs.load_state_dict(sd)
    assert theirs.state[twins[0]]["exp_avg"].dtype is F32
    assert torch.equal(theirs.state[twins[0]]["exp_avg"], opt.state[params[0]]["exp_avg"].float())
    _set(twins, _grads(twins, 1))
    theirs.step()
    back = ro.AdamW([torch.nn.Parameter(p.detach().clone()) for p in twins], lr=1e-2, state_dtype=BF16)
    back.load_state_dict(theirs.state_dict())
    for k in ("exp_avg", "exp_avg_sq"):
        mine, torchs = back.state[back.param_groups[0]["params"][1]][k], theirs.state[twins[1]][k]
        assert mine.dtype is BF16 and torch.equal(mine, torchs.to(BF16)), k
    copy = roundtrip(back)
    assert copy.state_dtype is BF16 and copy.backend == back.backend and not copy.stochastic_rounding


def test_stochastic_rounding_keeps_its_stream_in_state_dict():
    params = _params(BF16, ((3, 5),))
    opt = _seeded(ro.SGD, params, lr=0.1, stochastic_rounding=True)
    seed = opt.state_dict()["stochastic_rounding"]["seed"]
    _set(params, _grads(params, 0))
    opt.step()
    assert opt.state_dict()["stochastic_rounding"] == {"seed": seed, "steps": 1}
    assert "stochastic_rounding=True" in repr(opt)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    theirs = torch.optim.SGD(twins, lr=0.1)
    theirs.load_state_dict(opt.state_dict())  # (torch.optim ignores the entry)
    other = _seeded(ro.SGD, twins, seed=8, lr=0.1, stochastic_rounding=True)
    mine = other.state_dict()["stochastic_rounding"]
    other.load_state_dict(theirs.state_dict())  # torch's: no stream, this one's is kept
    assert other.state_dict()["stochastic_rounding"] == mine
    bad = {**opt.state_dict(), "stochastic_rounding": {"seed": 1.5, "steps": 0}}
    with pytest.raises(ValueError, match="needs an int seed and steps"):
        other.load_state_dict(bad)


# ----------------------------------------------------------------------------------------------
# stochastic rounding


def test_the_random_bits_are_the_python_definition():
    for key in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
        start = 2**31 - 40  # (across int32's sign and beyond)
        bits = random_bits(key, start, 100).tolist()
        assert bits == [element_bits(key, i) for i in range(start, start + 100)]
    assert param_key(step_key(5, 0), 0) != param_key(step_key(5, 0), 1) != param_key(step_key(5, 1), 0)


def test_rounding_a_value_many_times_is_unbiased():
    """The mean of many roundings of one value is the value (nearest rounding is one ulp off)."""
    x = torch.full((1 << 16,), 1.0 + 2.0**-10)  # between bfloat16's 1 and 1 + 2**-7
    means = [stochastic_round(x, seed, steps, 0).float().mean().item() for seed in (1, 2) for steps in (0, 9)]
    spread = 2.0**-7 * (0.125 * 0.875 / x.numel()) ** 0.5  # one standard deviation of a mean
    assert all(abs(m - x[0].item()) < 5 * spread for m in means), means
    assert x.to(BF16).float().mean().item() == 1.0
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1.0])
    out = stochastic_round(special, 3, 0, 0)
    assert out[0].isnan() and out[1:].tolist() == [float("inf"), -float("inf"), 0.0, 0.0, 1.0]
    assert torch.signbit(out[3]) and not torch.signbit(out[4])


@pytest.mark.parametrize("backend", ENGINES)
def test_tiny_updates_add_up(backend):
    """SGD adding 2**-12 a step to bfloat16 ones (an ulp there is 2**-7): nearest rounding loses
    every update, stochastic rounding adds them up on average."""
    steps, n = 64, 1 << 15

    def run(**kwargs):
        p = torch.nn.Parameter(torch.ones(n, dtype=BF16))
        opt = _seeded(ro.SGD, [p], lr=1.0, backend=backend, **kwargs)
        for _ in range(steps):
            p.grad = torch.full((n,), -(2.0**-12), dtype=BF16)
            opt.step()
        return p.detach().float()

    assert bool((run(state_dtype=F32) == 1.0).all())  # (the float32 step, rounded to nearest)
    assert bool((run() == 1.0).all())  # (torch's own bfloat16 step)
    sr = run(stochastic_rounding=True)
    expected = 1.0 + steps * 2.0**-12
    assert abs(sr.mean().item() - expected) < 2e-4, sr.mean().item()


class _threads:
    """roundpipe's thread count ``n`` inside the block."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.before = ro.get_num_threads()
        ro.set_num_threads(self.n)

    def __exit__(self, *exc):
        ro.set_num_threads(self.before)


def _sr_run(backend, threads, steps=4):
    params = _params(BF16)
    opt = _seeded(ro.AdamW, params, lr=1e-2, weight_decay=0.1, stochastic_rounding=True, backend=backend)
    with _threads(threads):
        for step in range(steps):
            _set(params, _grads(params, step))
            opt.step()
    return params, opt


def test_the_same_seed_gives_the_same_bits_on_every_engine_and_thread_count():
    ref_params, ref = _sr_run("reference", 1)
    seed = ref.state_dict()["stochastic_rounding"]["seed"]
    composed = Composed("AdamW", _params(BF16), None, seed, lr=1e-2, weight_decay=0.1)
    for step in range(4):
        composed.step(_grads(ref_params, step))
    composed.check(ref_params, ref, "reference")
    for backend, threads in [("fast:numba", 1), ("fast:numba", 2), ("fast:torch", 1), ("fast:torch", 2)]:
        params, opt = _sr_run(backend, threads)
        for i, (p, q) in enumerate(zip(params, ref_params, strict=True)):
            assert_bits_equal(p.detach(), q.detach(), f"{backend} on {threads} threads, param {i}")
            for k in ("exp_avg", "exp_avg_sq"):
                assert_bits_equal(opt.state[p][k], ref.state[q][k], f"{backend} {threads} threads {k}")


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_a_resumed_run_continues_the_stream(backend):
    straight, opt = _sr_run(backend, 1, steps=6)
    params = _params(BF16)
    first = _seeded(ro.AdamW, params, lr=1e-2, weight_decay=0.1, stochastic_rounding=True, backend=backend)
    for step in range(3):
        _set(params, _grads(params, step))
        first.step()
    checkpoint = roundtrip({"params": [p.detach() for p in params], "opt": first.state_dict()})
    resumed = [torch.nn.Parameter(t.clone()) for t in checkpoint["params"]]
    second = _seeded(
        ro.AdamW, resumed, seed=99, lr=1e-2, weight_decay=0.1, stochastic_rounding=True, backend=backend
    )
    second.load_state_dict(checkpoint["opt"])
    for step in range(3, 6):
        _set(resumed, _grads(resumed, step))
        second.step()
    for p, q in zip(resumed, straight, strict=True):
        assert_bits_equal(p.detach(), q.detach())
    assert second.state_dict()["stochastic_rounding"] == opt.state_dict()["stochastic_rounding"]


# ----------------------------------------------------------------------------------------------
# everything else, as for float32


@pytest.mark.parametrize("backend", ENGINES)
def test_grad_scaler_on_float16_parameters(backend):
    """torch's GradScaler: scaler.step unscales the float16 gradients inside the step, as
    torch's unscale kernel rounds them in their dtype, then the widened step; an inf skips it."""
    params = _params(F16, ((3, 5), (70001,)))
    opt = ro.AdamW(params, lr=1e-2, state_dtype=F32, backend=backend)
    ref = Composed("AdamW", params, F32, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    for step in range(5):
        scale = scaler.get_scale()
        scaler.scale(torch.ones(()))
        grads = _grads(params, step, scale=scale)
        if step == 2:
            grads[0].view(-1)[1] = float("inf")
        _set(params, grads)
        scaler.step(opt)
        scaler.update()
        found = torch.zeros(())
        unscaled = [g.clone() for g in grads]
        torch._amp_foreach_non_finite_check_and_unscale_(unscaled, found, torch.tensor(1 / scale))
        if not found:
            ref.step(unscaled)
        ref.check(params, opt, f"step {step}")
    assert scaler.get_scale() != 1024.0


@pytest.mark.parametrize("backend", ENGINES)
def test_clip_grad_norm_with_stochastic_rounding(backend):
    """opt.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_ on the bfloat16 gradients (the
    coefficient applied in their dtype), then the widened step."""
    params = _params(BF16, ((3, 5), (70001,)))
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = _seeded(ro.Adam, params, lr=1e-2, stochastic_rounding=True, backend=backend)
    ref = Composed("Adam", params, None, opt.state_dict()["stochastic_rounding"]["seed"], lr=1e-2)
    for step in range(3):
        grads = _grads(params, step, scale=10.0)
        _set(params, grads)
        _set(twins, grads)
        total = opt.clip_grad_norm_(0.5)
        theirs = torch.nn.utils.clip_grad_norm_(twins, 0.5)
        assert total.dtype is theirs.dtype and bool(total == theirs)
        opt.step()
        ref.step([q.grad for q in twins])
        ref.check(params, opt, f"step {step}")


@pytest.mark.parametrize("backend", ENGINES)
def test_groups_schedulers_hooks_and_clipping(backend):
    """Two param groups (one added later), a scheduler, step hooks and torch's clip on fp32
    parameters with bfloat16 state: the composition. (opt.clip_grad_norm_ of float32 gradients
    takes the norm in float64 on the numba engine: not torch's bits, tests/test_amp.py.)"""
    params = _params(F32, ((3, 5), (70001,), (31,)))
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ro.AdamW(params[:2], lr=1e-2, weight_decay=0.1, state_dtype=BF16, backend=backend)
    opt.add_param_group({"params": params[2:], "lr": 3e-3})
    ref = Composed(
        "AdamW", params, BF16, groups=[([0, 1], {}), ([2], {"lr": 3e-3})], lr=1e-2, weight_decay=0.1
    )
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref.opt)]
    for step in range(3):
        grads = _grads(params, step, scale=10.0)
        _set(params, grads)
        _set(twins, grads)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        torch.nn.utils.clip_grad_norm_(twins, 1.0)
        opt.step()
        ref.step([q.grad for q in twins])
        for s in schedules:
            s.step()
        ref.check(params, opt, f"step {step}")
    assert calls == ["pre", "post"] * 3
