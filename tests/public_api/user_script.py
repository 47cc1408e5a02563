"""A user's script that touches every public name of roundpipe.optim, for the type checker
(``test_typing.py`` runs mypy on it; it is never run). Each ``reveal_type`` is checked there."""

import torch
from typing_extensions import reveal_type

import roundpipe.optim as ro
from roundpipe.optim import (
    ASGD,
    SGD,
    Adadelta,
    Adagrad,
    Adagrad8bit,
    Adam,
    Adam8bit,
    Adamax,
    AdamW,
    AdamW8bit,
    AdEMAMix8bit,
    GradScaler,
    LAMB8bit,
    LARS8bit,
    Lion8bit,
    NAdam,
    PagedAdam8bit,
    PagedAdamW8bit,
    PagedAdEMAMix8bit,
    PagedLion8bit,
    RAdam,
    RMSprop,
    RMSprop8bit,
    RoundpipeOptimizer,
    Rprop,
    SGD8bit,
    clip_grad_norm_,
    fp32_masters,
    get_num_threads,
    pair,
    partner_of,
    set_num_threads,
    shutdown_process_group,
    unpair,
)

model = torch.nn.Linear(4, 4)
params = list(model.parameters())
opt = AdamW(params, lr=1e-3, weight_decay=1e-2, backend="fast")
reveal_type(opt)
optimizers: list[RoundpipeOptimizer] = [
    Adadelta(params, lr=1.0, rho=0.9),
    Adagrad(params, lr=0.01, lr_decay=0.0),
    Adam(params, lr=torch.tensor(1e-3), betas=(0.9, 0.999), amsgrad=True),
    Adamax(params, lr=2e-3),
    ASGD(params, lambd=1e-4, t0=1e6),
    NAdam(params, momentum_decay=4e-3, decoupled_weight_decay=True),
    RAdam(params, decoupled_weight_decay=True),
    RMSprop(params, centered=True, momentum=0.9),
    Rprop(params, etas=(0.5, 1.2), step_sizes=(1e-6, 50)),
    SGD(params, lr=0.1, momentum=0.9, nesterov=True, backend="reference"),
]
reveal_type(opt.backend)
opt.step()
opt.zero_grad()

half = torch.nn.Linear(4, 4).half()
masters = fp32_masters(half)
reveal_type(masters)
mixed = ro.AdamW(masters)
scaler = GradScaler("cpu")
scaler.unscale_(mixed)
total = clip_grad_norm_(mixed, 1.0)
reveal_type(total)
total = mixed.clip_grad_norm_(1.0, norm_type=2.0)
scaler.step(mixed)
scaler.update()

master = torch.zeros(4, requires_grad=True)
partner = torch.zeros(4, dtype=torch.bfloat16)
pair(master, partner)
reveal_type(partner_of(master))
unpair(master)
set_num_threads(2)
set_num_threads(None)
reveal_type(get_num_threads())
reveal_type(shutdown_process_group())  # the end of a distributed rank

# bitsandbytes' 8-bit family: classes with signatures of their own (eightbit.py)
eight_bit = (
    AdEMAMix8bit,
    Adagrad8bit,
    Adam8bit,
    AdamW8bit,
    LAMB8bit,
    LARS8bit,
    Lion8bit,
    PagedAdam8bit,
    PagedAdamW8bit,
    PagedAdEMAMix8bit,
    PagedLion8bit,
    RMSprop8bit,
    SGD8bit,
)
