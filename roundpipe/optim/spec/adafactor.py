"""Adafactor: ``torch.optim._adafactor._single_tensor_adafactor``, as a staged step.

A parameter of two or more dimensions keeps its second moment factored over the last two: a
row statistic ``row_var`` ``(..., m, 1)`` and a column statistic ``col_var`` ``(..., 1, n)``;
one of fewer keeps ``variance``, as large as itself. No first moment. A step of a matrix:

1. a read-only pass takes ``param.norm(2)`` and the gradient's row and column norms;
2. ``row_var`` and ``col_var`` move towards the squared, averaged norms (``lerp`` on the small
   tensors, as torch computes them, into new tensors: state moves only at the end), and the
   step size ``alpha`` follows from the parameter's norm;
3. a read-only pass takes the norm of the update
   ``rsqrt(clamp(row_var @ col_var / mean(row_var), eps1 ** 2)) * grad`` without storing it;
4. the step is scaled down where that norm is large (``d``);
5. the last pass decays the parameter and adds the update, recomputed element by element
   with the same rounding; ``row_var`` and ``col_var`` are then replaced (``commit``).

A vector (or a 0-d parameter) takes passes 1 and 3 together and the last pass also writes
``variance``. ``row_var @ col_var`` is an outer product: each element one float32 product,
``row * col`` here.
"""

from __future__ import annotations

import torch

from .core import advance_step, to_scalar, zero_step
from .ir import add, clamp_min, lerp, rsqrt
from .staged import Between, Pass, StagedSpec, program


def init_state(group, p, state):
    # torch's _init_group, whose checks come first
    if torch.is_complex(p):
        raise RuntimeError("Adafactor does not support complex parameters")
    if len(state) == 0:
        state["step"] = zero_step()
        if p.dim() > 1:
            row_shape, col_shape = list(p.shape), list(p.shape)
            row_shape[-1], col_shape[-2] = 1, 1
            state["row_var"] = p.new_zeros(row_shape)
            state["col_var"] = p.new_zeros(col_shape)
        else:
            state["variance"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def options(group, p):
    return {
        "maximize": group["maximize"],
        "weight_decay": group["weight_decay"] != 0,
        "factored": p.dim() > 1,
    }


def state_names(o, p):
    if not o.factored:
        return {"variance": p.shape}
    row_shape, col_shape = list(p.shape), list(p.shape)
    row_shape[-1], col_shape[-2] = 1, 1
    return {"row_var": row_shape, "col_var": col_shape}


def scalars(group, state):
    lr = to_scalar(group["lr"])
    eps1, eps2 = group["eps"]
    if eps1 is None:  # torch takes the parameter's dtype's: the masters are float32
        eps1 = torch.finfo(torch.float32).eps
    step_float = advance_step(state)
    rho_t = min(lr, 1 / (step_float**0.5))
    return {
        "one_minus_beta2_t": step_float ** group["beta2_decay"],
        "rho_t": rho_t,
        "eps1": eps1,
        "eps1_sq": eps1 * eps1,
        "eps2": eps2,
        "d": group["d"],
        "weight_decay_factor": 1 - lr * group["weight_decay"],
    }


def _gradient(o, b):
    grad = b.tensor("grad")
    return b.let("grad", -grad) if o.maximize else grad


def _update(o, b):
    """``update``, as torch computes it (a let: element by element, never stored)."""
    s, grad = b.s, _gradient(o, b)
    if o.factored:
        var_estimate = b.tensor("row_factor") * b.tensor("col_factor") / b.tensor("row_scale")
    else:
        variance = b.tensor("variance")
        new = lerp(variance, grad * grad, s.one_minus_beta2_t)
        var_estimate = b.assign(variance, new) if o.get("writes") else b.let("variance", new)
    return b.let("update", rsqrt(clamp_min(var_estimate, s.eps1_sq)) * grad)


_KINDS = {"row_factor": "rows", "col_factor": "cols", "row_scale": "matrices"}


def _inputs(o):
    if o.factored:
        return ["param", "grad", "row_factor", "col_factor", "row_scale"]
    return ["param", "grad", "variance"]


def _measure_statements(o, b):
    b.norm("param_norm", b.tensor("param"))
    if o.factored:
        grad = _gradient(o, b)
        b.norm("row_norm", grad, dim=-1)
        b.norm("col_norm", grad, dim=-2)
    else:
        b.norm("update_norm", _update(o, b))


def _update_norm_statements(o, b):
    b.norm("update_norm", _update(o, b))


def _step_statements(o, b):
    param = b.tensor("param")
    if o.weight_decay:
        b.assign(param, param * b.s.weight_decay_factor)
    b.assign(param, add(param, _update(o, b), alpha=b.s.neg_step))


def _factors(ctx):
    """torch's updates of ``row_var`` and ``col_var`` (into new tensors), and the divisor."""
    row_norm, col_norm, w = ctx["row_norm"], ctx["col_norm"], ctx["one_minus_beta2_t"]
    grad = ctx["grad"]
    row_mean = row_norm.square_().div_(grad.size(-1))
    ctx["row_factor"] = torch.lerp(ctx["row_var"], row_mean, w)
    col_mean = col_norm.square_().div_(grad.size(-2))
    ctx["col_factor"] = torch.lerp(ctx["col_var"], col_mean, w)
    ctx["row_scale"] = ctx["row_factor"].mean(dim=-2, keepdim=True).clamp_(min=ctx["eps1"])


def _alpha(ctx):
    param = ctx["param"]
    ctx["alpha"] = max(ctx["eps2"], float(ctx["param_norm"]) / (param.numel() ** 0.5)) * ctx["rho_t"]


def _step_size(ctx):
    numel = ctx["param"].numel()
    denom = max(1.0, float(ctx["update_norm"]) / ((numel**0.5) * ctx["d"]))
    ctx["neg_step"] = -ctx["alpha"] / denom


def build_stages(o):
    inputs, kinds = _inputs(o), _KINDS if o.factored else None
    last = Pass(program({**o, "writes": True}, inputs, _step_statements, kinds))
    if not o.factored:
        return (Pass(program(o, inputs, _measure_statements)), Between(_alpha), Between(_step_size), last)
    return (
        Pass(program(o, ["param", "grad"], _measure_statements)),
        Between(_factors),
        Between(_alpha),
        Pass(program(o, inputs, _update_norm_statements, kinds)),
        Between(_step_size),
        last,
    )


ADAFACTOR = StagedSpec(
    "Adafactor",
    torch.optim.Adafactor,
    init_state,
    options,
    state_names,
    scalars,
    build_stages,
    commit=(("row_var", "row_factor"), ("col_var", "col_factor")),
    rich_kwargs=dict(lr=0.01, weight_decay=0.1, maximize=True),
    fidelity_kwargs=dict(lr=1e-2),
)
