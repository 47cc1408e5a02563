"""What the benchmark steps: the optimizers' options, the workloads' tensors, the configurations
(torch's three CPU paths, roundpipe's backends, one optimizer per parameter) and the check of
each roundpipe backend against torch's for-loop (bit for bit where the backend claims it)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from roundpipe import optim as rp_optim
from roundpipe.optim import backends as rp_backends
from roundpipe.optim.spec import SPECS, STAGED_SPECS

# every optimizer --optimizers accepts: the elementwise ones in the spec registry's order, then
# the staged ones (Adafactor; Muon where torch has it)
ALL_OPTIMIZERS = (*SPECS, *STAGED_SPECS)
# what a run times unless --optimizers says otherwise: Muon only when asked (its step is mostly
# torch's bfloat16 Newton-Schulz matmuls, seconds a step on the transformer workload on a CPU,
# the same in every column)
DEFAULT_OPTIMIZERS = tuple(n for n in ALL_OPTIMIZERS if n != "Muon")

# Representative settings: torch's defaults, except SGD with momentum (plain SGD is rare).
OPTIONS = {name: {} for name in ALL_OPTIMIZERS}
OPTIONS["SGD"] = {"momentum": 0.9}


def spec_of(name: str):
    """The optimizer's spec: elementwise (``SPECS``) or staged (``STAGED_SPECS``)."""
    return SPECS[name] if name in SPECS else STAGED_SPECS[name]


def is_staged(name: str) -> bool:
    return name in STAGED_SPECS


def has_foreach(name: str) -> bool:
    """Whether torch's optimizer takes ``foreach=`` (Muon does not: its for-loop is all)."""
    import inspect

    return "foreach" in inspect.signature(spec_of(name).torch_class).parameters


def tensors_for(name: str, shapes) -> tuple[list[int], str | None]:
    """The indices of a workload's tensors optimizer ``name`` steps, and why others are left
    out (None if none is): torch's Adafactor divides by a tensor's element count (an empty one
    raises ZeroDivisionError in torch's step, and so in roundpipe's); Muon steps 2-D matrices
    only."""
    if name == "Adafactor":
        keep = [i for i, s in enumerate(shapes) if all(s)]  # a 0-d shape has one element
        why = "empty tensors left out: torch's Adafactor divides by a tensor's element count"
    elif name == "Muon":
        keep = [i for i, s in enumerate(shapes) if len(s) == 2]
        why = "only the 2-D tensors: Muon steps matrices"
    else:
        return list(range(len(shapes))), None
    return keep, (why if len(keep) < len(shapes) else None)


WORKLOADS = ("large", "small", "transformer", "per_param")
PER_PARAM_PARTS = ("per_param_small", "per_param_large")  # what ``per_param`` runs
# asked for by name only: Adafactor's matrices (a factored second moment), issue 48's shapes
EXTRA_WORKLOADS = ("matrices",)
WORKLOAD_NAMES = (*WORKLOADS, *PER_PARAM_PARTS, *EXTRA_WORKLOADS)  # what --workloads accepts

TORCH_CONFIGS = ("torch for-loop", "torch foreach", "torch fused")
LOOP, FOREACH, FUSED = TORCH_CONFIGS


def label(config: str) -> str:
    """A configuration's column name: ``for-loop``, ``foreach``, ``fused`` or the backend."""
    return config.removeprefix("torch ").removeprefix("rp ")


# ---------------------------------------------------------------------------------------------
# workloads


@dataclass(frozen=True)
class Workload:
    name: str  # the key in the results: a --workloads name, or a part of per_param
    description: str
    shapes: tuple
    per_param: bool = False  # one optimizer per parameter


def workload_parts(name: str, quick: bool) -> list[Workload]:
    """The workloads ``--workloads name`` runs: one, or per_param's two parts."""
    if name == "per_param":
        return [w for part in PER_PARAM_PARTS for w in workload_parts(part, quick)]
    if name in PER_PARAM_PARTS:
        count, n = (256, 4 * 2**10) if name == "per_param_small" else (4, (2 if quick else 4) * 2**20)
        size = f"{n // 2**10}Ki" if n < 2**20 else f"{n // 2**20}Mi"
        desc = (
            f"{count} one-parameter optimizers of {size} fp32 elements each, stepped one after "
            "the other (an offload wrapper, a post-accumulate-grad hook)"
        )
        return [Workload(name, desc, ((n,),) * count, per_param=True)]
    if name == "large":
        n = (2 if quick else 16) * 2**20
        desc = f"4 tensors of {n // 2**20}M fp32 ({n * 4 // 2**20} MiB each)"
        return [Workload(name, desc, ((n,),) * 4)]
    if name == "matrices":
        n = 1024 if quick else 2048
        desc = f"4 matrices of {n}x{n} + 8 vectors of {n} fp32 (Adafactor's factored second moment)"
        return [Workload(name, desc, ((n, n),) * 4 + ((n,),) * 8)]
    if name == "small":
        g = torch.Generator().manual_seed(1234)
        sizes = torch.randint(0, 1025, (2000,), generator=g).tolist()
        shapes = [(s,) for s in sizes] + [(3, 4, 5), (2, 8, 16), (1, 1, 1), (4, 1, 7), (8, 8, 8), (16, 3, 3)]
        desc = "2000 1-D tensors of 0..1024 elements (seeded) + 6 small 3-D ones"
        return [Workload(name, desc, tuple(shapes))]
    if name == "transformer":
        vocab, layers, d = (8000, 2, 512) if quick else (32000, 8, 512)
        shapes = [(vocab, d)]
        for _ in range(layers):
            shapes += [(d, d), (d,)] * 4  # q, k, v, o weights and biases
            shapes += [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # mlp up and down
            shapes += [(d,)] * 4  # two layernorms, weight and bias
        shapes += [(d,), (d,)]  # final layernorm
        desc = f"{vocab}x{d} embedding + {layers} layers at d={d} (qkvo, mlp 4d, biases, layernorms)"
        return [Workload(name, desc, tuple(shapes))]
    raise ValueError(name)


def make_workload(workload: Workload):
    """Seeded ``(params, grads)`` of the workload's shapes."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in workload.shapes]
    grads = [torch.randn(s, generator=g).mul_(0.1) for s in workload.shapes]
    return params, grads


def clone_params(base_params, base_grads):
    params = []
    for p, g in zip(base_params, base_grads, strict=True):
        q = torch.nn.Parameter(p.clone())
        q.grad = g.clone()
        params.append(q)
    return params


# ---------------------------------------------------------------------------------------------
# configurations


def has_fused(name: str) -> bool:
    """Whether torch has a fused CPU implementation of this optimizer (by trying one)."""
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec_of(name).torch_class([p], fused=True, **OPTIONS[name]).step()
    except Exception:
        return False
    return True


# The summary's workloads (and the one-thread pass's): those whose step time is the kernels'
# (what a thread count changes), not a per-call overhead (``small``, ``per_param``).
SUMMARY_WORKLOADS = ("large", "transformer")


def in_summary(name: str) -> bool:
    """Whether optimizer ``name`` has rows in the summary: all but Muon, whose step is mostly
    torch's bfloat16 Newton-Schulz matmuls (the same call in every column)."""
    return name != "Muon"


def fastest_torch(name: str, fused: bool) -> list[str]:
    """torch's paths the summary compares roundpipe with (the faster median of them): fused
    where torch has a CPU kernel, else the for-loop and foreach (the for-loop alone where the
    optimizer has no foreach)."""
    if fused:
        return [FUSED]
    return [LOOP, FOREACH] if has_foreach(name) else [LOOP]


class PerParam:
    """One optimizer per parameter, stepped one after the other by ``step()``: what torchao's
    ``CPUOffloadOptimizer`` builds, and what a loop calling ``step()`` from
    ``register_post_accumulate_grad_hook`` runs. ``state`` merges the optimizers' states."""

    def __init__(self, make, params):
        self.optimizers = [make([p]) for p in params]

    def step(self):
        for opt in self.optimizers:
            opt.step()

    @property
    def state(self) -> dict:
        merged: dict = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged


def make_optimizer(config: str, name: str, params, per_param: bool = False):
    """The optimizer of a configuration (``torch for-loop`` ... or ``rp <backend>``) over
    ``params``; with ``per_param``, one such optimizer per parameter (``PerParam``)."""
    if per_param:
        return PerParam(lambda ps: make_optimizer(config, name, ps), params)
    kwargs = OPTIONS[name]
    torch_class = spec_of(name).torch_class
    if config == LOOP:
        if not has_foreach(name):  # torch's for-loop is its only path (Muon)
            return torch_class(params, **kwargs)
        return torch_class(params, foreach=False, **kwargs)
    if config == FOREACH:
        return torch_class(params, foreach=True, **kwargs)
    if config == FUSED:
        return torch_class(params, fused=True, **kwargs)
    backend = config.removeprefix("rp ")
    return getattr(rp_optim, name)(params, backend=backend, **kwargs)


def exact(backend: str) -> bool:
    """Whether ``backend`` claims torch.optim's for-loop bit for bit here
    (``backends.get(backend).exact``: fast and fast:numba where the numba engine's probes say it
    models this torch's rounding, fast:torch, reference); ``check`` then compares every bit."""
    return rp_backends.get(backend).exact


def check_kind(backend: str) -> str:
    """How ``check`` compares ``backend`` with torch: ``"bit for bit"`` or ``"close"``."""
    return "bit for bit" if exact(backend) else "close"


def bits_mismatch(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if ``a`` and ``b`` are equal bit for bit (float32 compared as int32, so -0.0 is not
    0.0; NaNs by position, any payload), else how many elements differ and the first one."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.is_complex():
        a, b = torch.view_as_real(a).reshape(-1), torch.view_as_real(b).reshape(-1)
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        differ = (a.view(ints) != b.view(ints)) & ~(torch.isnan(a) & torch.isnan(b))
    else:
        differ = a != b
    count = int(differ.sum())
    if count == 0:
        return None
    i = int(differ.nonzero()[0, 0])
    first = f"{a[i].item()!r} vs {b[i].item()!r}"
    return f"{count} of {a.numel()} elements differ in their bits; first at {i}: {first}"


def _mismatch(got: torch.Tensor, expected: torch.Tensor, bitwise: bool) -> str | None:
    if bitwise:
        return bits_mismatch(got, expected)
    try:
        torch.testing.assert_close(got, expected)
    except AssertionError as e:
        return str(e)
    return None


def check(name: str, backend: str, base_params, base_grads, steps: int = 2, per_param: bool = False):
    """None if roundpipe matches torch's for-loop after ``steps`` steps (parameters and every
    state tensor), else the mismatch: bit for bit where the backend claims it (``exact``), else
    ``torch.testing.assert_close``."""
    bitwise = exact(backend)
    ref_params = clone_params(base_params, base_grads)
    rp_params = clone_params(base_params, base_grads)
    ref = make_optimizer(LOOP, name, ref_params)
    rp = make_optimizer("rp " + backend, name, rp_params, per_param=per_param)
    try:
        for _ in range(steps):
            ref.step()
            rp.step()
        return state_mismatch(rp.state, rp_params, ref.state, ref_params, bitwise)
    except Exception as e:  # the backend failing
        return f"{type(e).__name__}: {e}".strip()


def state_mismatch(state, params, ref_state, ref_params, bitwise=True, what="param", extra=()):
    """None if ``params`` (named ``what``), each ``(what, got, expected)`` entry of ``extra`` and
    every state tensor (``state[p][key]`` for each tensor key of ``ref_state[ref_p]``)
    equal the reference's, bit for bit or close (``bitwise``); else an ``AssertionError: ...``
    message that says where they first differ."""
    pairs = [(what, list(params), list(ref_params)), *extra]
    # each parameter's own state tensors (Adafactor keeps row_var and col_var for a matrix,
    # variance for a vector): the keys in order of first appearance, compared where torch has them
    keys: dict = {}
    for a in ref_params:
        keys.update((k, None) for k, v in ref_state[a].items() if isinstance(v, torch.Tensor))
    for key in keys:
        which = [i for i, a in enumerate(ref_params) if isinstance(ref_state[a].get(key), torch.Tensor)]
        got = [state.get(params[i], {}).get(key) for i in which]
        pairs.append((f"state {key!r}", got, [ref_state[ref_params[i]][key] for i in which]))
    # all tensors of an entry at once, then one by one to say where
    for what, got, expected in pairs:
        missing = [i for i, t in enumerate(got) if not isinstance(t, torch.Tensor)]
        if missing:
            return f"AssertionError: {what} {missing[0]}: missing"
        if _mismatch(_flat(got), _flat(expected), bitwise) is None:
            continue
        for i, (w, v) in enumerate(zip(got, expected, strict=True)):
            why = _mismatch(w.detach(), v.detach(), bitwise)
            if why is not None:
                return f"AssertionError: {what} {i}: {why}".strip()
        return f"AssertionError: {what}: the concatenated tensors differ"  # not one by one
    return None


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])
