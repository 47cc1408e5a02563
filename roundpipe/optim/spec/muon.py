"""Muon: ``torch.optim._muon._single_tensor_muon`` (torch >= 2.9), as a staged step.

Its elementwise parts around torch's own Newton-Schulz orthogonalisation:

1. a pass computes the momentum ``buf.lerp(grad, 1 - momentum)`` and the (Nesterov) update
   ``grad.lerp(buf, momentum)`` without writing the buffer, and stores the update rounded to
   bfloat16 (what torch's ``_zeropower_via_newtonschulz`` starts from) in a scratch tensor;
2. torch's ``_zeropower_via_newtonschulz`` (its matmuls, bits included) and ``_adjust_lr``,
   called as torch's for-loop calls them;
3. the last pass writes the momentum buffer (recomputed, the same rounding), decays the
   parameter and adds the orthogonalised update (bfloat16, widened as torch's ``add_`` does).
"""

from __future__ import annotations

import torch

from .core import to_scalar
from .ir import add, lerp
from .staged import Between, Pass, StagedSpec, program

TORCH_CLASS = getattr(torch.optim, "Muon", None)  # torch >= 2.9


def _torch_muon():
    import torch.optim._muon as muon

    return muon


def init_state(group, p, state):
    if torch.is_complex(p):
        raise RuntimeError("Muon does not support complex parameters")
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def check_group(group):
    # what torch's _zeropower_via_newtonschulz raises on its first parameter (after that
    # parameter's buffer moved): here before anything moves
    if group["ns_steps"] >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")


def options(group, p):
    if p.dim() != 2:
        raise ValueError("Param gradient must be a 2D matrix")
    return {"nesterov": group["nesterov"]}


def state_names(o, p):
    return {"momentum_buffer": p.shape}


def scalars(group, state):
    lr = to_scalar(group["lr"])
    momentum = group["momentum"]
    return {
        "lr": lr,
        "one_minus_momentum": 1 - momentum,
        "momentum": momentum,
        "weight_decay_factor": 1 - lr * group["weight_decay"],
    }


def _buffer(b):
    buf = b.tensor("momentum_buffer")
    return buf, lerp(buf, b.tensor("grad"), b.s.one_minus_momentum)


def _update_statements(o, b):
    _, new_buf = _buffer(b)
    new_buf = b.let("buf", new_buf)
    update = lerp(b.tensor("grad"), new_buf, b.s.momentum) if o.nesterov else new_buf
    b.assign(b.tensor("update"), update)


def _orthogonalise(ctx):
    muon, group = _torch_muon(), ctx["group"]
    param = ctx["param"]
    ortho = muon._zeropower_via_newtonschulz(
        ctx["update"], group["ns_coefficients"], group["ns_steps"], group["eps"]
    )
    ctx["ortho"] = ortho.contiguous()  # (a transposed matrix where rows > columns: the same values)
    ctx["neg_lr"] = -muon._adjust_lr(ctx["lr"], group["adjust_lr_fn"], param.shape)


def _new_update(ctx):
    ctx["update"] = torch.empty_like(ctx["param"], dtype=torch.bfloat16)


def _step_statements(o, b):
    buf, new_buf = _buffer(b)
    b.assign(buf, new_buf)
    param = b.tensor("param")
    b.assign(param, param * b.s.weight_decay_factor)
    b.assign(param, add(param, b.tensor("ortho"), alpha=b.s.neg_lr))


def build_stages(o):
    return (
        Between(_new_update),
        Pass(program(o, ["grad", "momentum_buffer", "update"], _update_statements)),
        Between(_orthogonalise),
        Pass(program(o, ["param", "grad", "momentum_buffer", "ortho"], _step_statements)),
    )


MUON = (
    None
    if TORCH_CLASS is None
    else StagedSpec(
        "Muon",
        TORCH_CLASS,
        init_state,
        options,
        state_names,
        scalars,
        build_stages,
        check_group=check_group,
        scalar_state=(),
        rich_kwargs=dict(lr=0.02, weight_decay=0.1, nesterov=True),
        fidelity_kwargs=dict(lr=1e-2),
    )
)
