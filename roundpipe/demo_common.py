"""What the demo's runs share (``demo.py`` and ``demo_eightbit.py``): the training loop, the table
and the distance between two copies of the model."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


def train_rotating(runs: dict, data, gen, batch: int, steps: int, after_step=None):
    """Every copy's training steps on the same batches, the order of the copies rotating from
    step to step (so that machine noise hits them alike), its forward+backward and its
    ``step()`` timed apart; ``after_step(step)`` after each step of all the copies (untimed).
    Prints the losses every 5 steps; returns the medians ``(step seconds, forward+backward
    seconds)``, each a dict by copy."""
    names = list(runs)
    step_s, fwd_s = {n: [] for n in names}, {n: [] for n in names}
    losses: dict = {}
    print(" | ".join(["step"] + [f"loss {n}" for n in names]))
    for step in range(steps):
        idx = torch.randint(0, data.shape[0], (batch,), generator=gen)
        x, y = data[idx, :-1], data[idx, 1:]
        for k in range(len(names)):
            name = names[(step + k) % len(names)]  # rotate who goes first
            model, opt = runs[name]
            opt.zero_grad()
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            fwd_s[name].append(t1 - t0)
            step_s[name].append(t2 - t1)
            losses[name] = loss.item()
        if after_step is not None:
            after_step(step)
        if step % 5 == 0 or step == steps - 1:
            print(" | ".join([f"{step:>4}"] + [f"{losses[n]:>{len(n) + 5}.5f}" for n in names]))
    med_step = {n: statistics.median(step_s[n]) for n in names}
    med_fwd = {n: statistics.median(fwd_s[n]) for n in names}
    return med_step, med_fwd


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def table(header, rows) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(cells):
        pairs = enumerate(zip(cells, widths, strict=True))
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join([fmt(header), "-+-".join("-" * w for w in widths), *map(fmt, rows)])
