"""``python -m roundpipe.demo --fused [--dtype bfloat16]``: the line offload users write, torchtune's
layout (a bfloat16 model, ``AdamW(fused=True)``), trained with roundpipe's and with torch's.

Two copies of the demo's model (bfloat16 with ``--dtype bfloat16``, else float32) train on the
same batches in rotating order: ``roundpipe fused`` (``roundpipe.optim.AdamW(fused=True)``) and
``torch fused`` (``torch.optim.AdamW(fused=True)``, torch's fused CPU kernel). After every step
the two copies' parameters and optimizer state are compared bit for bit: where roundpipe's step
is torch's kernel's, the copies stay identical all along (same parameters, so the same
gradients). The demo prints the losses, the step medians, roundpipe's speedup and whether every
step was bitwise equal (exit status 1 if not).
"""

from __future__ import annotations

import copy
import statistics

import torch

from roundpipe import demo_mixed
from roundpipe import optim as rp_optim
from roundpipe.demo_stored import train_step

OURS, THEIRS = "roundpipe fused", "torch fused"


def _bits(t) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _differ(a, b) -> str | None:
    """Where two optimizers' parameters or state first differ in their bits, or None."""
    ours = [p for g in a.param_groups for p in g["params"]]
    theirs = [q for g in b.param_groups for q in g["params"]]
    for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
        if not torch.equal(_bits(p), _bits(q)):
            return f"parameter {i} {tuple(p.shape)}"
        for key, v in b.state[q].items():
            if not torch.equal(_bits(a.state[p][key]), _bits(v)):
                return f"state {key!r} of parameter {i} {tuple(p.shape)}"
    return None


def run(args, model, data, gen, hyper, batch, backend) -> int:
    dtype = torch.bfloat16 if args.dtype else torch.float32
    model = model.to(dtype)
    widen, compute_line = (False, "forward and backward: float32")
    if args.dtype:
        widen, compute_line = demo_mixed.choose_compute(dtype, args.compute)
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    runs = {
        OURS: (ours, rp_optim.AdamW(ours.parameters(), backend=backend, fused=True, **hyper)),
        THEIRS: (theirs, torch.optim.AdamW(theirs.parameters(), fused=True, **hyper)),
    }
    names = list(runs)
    kind = str(dtype).removeprefix("torch.")
    print(f"a {kind} model, AdamW(fused=True) on both sides; timed: optimizer.step()")
    print(compute_line)
    print(" | ".join(["step"] + [f"loss {n}" for n in names]))
    step_s = {n: [] for n in names}
    first_difference = None
    for step in range(args.steps):
        idx = torch.randint(0, data.shape[0], (batch,), generator=gen)
        x, y = data[idx, :-1], data[idx, 1:]
        losses = {}
        for k in range(len(names)):
            name = names[(step + k) % len(names)]
            m, opt = runs[name]
            losses[name], seconds = train_step(m, opt, x, y, widen)
            step_s[name].append(seconds)
        if first_difference is None:
            where = _differ(runs[OURS][1], runs[THEIRS][1])
            if where is not None:
                first_difference = f"step {step}: {where}"
        if step % 5 == 0 or step == args.steps - 1:
            print(" | ".join([f"{step:>4}"] + [f"{losses[n]:>{len(n) + 5}.5f}" for n in names]))
    med = {n: statistics.median(step_s[n]) for n in names}
    print()
    for n in names:
        print(f"{n}: step {med[n] * 1e3:.1f} ms (median of {args.steps})")
    print(f"speedup of roundpipe AdamW(fused=True) over torch's: {med[THEIRS] / med[OURS]:.2f}x")
    if first_difference is None:
        print(f"every one of the {args.steps} steps bitwise equal to torch's fused step (parameters, state)")
        return 0
    print(f"MISMATCH: roundpipe's fused step first differs from torch's at {first_difference}")
    return 1
