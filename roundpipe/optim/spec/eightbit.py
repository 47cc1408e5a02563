"""bitsandbytes' 8-bit optimizers: the CPU step of bitsandbytes 0.50
(``bitsandbytes/backends/cpu/ops.py``), as staged specs of one pass.

A parameter of at least ``min_8bit_size`` elements (a param-group key, 4096 by default) keeps
its state in 8 bits (``codebooks.py``): ``state1`` (and ``state2``) one byte per element, with
``absmax1`` (``absmax2``) per quantization block of 256 and the codebooks ``qmap1`` (``qmap2``),
unless bitsandbytes' per-parameter config says ``optim_bits=32``. Its step
(``_optimizer_update_8bit_blockwise_cpu``) dequantizes the state, updates it and the parameter
with torch ops in float32, and quantizes it back. A smaller parameter keeps float32 ``state1``
(``state2``) and takes bitsandbytes' 32-bit update (``_optimizer_update_32bit_cpu``), whose
formulas differ. Which one a parameter takes is read from its state, as bitsandbytes reads it.
``step`` is a Python int, bitsandbytes' counter.

Each update rule is its two programs (8-bit, 32-bit) over ``param``, ``grad`` and the state, and
its scalars, each written as the bitsandbytes source writes it: ``grad`` is ``g.float() *
gnorm_scale`` (1.0), every Python float is rounded to float32 inside its op. ``STEPS`` holds one
``StagedSpec`` per rule; ``eightbit_classes.py`` makes bitsandbytes' classes of them.

bitsandbytes' per-parameter config (its ``GlobalOptimManager``: ``roundpipe/optim/overrides.py``)
reaches a spec in two ways. What it reads when it creates a parameter's state (``optim_bits``,
``min_8bit_size``) comes in the group ``init_state`` is given. The hyperparameters it reads every
step come as the option ``hyper``: ``(key, value)`` pairs over the group's; a ``Between`` stage
then recomputes that parameter's scalars with them (``t``, this step's count, is among the
scalars for that). Without an override a parameter's stages are the group's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .codebooks import blocks_of, dynamic_map
from .core import Scratch
from .ir import QUANTIZED_KINDS, add, addcdiv, addcmul, dequantize, sign, sqrt
from .staged import Between, Pass, StagedSpec, program

__all__ = ["STEPS", "EightBit", "MIN_8BIT_SIZE", "OPTIM_BITS", "HYPERPARAMETERS"]

MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller parameters keep 32-bit state
OPTIM_BITS = 8  # what every 8-bit class passes bitsandbytes' base class; a config may say 32
# the config keys bitsandbytes' update_step reads every step, where the group has them
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "alpha", "t_alpha", "t_beta3")
_CODEBOOKS: dict = {}


def _codebook(signed: bool) -> torch.Tensor:
    # one tensor per codebook, shared by every parameter's state as bitsandbytes shares its own
    hit = _CODEBOOKS.get(signed)
    if hit is None:
        hit = _CODEBOOKS[signed] = dynamic_map(signed)
    return hit


@dataclass(frozen=True)
class EightBit:
    """One of bitsandbytes' update rules: ``name`` as its kernels name it, the number of state
    tensors, and the statements of its 8-bit and 32-bit programs (``(o, b, m)``: options,
    builder, the moments as values) and scalars."""

    name: str
    n_states: int
    update_8bit: object
    update_32bit: object
    scalars: object


# -- the state ------------------------------------------------------------------------------------
def eight_bit(group, p) -> bool:
    """Whether a parameter's new state is 8-bit: bitsandbytes' ``init_state`` on ``group`` (the
    param group, with the parameter's config where one overrides it)."""
    bits = group.get("optim_bits", OPTIM_BITS)
    if bits not in (8, 32):
        raise NotImplementedError(f"Amount of optimizer bits not supported: {bits}")
    return bits == 8 and p.numel() >= group.get("min_8bit_size", MIN_8BIT_SIZE)


def _init_state(rule: EightBit):
    def init_state(group, p, state):
        if len(state) == 0:
            eight = eight_bit(group, p)
            state["step"] = 0
            for k in range(1, rule.n_states + 1):
                state[f"state{k}"] = torch.zeros_like(p, dtype=torch.uint8 if eight else torch.float32)
                if eight:
                    state[f"qmap{k}"] = _codebook(signed=k == 1)
            if eight:
                for k in range(1, rule.n_states + 1):
                    state[f"absmax{k}"] = torch.zeros((blocks_of(p.numel()),), dtype=torch.float32)

    return init_state


def state_options(state) -> dict:
    """The options a parameter's state decides: 8-bit or 32-bit (its ``state1``'s dtype, as
    bitsandbytes decides), and whether this step is its first (SGD's momentum starts as a copy)."""
    state1 = state.get("state1")
    return {
        "eight": getattr(state1, "dtype", None) == torch.uint8,
        "first": state.get("step") == 0,
    }


def state_names(rule: EightBit):
    def names(o, p):
        entries = {f"state{k}": (p.shape, torch.uint8 if o.eight else torch.float32) for k in _ks(rule)}
        if o.eight:
            for k in _ks(rule):
                entries[f"qmap{k}"] = ((256,), torch.float32)
                entries[f"absmax{k}"] = ((blocks_of(p.numel()),), torch.float32)
        return entries

    return names


def _ks(rule):
    return range(1, rule.n_states + 1)


def options(group, p):
    return {"weight_decay": group["weight_decay"] > 0.0}


# -- the programs ---------------------------------------------------------------------------------
def _build_stages(rule: EightBit):
    def build_stages(o):
        ks = _ks(rule)
        if o.eight:
            inputs = ["param", "grad", *(f"{n}{k}" for k in ks for n in _Q_NAMES)]
            kinds = {f"{n}{k}": kind for k in ks for n, kind in zip(_Q_NAMES, QUANTIZED_KINDS, strict=True)}
            stages = (Pass(program(o, inputs, _eight(rule), kinds)),)
        else:
            inputs = ["param", "grad", *(f"state{k}" for k in ks)]
            stages = (Pass(program(o, inputs, _thirty_two(rule))),)
        return with_hyperparameters(o, stages, _scalars(rule))

    return build_stages


_Q_NAMES = ("state", "absmax", "qmap")  # an 8-bit state's entries, in QUANTIZED_KINDS' order


def with_hyperparameters(o, stages, scalars) -> tuple:
    """``stages`` after a ``Between`` that recomputes the scalars with the option ``hyper`` (a
    parameter's config over the group's hyperparameters), where it has one."""
    hyper = o.get("hyper")
    if not hyper:
        return stages
    return (Between(_rescaled(dict(hyper), scalars)), *stages)


def _rescaled(hyper, scalars):
    def between(ctx):
        # this step's scalars anew from the same step count: the plan advanced it already
        ctx.update(scalars({**ctx["group"], **hyper}, {"step": Scratch(ctx["t"] - 1, int)}))

    return between


def _eight(rule):
    def statements(o, b):
        grad = b.let("grad", b.tensor("grad") * b.s.gnorm_scale)
        moments = [
            b.let(f"s{k}", dequantize(b.tensor(f"state{k}"), b.tensor(f"absmax{k}"), b.tensor(f"qmap{k}")))
            for k in _ks(rule)
        ]
        moments = rule.update_8bit(o, b, grad, moments)
        for k, m in zip(_ks(rule), moments, strict=True):
            b.quantize(b.tensor(f"state{k}"), b.tensor(f"absmax{k}"), b.tensor(f"qmap{k}"), m)

    return statements


def _thirty_two(rule):
    def statements(o, b):
        grad = b.let("grad", b.tensor("grad") * b.s.gnorm_scale)
        rule.update_32bit(o, b, grad, [b.tensor(f"state{k}") for k in _ks(rule)])

    return statements


def _decay(o, b):
    """``p_fp32.mul_(1.0 - lr * weight_decay)`` where ``weight_decay > 0``."""
    if o.weight_decay:
        b.assign(b.tensor("param"), b.tensor("param") * b.s.decay)


def _l2(b, grad):
    """``grad.add_(p_fp32, alpha=weight_decay)``: the 8-bit kernels add it even at 0."""
    return b.let("grad", add(grad, b.tensor("param"), b.s.weight_decay))


def _l2_if(o, b, grad):
    """``g.add(p, alpha=weight_decay) if weight_decay > 0.0 else g`` (the 32-bit kernel)."""
    return b.let("grad", add(grad, b.tensor("param"), b.s.weight_decay)) if o.weight_decay else grad


# Adam (and LAMB's CPU step): 'adam'
def _adam_8bit(o, b, grad, moments):
    m, v = moments
    m = b.let("s1", add(m * b.s.beta1, grad, b.s.one_minus_beta1))
    v = b.let("s2", addcmul(v * b.s.beta2, grad, grad, b.s.one_minus_beta2))
    denom = b.let("denom", sqrt(v) / b.s.correction2 + b.s.eps)
    _decay(o, b)
    b.assign(b.tensor("param"), addcdiv(b.tensor("param"), m, denom, b.s.neg_lr_over_correction1))
    return [m, v]


def _adam_32bit(o, b, grad, states):
    m, v = states
    b.assign(m, add(m * b.s.beta1, grad, b.s.one_minus_beta1))
    b.assign(v, addcmul(v * b.s.beta2, grad, grad, b.s.one_minus_beta2))
    _decay(o, b)
    update = b.let("update", m / (sqrt(v) + b.s.eps_times_correction2))
    b.assign(b.tensor("param"), add(b.tensor("param"), update, b.s.step_size))


def _adam_scalars(group, state, step):
    beta1, beta2 = group["betas"][0], group["betas"][1]
    correction1 = 1.0 - beta1**step
    correction2 = math.sqrt(1.0 - beta2**step)
    lr, eps = group["lr"], group["eps"]
    return {
        "beta1": beta1,
        "beta2": beta2,
        "one_minus_beta1": 1.0 - beta1,
        "one_minus_beta2": 1.0 - beta2,
        "correction2": correction2,
        "eps": eps,
        "neg_lr_over_correction1": -lr / correction1,
        "eps_times_correction2": eps * correction2,
        "step_size": -lr * correction2 / correction1,
    }


# Lion: 'lion'
def _lion_8bit(o, b, grad, moments):
    (m,) = moments
    _decay(o, b)
    direction = sign(m * b.s.beta1 + grad * b.s.one_minus_beta1)
    b.assign(b.tensor("param"), add(b.tensor("param"), direction, b.s.neg_lr))
    return [b.let("s1", add(m * b.s.beta2, grad, b.s.one_minus_beta2))]


def _lion_32bit(o, b, grad, states):
    (m,) = states
    _decay(o, b)
    update = b.let("update", add(m * b.s.beta1, grad, b.s.one_minus_beta1))
    b.assign(b.tensor("param"), add(b.tensor("param"), sign(update), b.s.neg_lr))
    b.assign(m, add(m * b.s.beta2, grad, b.s.one_minus_beta2))


def _lion_scalars(group, state, step):
    beta1, beta2 = group["betas"][0], group["betas"][1]
    return {
        "beta1": beta1,
        "beta2": beta2,
        "one_minus_beta1": 1.0 - beta1,
        "one_minus_beta2": 1.0 - beta2,
        "neg_lr": -group["lr"],
    }


# SGD with momentum (and LARS's CPU step): 'momentum'
def _momentum_8bit(o, b, grad, moments):
    (m,) = moments
    grad = _l2(b, grad)
    m = grad if o.first else b.let("s1", m * b.s.beta1 + grad)
    b.assign(b.tensor("param"), add(b.tensor("param"), m, b.s.neg_lr))
    return [m]


def _momentum_32bit(o, b, grad, states):
    (m,) = states
    grad = _l2_if(o, b, grad)
    b.assign(m, grad if o.first else m * b.s.beta1 + grad)
    b.assign(b.tensor("param"), add(b.tensor("param"), m, b.s.neg_lr))


def _momentum_scalars(group, state, step):
    return {"beta1": group["betas"][0], "neg_lr": -group["lr"]}


# RMSprop: 'rmsprop'
def _rmsprop_8bit(o, b, grad, moments):
    (v,) = moments
    grad = _l2(b, grad)
    v = b.let("s1", addcmul(v * b.s.beta1, grad, grad, b.s.one_minus_beta1))
    b.assign(b.tensor("param"), addcdiv(b.tensor("param"), grad, sqrt(v) + b.s.eps, b.s.neg_lr))
    return [v]


def _rmsprop_32bit(o, b, grad, states):
    (v,) = states
    grad = _l2_if(o, b, grad)
    b.assign(v, addcmul(v * b.s.beta1, grad, grad, b.s.one_minus_beta1))
    update = b.let("update", grad / (sqrt(v) + b.s.eps))
    b.assign(b.tensor("param"), add(b.tensor("param"), update, b.s.neg_lr))


# Adagrad: 'adagrad'
def _adagrad_8bit(o, b, grad, moments):
    (v,) = moments
    grad = _l2(b, grad)
    v = b.let("s1", addcmul(v, grad, grad, b.s.one))
    b.assign(b.tensor("param"), addcdiv(b.tensor("param"), grad, sqrt(v) + b.s.eps, b.s.neg_lr))
    return [v]


def _adagrad_32bit(o, b, grad, states):
    (v,) = states
    grad = _l2_if(o, b, grad)
    b.assign(v, addcmul(v, grad, grad, b.s.one))
    update = b.let("update", grad / (sqrt(v) + b.s.eps))
    b.assign(b.tensor("param"), add(b.tensor("param"), update, b.s.neg_lr))


def _rms_scalars(group, state, step):
    beta1 = group["betas"][0]
    return {
        "beta1": beta1,
        "one_minus_beta1": 1.0 - beta1,
        "eps": group["eps"],
        "neg_lr": -group["lr"],
        "one": 1.0,
    }


RULES = {
    "adam": EightBit("adam", 2, _adam_8bit, _adam_32bit, _adam_scalars),
    "lion": EightBit("lion", 1, _lion_8bit, _lion_32bit, _lion_scalars),
    "momentum": EightBit("momentum", 1, _momentum_8bit, _momentum_32bit, _momentum_scalars),
    "rmsprop": EightBit("rmsprop", 1, _rmsprop_8bit, _rmsprop_32bit, _rms_scalars),
    "adagrad": EightBit("adagrad", 1, _adagrad_8bit, _adagrad_32bit, _rms_scalars),
}


def _scalars(rule: EightBit):
    def scalars(group, state):
        step_t = state["step"]
        step_t += 1
        step = step_t.value
        lr, wd = group["lr"], group["weight_decay"]
        return {
            **rule.scalars(group, state, step),
            "t": step,
            "gnorm_scale": 1.0,
            "weight_decay": wd,
            "decay": 1.0 - lr * wd,
        }

    return scalars


def _spec(rule: EightBit) -> StagedSpec:
    return StagedSpec(
        rule.name,
        torch.optim.Optimizer,
        _init_state(rule),
        options,
        state_names(rule),
        _scalars(rule),
        _build_stages(rule),
        state_options=state_options,
        int_state=("step",),
        rich_kwargs=dict(lr=1e-2, weight_decay=0.1),
        fidelity_kwargs={},
    )


# AdEMAMix: 'ademamix'. Its two first moments (fast, ``beta1``; slow, ``beta3``) share ``state1``,
# of shape ``(2, *p.shape)`` (and ``absmax1``, ``(2, blocks)``), each half quantized on its own; a
# Between stage names the halves (views: the last pass writes them in place).
def _ademamix_init_state(group, p, state):
    if len(state) == 0:
        eight = eight_bit(group, p)
        state["step"] = 0
        if eight:
            n = blocks_of(p.numel())
            state["qmap1"], state["qmap2"] = _codebook(signed=True), _codebook(signed=False)
            state["absmax1"] = torch.zeros((2, n), dtype=torch.float32)
            state["absmax2"] = torch.zeros((n,), dtype=torch.float32)
        dtype = torch.uint8 if eight else torch.float32
        state["state1"] = torch.zeros((2, *p.shape), dtype=dtype)
        state["state2"] = torch.zeros_like(p, dtype=dtype)


def _ademamix_state_names(o, p):
    dtype = torch.uint8 if o.eight else torch.float32
    entries = {"state1": ((2, *p.shape), dtype), "state2": (p.shape, dtype)}
    if o.eight:
        n = blocks_of(p.numel())
        entries.update(qmap1=((256,), torch.float32), qmap2=((256,), torch.float32))
        entries.update(absmax1=((2, n), torch.float32), absmax2=((n,), torch.float32))
    return entries


def _halves(ctx):
    for name in ("state1", "absmax1"):
        if name in ctx:
            ctx[f"{name}_fast"], ctx[f"{name}_slow"] = ctx[name][0], ctx[name][1]


def _ademamix_update(b, grad, m1, m2, nu, assign):
    m1 = assign(m1, "m1", add(m1 * b.s.beta1, grad, b.s.one_minus_beta1))
    m2 = assign(m2, "m2", add(m2 * b.s.beta3, grad, b.s.one_minus_beta3))
    nu = assign(nu, "nu", addcmul(nu * b.s.beta2, grad, grad, b.s.one_minus_beta2))
    mixed = b.let("mixed", m1 / b.s.correction1 + b.s.alpha * m2)
    adaptive = b.let("adaptive", sqrt(nu) / b.s.correction2 + b.s.eps)
    return m1, m2, nu, b.let("update", mixed / adaptive)


# the 8-bit moments: each (codes, absmax, codebook), in QUANTIZED_KINDS' order
_ADEMAMIX_QUANTIZED = (
    ("state1_fast", "absmax1_fast", "qmap1"),
    ("state1_slow", "absmax1_slow", "qmap1"),
    ("state2", "absmax2", "qmap2"),
)


def _ademamix_statements(o, b):
    grad = b.let("grad", b.tensor("grad") * b.s.gnorm_scale)
    param = b.tensor("param")
    if o.eight:
        q = _ADEMAMIX_QUANTIZED
        values = [b.let(f"s{k}", dequantize(*(b.tensor(n) for n in names))) for k, names in enumerate(q)]
        m1, m2, nu, update = _ademamix_update(b, grad, *values, lambda t, name, e: b.let(name, e))
    else:
        q = ()
        states = [b.tensor(n) for n in ("state1_fast", "state1_slow", "state2")]
        m1, m2, nu, update = _ademamix_update(b, grad, *states, lambda t, name, e: b.assign(t, e))
    _decay(o, b)
    b.assign(param, add(param, update, b.s.neg_lr))
    for names, value in zip(q, (m1, m2, nu), strict=False):
        b.quantize(*(b.tensor(n) for n in names), value)


def _ademamix_stages(o):
    if o.eight:
        kinds = {n: k for names in _ADEMAMIX_QUANTIZED for n, k in zip(names, QUANTIZED_KINDS, strict=True)}
        names = ("state1_fast", "state1_slow", "absmax1_fast", "absmax1_slow", "qmap1", "state2", "absmax2")
        names += ("qmap2",)  # (the programs' tensor order of before, which the compiled kernels key)
    else:
        names, kinds = ("state1_fast", "state1_slow", "state2"), None
    stages = (Between(_halves), Pass(program(o, ["param", "grad", *names], _ademamix_statements, kinds)))
    return with_hyperparameters(o, stages, _ademamix_scalars)


def _ademamix_scalars(group, state):
    step_t = state["step"]
    step_t += 1
    step = step_t.value
    beta1, beta2, beta3 = group["betas"]
    alpha, t_alpha, t_beta3 = group["alpha"], group["t_alpha"], group["t_beta3"]
    if t_alpha or t_beta3:  # bitsandbytes' schedules, as its update_step writes them
        alpha = min(step * alpha / t_alpha, alpha) if t_alpha else alpha
        if t_beta3:
            ln_beta1, ln_beta3 = math.log(beta1), math.log(beta3)
            step_scale = step / t_beta3
            beta3 = min(
                math.exp((ln_beta1 * ln_beta3) / (((1 - step_scale) * ln_beta3) + (step_scale * ln_beta1))),
                beta3,
            )
    lr, wd = group["lr"], group["weight_decay"]
    return {
        "t": step,
        "gnorm_scale": 1.0,
        "beta1": beta1,
        "beta2": beta2,
        "beta3": beta3,
        "one_minus_beta1": 1.0 - beta1,
        "one_minus_beta2": 1.0 - beta2,
        "one_minus_beta3": 1.0 - beta3,
        "alpha": alpha,
        "correction1": 1.0 - beta1**step,
        "correction2": math.sqrt(1.0 - beta2**step),
        "eps": group["eps"],
        "neg_lr": -lr,
        "decay": 1.0 - lr * wd,
    }


ADEMAMIX = StagedSpec(
    "ademamix",
    torch.optim.Optimizer,
    _ademamix_init_state,
    options,
    _ademamix_state_names,
    _ademamix_scalars,
    _ademamix_stages,
    state_options=state_options,
    int_state=("step",),
    rich_kwargs=dict(lr=1e-2, weight_decay=0.1),
    fidelity_kwargs={},
)

# one step spec per update rule, named as bitsandbytes' kernels name it
STEPS = {**{name: _spec(rule) for name, rule in RULES.items()}, "ademamix": ADEMAMIX}
