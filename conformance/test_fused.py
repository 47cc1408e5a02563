"""roundpipe.optim's ``fused=True`` against torch.optim's ``fused=True`` (torch's fused CPU kernel),
bit for bit: parameters and state after every step, on float32, bfloat16 and float16 parameters,
every backend that steps them, at 1 and 3 torch threads.

Adam, AdamW, SGD and Adagrad (the optimizers whose ``fused=True`` roundpipe honours:
``spec.fused_kernel``), their options against each other (Adam's ``amsgrad``, ``maximize``,
``weight_decay``, both lerp branches of ``betas``; SGD's ``momentum``, ``dampening``,
``nesterov``; Adagrad's ``lr_decay``, ``initial_accumulator_value``), a tensor ``lr``, and groups
that mix ``fused`` with the for-loop. Each dtype's parameters: 0-d, 1, 15 and 17 elements, an odd
2-D shape, 70,001 elements; gradients that are None every third step, zero, subnormal or large
(squares past the dtype's largest).

The ground truth on bfloat16 and float16 is torch's fused kernel where the installed torch's is
right, and otherwise (``KNOWN_WRONG``: 2.13's 16-bit SGD and Adagrad) what the release that fixed
it computes: torch's float32 kernel on the widened tensors, each stored tensor rounded once, cut
in the 16-bit kernels' remainder (``WidenedFused``), which a test holds equal to torch's own
16-bit kernels wherever they are right.

Every element bit for bit, the kernels' scalar remainder included (the last ``numel % 8``
float32 elements, ``numel % 16`` 16-bit ones, which contract a multiply-add otherwise: the
spec's ``in_remainder``, its step measured by ``fused_kernels.remainder_step``).
"""

from __future__ import annotations

import collections
import itertools

import pytest
import torch

import roundpipe.optim as ro
from roundpipe.optim import fused_kernels
from roundpipe.optim.threads import torch_threads

from .harness import bits_mismatch

STEPS = 10
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("reference", "fast:numba", "fast:torch")
SHAPES = ((), (1,), (15,), (17,), (33, 65), (70001,))
# per dtype: a gradient scale whose squares pass the largest value (inf in exp_avg_sq)
LARGE = {torch.float32: 1e20, torch.bfloat16: 1e20, torch.float16: 300.0}
TINY = {torch.float32: 1e-40, torch.bfloat16: 1e-39, torch.float16: 1e-6}


def _cases():
    grid = itertools.product(("Adam", "AdamW"), (False, True), (False, True), (0.0, 0.1))
    out = [(name, dict(amsgrad=a, maximize=m, weight_decay=wd)) for name, a, m, wd in grid]
    out += [
        ("Adam", dict(betas=(0.3, 0.9))),  # 1 - beta1 >= 0.5: lerp's other branch
        ("AdamW", dict(betas=(0.3, 0.9), amsgrad=True)),
        ("AdamW", dict(lr=torch.tensor(0.01))),
        (
            "Adam",
            dict(lr=torch.tensor(0.02), betas=(torch.tensor(0.8), torch.tensor(0.99)), weight_decay=1e-1),
        ),
    ]
    momenta = (
        dict(),
        dict(momentum=0.9),
        dict(momentum=0.9, dampening=0.3),
        dict(momentum=0.9, nesterov=True),
    )
    for m, maximize, wd in itertools.product(momenta, (False, True), (0.0, 0.1)):
        out.append(("SGD", dict(m, maximize=maximize, weight_decay=wd)))
    out.append(("SGD", dict(lr=torch.tensor(0.02), momentum=0.5)))
    accumulate = (dict(), dict(lr_decay=0.01, initial_accumulator_value=0.1))
    for acc, maximize, wd in itertools.product(accumulate, (False, True), (0.0, 0.1)):
        out.append(("Adagrad", dict(acc, maximize=maximize, weight_decay=wd)))
    out.append(("Adagrad", dict(lr=torch.tensor(0.05), eps=1e-3)))
    return out


CASES = _cases()


def _grad(step, i, shape, dtype):
    if i == 3 and step % 3 == 1:
        # (the 17-element parameter; not on the first step: torch's fused SGD cannot step a
        # first gradient that comes late, test_sgd_late_first_gradient_steps_as_the_for_loop)
        return None
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + i))
    if i == 2 and step % 2:
        g = g * TINY[dtype]
    if i == 4:
        g = g * (LARGE[dtype] if step == 4 else 1.0)
    if i == 5:
        g.view(-1)[::7] = 0
    return g.to(dtype)


def _params(dtype):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


class WidenedFused:
    """torch's float32 fused optimizer stepping widened copies of 16-bit parameters, each stored
    tensor (parameter, state) rounded back to the parameter's dtype once a step: what a 16-bit
    fused kernel computes from torch 2.14 on. The 16-bit kernel's scalar remainder is longer than
    the float32 kernel's (``fused_kernels.remainder_step`` of each): each parameter is stepped in
    pieces, the elements before its 16-bit remainder (a multiple of the 16-bit step, all in the
    float32 kernel's vector loops) and that remainder in pieces shorter than the float32 step
    (all in the float32 kernel's scalar loop). ``state`` is keyed by the 16-bit parameters."""

    def __init__(self, cls, groups, **kwargs):
        self.pieces = {}  # 16-bit parameter -> its float32 pieces
        wide_groups = []
        for group in groups:
            wide = []
            for p in group["params"]:
                self.pieces[p] = self._cut(p)
                wide += self.pieces[p]
            wide_groups.append({**group, "params": wide})
        self.opt = cls(wide_groups, **kwargs)
        self._round()  # (Adagrad's initial sum, in the parameter's dtype)

    @staticmethod
    def _cut(p):
        flat = p.detach().float().reshape(-1)
        n = flat.numel()
        body = n - n % fused_kernels.remainder_step(p.dtype)
        short = fused_kernels.remainder_step(torch.float32) - 1
        spans = [(0, body)] if body or not n else []
        spans += [(a, min(a + short, n)) for a in range(body, n, short)]
        return [flat[a:b].clone().requires_grad_() for a, b in spans]

    def _round(self):
        for p, pieces in self.pieces.items():
            for w in pieces:
                with torch.no_grad():
                    w.copy_(w.to(p.dtype))
                for key, v in self.opt.state.get(w, {}).items():
                    if key != "step":
                        v.copy_(v.to(p.dtype))

    def step(self):
        for p, pieces in self.pieces.items():
            grads = None if p.grad is None else p.grad.float().reshape(-1).split([w.numel() for w in pieces])
            for i, w in enumerate(pieces):
                w.grad = None if grads is None else grads[i].clone()
        self.opt.step()
        self._round()
        for p, pieces in self.pieces.items():
            with torch.no_grad():
                p.copy_(torch.cat([w.detach() for w in pieces]).reshape(p.shape))

    @property
    def state(self):
        out = {}
        for p, pieces in self.pieces.items():
            if pieces[0] in self.opt.state:
                first = self.opt.state[pieces[0]]
                out[p] = {
                    k: v
                    if k == "step"
                    else torch.cat([self.opt.state[w][k] for w in pieces]).reshape(p.shape).to(p.dtype)
                    for k, v in first.items()
                }
        return out


class _Split:
    """torch's for-loop groups and the widened fused ones, as one optimizer."""

    def __init__(self, *opts):
        self.opts = opts

    @property
    def state(self):
        out = collections.defaultdict(dict)  # (torch's: a parameter without state has {})
        for o in self.opts:
            out.update(o.state)
        return out

    def step(self):
        for o in self.opts:
            o.step()


def _theirs(name, dtype, groups, kwargs):
    """The ground truth: torch's optimizer, with its fused groups ``WidenedFused`` where this
    torch's 16-bit kernel is ``KNOWN_WRONG``."""
    cls = getattr(torch.optim, name)
    if not fused_kernels.known_wrong(name, dtype):
        return cls(groups, **kwargs)
    fused = [g for g in groups if g.get("fused")]
    loop = [g for g in groups if not g.get("fused")]
    return _Split(WidenedFused(cls, fused, **kwargs), *([cls(loop, **kwargs)] if loop else []))


def _compare(ours, theirs, dtype, what, name=None):
    assert ours.dtype == theirs.dtype == dtype and ours.shape == theirs.shape, what
    ours, theirs = ours.detach().reshape(-1), theirs.detach().reshape(-1)
    problem = bits_mismatch(ours, theirs, nan_bits=dtype is not torch.float32)
    assert problem is None, f"{what}: {problem}"


def _run(name, kwargs, dtype, backend, threads, mixed=False):
    theirs, ours = _params(dtype), _params(dtype)

    def groups(params):
        if not mixed:
            return [dict(params=params, fused=True)]
        return [dict(params=params[::2], fused=True), dict(params=params[1::2], fused=None)]

    kwargs = {"lr": 1e-2, **kwargs}
    t_opt = _theirs(name, dtype, groups(theirs), kwargs)
    r_opt = getattr(ro, name)(groups(ours), backend=backend, **kwargs)
    with torch_threads(threads):
        for step in range(STEPS):
            for i, (p, q) in enumerate(zip(theirs, ours, strict=True)):
                g = _grad(step, i, p.shape, dtype)
                p.grad = None if g is None else g.clone()
                q.grad = None if g is None else g.clone()
            t_opt.step()
            r_opt.step()
            for i, (p, q) in enumerate(zip(theirs, ours, strict=True)):
                at = f"{name}{kwargs} {dtype} {backend} threads={threads} step {step} param {i} {p.shape}"
                _compare(q, p, dtype, f"{at} value", name)
                st_t, st_r = t_opt.state[p], r_opt.state[q]
                assert set(st_t) == set(st_r), at
                for key, v in st_t.items():
                    _compare(st_r[key], v, v.dtype, f"{at} {key}", name)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, kwargs", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_fused_bit_for_bit_torchs_fused_kernel(name, kwargs, dtype, backend):
    _run(name, kwargs, dtype, backend, threads=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", ["fast:numba", "fast:torch"])
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("AdamW", dict(weight_decay=0.1, amsgrad=True)),
        ("SGD", dict(momentum=0.9, weight_decay=0.1)),
        ("Adagrad", dict(weight_decay=0.1)),
    ],
)
def test_fused_at_three_threads_and_mixed_groups(name, kwargs, dtype, backend):
    _run(name, kwargs, dtype, backend, threads=3, mixed=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("AdamW", dict(weight_decay=0.1, amsgrad=True)),
        ("Adam", dict(maximize=True)),
        ("SGD", dict(momentum=0.9, nesterov=True, weight_decay=0.1)),
        ("Adagrad", dict(lr_decay=0.01, weight_decay=0.1)),
    ],
)
def test_fused_over_a_million_elements_at_two_threads(name, kwargs, dtype):
    """1,000,003 elements (torch's kernel cuts them across its threads; its remainder is the
    tensor's last), beside a 17-element one, 5 steps at 2 torch threads, the default engine."""
    kwargs = {"lr": 1e-2, **kwargs}
    g = torch.Generator().manual_seed(8)
    start = [torch.randn(n, generator=g).to(dtype) for n in (1_000_003, 17)]
    theirs = [torch.nn.Parameter(s.clone()) for s in start]
    ours = [torch.nn.Parameter(s.clone()) for s in start]
    t_opt = _theirs(name, dtype, [dict(params=theirs, fused=True)], kwargs)
    r_opt = getattr(ro, name)(ours, fused=True, **kwargs)
    with torch_threads(2):
        for step in range(5):
            for p, q in zip(theirs, ours, strict=True):
                gr = torch.randn(p.shape, generator=g).to(dtype)
                p.grad, q.grad = gr.clone(), gr.clone()
            t_opt.step()
            r_opt.step()
            for i, (p, q) in enumerate(zip(theirs, ours, strict=True)):
                at = f"{name} {dtype} step {step} param {i}"
                _compare(q, p, dtype, f"{at} value")
                for key, v in t_opt.state[p].items():
                    _compare(r_opt.state[q][key], v, v.dtype, f"{at} {key}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_16bit_fused_kernels_are_the_float32_kernel_widened_where_right(name, dtype):
    """The ground truth's claim, measured: torch's 16-bit fused kernel equals its float32 kernel
    on widened tensors rounded once (``WidenedFused``), bit for bit, where this torch's kernel
    is not ``KNOWN_WRONG``; and where it is, it differs (so a wrong entry shows)."""
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    if name == "SGD":
        kwargs.update(momentum=0.9, dampening=0.2)
    if name == "Adagrad":
        kwargs.update(lr_decay=0.01, initial_accumulator_value=0.1)
    cls = getattr(torch.optim, name)
    kernel, widened = _params(dtype), _params(dtype)
    opts = (
        cls([dict(params=kernel, fused=True)], **kwargs),
        WidenedFused(cls, [dict(params=widened, fused=True)], **kwargs),
    )
    differ = False
    for step in range(STEPS):
        for i, (p, q) in enumerate(zip(kernel, widened, strict=True)):
            g = _grad(step, i, p.shape, dtype)
            p.grad = None if g is None else g.clone()
            q.grad = None if g is None else g.clone()
        for opt in opts:
            opt.step()
        for p, q in zip(kernel, widened, strict=True):
            tensors = [(p, q)] + [(v, opts[1].state[q][k]) for k, v in opts[0].state[p].items()]
            differ |= any(
                bits_mismatch(a.reshape(-1), b.reshape(-1), nan_bits=True) is not None for a, b in tensors
            )
    assert differ == fused_kernels.known_wrong(name, dtype), (
        f"torch {torch.__version__}'s 16-bit fused {name} "
        + ("differs from" if differ else "equals")
        + " its float32 kernel widened: KNOWN_WRONG needs updating"
    )


def test_sgd_late_first_gradient_starts_its_buffer_at_the_gradient():
    """A parameter whose first gradient comes after the others have momentum buffers (a layer
    unfrozen later): torch's fused SGD raises a TypeError; roundpipe's starts its buffer at the
    gradient, as the for-loop does (declared in docs/contract.md): what torch's fused SGD
    computes when each parameter has an optimizer of its own, bit for bit."""
    kwargs = dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1)
    g = torch.Generator().manual_seed(11)
    start = [torch.randn(n, generator=g) for n in (70001, 33)]
    grads = [[torch.randn(n, generator=g) for n in (70001, 33)] for _ in range(4)]
    t_params = [torch.nn.Parameter(s.clone()) for s in start]
    r_params = [torch.nn.Parameter(s.clone()) for s in start]
    together = torch.optim.SGD([torch.nn.Parameter(s.clone()) for s in start], fused=True, **kwargs)
    alone = [torch.optim.SGD([p], fused=True, **kwargs) for p in t_params]
    r_opt = ro.SGD(r_params, fused=True, **kwargs)
    for step, gs in enumerate(grads):
        for params in (t_params, r_params, together.param_groups[0]["params"]):
            for i, (p, gr) in enumerate(zip(params, gs, strict=True)):
                p.grad = None if (i == 1 and step == 0) else gr.clone()
        for opt in (*alone, r_opt):
            opt.step()
        if step == 0:
            together.step()
        elif step == 1:
            with pytest.raises(TypeError, match="expected Tensor"):
                together.step()
        for p, q, t_opt in zip(t_params, r_params, alone, strict=True):
            _compare(q, p, torch.float32, f"step {step}")
            assert set(r_opt.state[q]) == set(t_opt.state[p])
            if t_opt.state[p]:
                buf = r_opt.state[q]["momentum_buffer"]
                _compare(buf, t_opt.state[p]["momentum_buffer"], torch.float32, "buf")


def test_fused_refusals_are_torchs_and_before_anything_moves():
    p = torch.randn(5, requires_grad=True)
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        ro.AdamW([p], fused=True, foreach=True)
    with pytest.raises(TypeError, match="fused=True steps as torch's fused kernel does"):
        ro.AdamW([p], fused=True, state_dtype=torch.bfloat16)
    c = torch.randn(5, dtype=torch.complex64, requires_grad=True)
    c.grad = torch.randn(5, dtype=torch.complex64)
    opt = ro.Adam([c], fused=True)
    before = c.detach().clone()
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point"):
        opt.step()
    assert torch.equal(c.detach(), before) and not opt.state
    # (torch raises the same at its first step)
    t = torch.optim.Adam([c.detach().clone().requires_grad_()], fused=True)
    t.param_groups[0]["params"][0].grad = c.grad.clone()
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point"):
        t.step()


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("AdamW", dict(amsgrad=True, weight_decay=0.1)),
        ("Adam", dict(maximize=True)),
        ("SGD", dict(momentum=0.9, weight_decay=0.1)),
        ("Adagrad", dict(lr_decay=0.01)),
    ],
)
def test_fused_under_grad_scaler_without_unscale_is_torchs(name, kwargs):
    """torch's fused protocol: the scaler hands ``grad_scale`` and ``found_inf`` to the step; the
    kernel divides each gradient by the scale (not a power of two here), writes it back and steps
    it, or skips everything on an inf (iteration 2). Parameters, state, the written-back
    gradients and the scale, bit for bit after every iteration."""
    g = torch.Generator().manual_seed(5)
    shapes = ((70001,), (33, 65), (1,))
    start = [torch.randn(s, generator=g) for s in shapes]
    weights = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    weights[2][1][3, 4] = float("inf")
    runs = []
    for mod in (torch.optim, ro):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = getattr(mod, name)(params, lr=1e-2, fused=True, **kwargs)
        scaler = torch.amp.GradScaler("cpu", init_scale=3.0)
        seen = []
        for ws in weights:
            opt.zero_grad()
            scaler.scale(sum((p * w).sum() for p, w in zip(params, ws, strict=True))).backward()
            scaler.step(opt)
            scaler.update()
            state = [sorted((k, v.clone()) for k, v in opt.state[p].items()) for p in params]
            seen.append(
                (
                    [p.detach().clone() for p in params],
                    [p.grad.clone() for p in params],
                    state,
                    scaler.get_scale(),
                )
            )
        runs.append(seen)
    for it, (theirs, ours) in enumerate(zip(*runs, strict=True)):
        assert ours[3] == theirs[3], f"iteration {it}: the scale"
        for what, a_list, b_list in (("param", ours[0], theirs[0]), ("grad", ours[1], theirs[1])):
            for a, b in zip(a_list, b_list, strict=True):
                _compare(a, b, torch.float32, f"{name} iteration {it} {what}")
        for a_state, b_state in zip(ours[2], theirs[2], strict=True):
            assert [k for k, _ in a_state] == [k for k, _ in b_state]
            for (key, a), (_, b) in zip(a_state, b_state, strict=True):
                _compare(a, b, a.dtype, f"{name} iteration {it} {key}")


@pytest.mark.parametrize("inf", [False, True], ids=["finite", "inf"])
@pytest.mark.parametrize("case", ["bfloat16", "mixed groups", "pending clip"])
def test_fused_under_grad_scaler_without_unscale_refuses_what_it_does_not_model(case, inf):
    """What the fused protocol would step otherwise than torch raises before anything moves:
    a 16-bit gradient (the kernel steps its unrounded float32 quotient), a group that is not
    fused (torch's for-loop asserts), a clip recorded before the step; on a step an inf skips
    too (torch's for-loop group asserts there as well)."""
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    params = [torch.nn.Parameter(torch.randn(40).to(dtype)) for _ in range(2)]
    groups = [dict(params=params[:1]), dict(params=params[1:], fused=case != "mixed groups")]
    opt = ro.AdamW(groups, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(sum(p.float().square().sum() for p in params)).backward()
    if inf:
        params[0].grad.view(-1)[3] = float("inf")
    if case == "pending clip":
        ro.clip_grad_norm_(opt, 1.0)
    before = [(p.detach().clone(), p.grad.clone()) for p in params]
    with pytest.raises(RuntimeError, match="under GradScaler without unscale_"):
        scaler.step(opt)
    for p, (value, grad) in zip(params, before, strict=True):
        assert torch.equal(p.detach(), value) and torch.equal(p.grad, grad)
    assert not opt.state


def test_fused_under_grad_scaler_with_unscale_is_torchs():
    """With ``unscale_`` first (torch's multiply by the inverse scale, in place), the fused step
    reads unscaled gradients: torch's fused AdamW under the same scaler, bit for bit."""
    results = []
    for mod in (torch.optim, ro):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 70001))
        opt = mod.AdamW([p], lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=3.0)  # (not a power of two)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(p.sin().sum()).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        results.append((p.detach(), opt.state[p]["exp_avg_sq"]))
    for a, b in zip(*results, strict=True):
        _compare(b, a, torch.float32, "GradScaler with unscale_")


def test_fused_state_dict_both_ways_with_torchs_fused_optimizer():
    """A checkpoint of torch's fused AdamW resumes in roundpipe's (its groups' ``fused`` selects
    the fused step) and back, and both go on bit for bit."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(1001, generator=g) for _ in range(4)]
    start = torch.randn(1001, generator=g)

    def run(first, second):
        p = torch.nn.Parameter(start.clone())
        opt = first([p], lr=1e-2, weight_decay=0.1, fused=True)
        for k in range(2):
            p.grad = grads[k].clone()
            opt.step()
        q = torch.nn.Parameter(p.detach().clone())
        resumed = second([q], lr=0.5)  # (the loaded groups' values win)
        resumed.load_state_dict(opt.state_dict())
        assert resumed.param_groups[0]["fused"] is True
        for k in range(2, 4):
            q.grad = grads[k].clone()
            resumed.step()
        return q.detach(), resumed.state[q]["exp_avg_sq"]

    want = run(torch.optim.AdamW, torch.optim.AdamW)
    for first, second in ((torch.optim.AdamW, ro.AdamW), (ro.AdamW, torch.optim.AdamW)):
        for a, b in zip(run(first, second), want, strict=True):
            _compare(a, b, torch.float32, f"{first.__module__} -> {second.__module__}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_fused_with_fp32_masters_is_the_composition_with_torchs_fused_step(dtype):
    """fp32 masters paired with 16-bit partners (``pair``): a fused step reads the partner's
    gradient widened and rounds the master back into the partner, as torch's fused AdamW on the
    master with ``master.grad = partner.grad.float()`` and a ``copy_`` back; it writes no
    gradient (torch's kernel writes one only under a GradScaler, which raises here)."""
    g = torch.Generator().manual_seed(4)
    start = [torch.randn(n, generator=g).to(dtype) for n in (70001, 17)]
    partners = [torch.nn.Parameter(s.clone()) for s in start]
    masters = [torch.nn.Parameter(s.float()) for s in start]
    for m, q in zip(masters, partners, strict=True):
        ro.pair(m, q)
    ours = ro.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    ref_params = [torch.nn.Parameter(s.float()) for s in start]
    theirs = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(4):
        grads = [torch.randn(s.shape, generator=g).to(dtype) for s in start]
        for q, r, gr in zip(partners, ref_params, grads, strict=True):
            q.grad, r.grad = gr.clone(), gr.float()
        ours.step()
        theirs.step()
        for m, q, r in zip(masters, partners, ref_params, strict=True):
            _compare(m, r, torch.float32, f"step {step} master")
            _compare(q, r.detach().to(dtype), dtype, f"step {step} partner")
            assert m.grad is None
            _compare(ours.state[m]["exp_avg_sq"], theirs.state[r]["exp_avg_sq"], torch.float32, "exp_avg_sq")


def test_fused_under_torch_compile_and_a_scheduler_is_torchs():
    """``torch.compile`` around the step (roundpipe's step runs eagerly inside it: a graph break)
    and a scheduler changing lr: torch's compiled fused AdamW, bit for bit."""
    g = torch.Generator().manual_seed(6)
    start, grads = torch.randn(70001, generator=g), [torch.randn(70001, generator=g) for _ in range(4)]
    results = []
    for mod in (torch.optim, ro):
        p = torch.nn.Parameter(start.clone())
        opt = mod.AdamW([p], lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
        step = torch.compile(opt.step)
        for gr in grads:
            p.grad = gr.clone()
            step()
            sched.step()
        results.append((p.detach(), opt.state[p]["exp_avg_sq"]))
    for a, b in zip(*results, strict=True):
        _compare(b, a, torch.float32, "compiled step with a scheduler")
