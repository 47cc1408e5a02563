"""``python -m roundpipe.demo --mixed float16|bfloat16``: the demo's model trained in low
precision with fp32 masters, the whole optimizer phase of mixed-precision training.

Three copies of the model, every parameter in ``--mixed``'s dtype, train on the same batches:

* ``roundpipe``: ``roundpipe.optim.fp32_masters(model)``, ``roundpipe.optim.AdamW`` on them,
  ``roundpipe.optim.GradScaler`` (float16) and ``opt.clip_grad_norm_``: one read of the
  gradients for the inf check and the norm, and the step that widens, unscales, clips, steps
  and rounds back in its one pass;
* ``torch fused`` and ``torch for-loop``: the same loop written with ``torch.optim.AdamW``
  (``fused=True``, ``foreach=False``) on fp32 masters with explicit casts: widen the gradients
  into the masters' ``.grad``, ``torch.amp.GradScaler.unscale_`` (float16),
  ``torch.nn.utils.clip_grad_norm_``, the step, copy the masters back into the model.

The optimizer phase (everything after ``backward``) is timed for each copy, every step, in
rotating order; the demo prints the medians and the speedups. Then, untimed, a fourth copy
replays the for-loop composition on the same batches, clipping with the total norms roundpipe
returned (``clip_grads_with_norm_``: roundpipe's one-pass norm is torch's to torch's own float32
rounding, not bit for bit), and the demo prints whether roundpipe's trained model is bitwise
equal to it (the composition is roundpipe's definition) and how far the norms were from torch's.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

from roundpipe import optim as rp_optim

MAX_NORM = 1.0
INIT_SCALE = 2.0**16  # torch.amp.GradScaler's default
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
ROUNDPIPE, FUSED, LOOP = "roundpipe", "torch fused", "torch for-loop"


class _Roundpipe:
    def __init__(self, model, hyper, scaled, backend):
        self.opt = rp_optim.AdamW(rp_optim.fp32_masters(model), backend=backend, **hyper)
        self.scaler = rp_optim.GradScaler("cpu", init_scale=INIT_SCALE) if scaled else None
        self.norms = []  # the total norm clip_grad_norm_ returned, a step each
        self.loss = None

    def phase(self):
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        self.norms.append(self.opt.clip_grad_norm_(MAX_NORM))
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad()


class _Composition:
    """torch.optim on fp32 masters, with the casts written out; ``norms``: clip with these
    total norms, one a step, instead of torch's (whose relative differences it records)."""

    def __init__(self, model, hyper, scaled, fused, norms=None):
        self.norms = norms
        self.differences = []  # per step: (roundpipe's vs torch's, vs float64, torch's vs float64)
        self.loss = None
        self.params = list(model.parameters())
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        for m in self.masters:
            m.grad = torch.empty_like(m)
        kind = {"fused": True} if fused else {"foreach": False}
        self.opt = torch.optim.AdamW(self.masters, **kind, **hyper)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) if scaled else None

    @torch.no_grad()
    def phase(self):
        torch._foreach_copy_(self.opt_grads, [p.grad for p in self.params])
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if self.norms is None:
            torch.nn.utils.clip_grad_norm_(self.masters, MAX_NORM)
        else:
            theirs = torch.nn.utils.get_total_norm(self.opt_grads).item()
            wide = torch.cat([g.double().reshape(-1) for g in self.opt_grads])
            exact = torch.linalg.vector_norm(wide).item()
            norm = self.norms[len(self.differences)]
            ours = norm.item()
            self.differences.append(
                (abs(ours - theirs) / theirs, abs(ours - exact) / exact, abs(theirs - exact) / exact)
            )
            torch.nn.utils.clip_grads_with_norm_(self.masters, MAX_NORM, norm)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        torch._foreach_copy_(self.params, self.masters)
        for p in self.params:
            p.grad = None

    @property
    def opt_grads(self):
        return [m.grad for m in self.masters]


def run(args, model, data, gen, hyper, batch, backend) -> int:
    dtype = DTYPES[args.mixed]
    scaled = dtype is torch.float16
    model = model.to(dtype)
    start = copy.deepcopy(model)
    copies = {}
    for name in (ROUNDPIPE, FUSED, LOOP):
        m = copy.deepcopy(model)
        if name == ROUNDPIPE:
            copies[name] = (m, _Roundpipe(m, hyper, scaled, backend))
        else:
            copies[name] = (m, _Composition(m, hyper, scaled, fused=name == FUSED))
    names = list(copies)
    recipe = "GradScaler and clipping" if scaled else "clipping"
    print(
        f"mixed precision: every parameter in {args.mixed}, fp32 masters, {recipe} "
        f"(max_norm {MAX_NORM}); timed: the optimizer phase after backward"
    )
    print(" | ".join(["step"] + [f"loss {n}" for n in names]))
    phase_s = {n: [] for n in names}
    losses = {}
    batches = []
    for step in range(args.steps):
        idx = torch.randint(0, data.shape[0], (batch,), generator=gen)
        batches.append(idx)
        for k in range(len(names)):
            name = names[(step + k) % len(names)]
            m, runner = copies[name]
            t = _train_step(m, runner, data, idx)
            phase_s[name].append(t)
            losses[name] = runner.loss
        if step % 5 == 0 or step == args.steps - 1:
            print(" | ".join([f"{step:>4}"] + [f"{losses[n]:>{len(n) + 5}.5f}" for n in names]))
    med = {n: statistics.median(phase_s[n]) for n in names}
    print()
    for n in names:
        print(f"{n}: optimizer phase {med[n] * 1e3:.1f} ms (median of {args.steps})")
    print(
        f"speedup of roundpipe's optimizer phase over torch fused's: {med[FUSED] / med[ROUNDPIPE]:.2f}x "
        f"(over torch's for-loop: {med[LOOP] / med[ROUNDPIPE]:.2f}x)"
    )
    # the check, untimed: the for-loop composition replayed with roundpipe's norms
    theirs = start
    replay = _Composition(theirs, hyper, scaled, fused=False, norms=copies[ROUNDPIPE][1].norms)
    for idx in batches:
        _train_step(theirs, replay, data, idx)
    ours = copies[ROUNDPIPE][0]
    equal = all(
        torch.equal(p.view(torch.int16), q.view(torch.int16))
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True)
    )
    vs_torch, ours_vs_exact, torch_vs_exact = (max(d) for d in zip(*replay.differences, strict=True))
    print(
        "roundpipe's clip norms against torch's get_total_norm of the same gradients: "
        f"{vs_torch:.1e} relative at most (against their float64 norm: roundpipe's {ours_vs_exact:.1e}, "
        f"torch's {torch_vs_exact:.1e})"
    )
    if equal:
        print(
            f"roundpipe: after {args.steps} steps the model is bitwise equal to the for-loop composition's "
            "(clipped with the same norms)"
        )
        return 0
    print(f"MISMATCH: after {args.steps} steps roundpipe's model differs from the for-loop composition's")
    return 1


def _train_step(model, runner, data, idx) -> float:
    """Forward and backward on the batch ``idx``, then the runner's optimizer phase; returns the
    phase's seconds (the loss is left on ``runner.loss``)."""
    x, y = data[idx, :-1], data[idx, 1:]
    loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    scaler = runner.scaler
    (scaler.scale(loss) if scaler is not None else loss).backward()
    t0 = time.perf_counter()
    runner.phase()
    seconds = time.perf_counter() - t0
    runner.loss = loss.item()
    return seconds
