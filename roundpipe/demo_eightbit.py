"""``python -m roundpipe.demo --optimizer AdamW8bit``: the demo's model trained with roundpipe's
``AdamW8bit`` beside torch's fused fp32 ``AdamW`` and, where it is installed, bitsandbytes'
``AdamW8bit`` (bitsandbytes is imported here only, inside a function: the demo runs without it).

The copies start equal and train on the same batches (``demo_common.py``'s loop, the demo's: the
order rotates each step, forward+backward and ``step()`` timed apart). roundpipe's 8-bit step is bitsandbytes'
CPU step bit for bit, so their copies see the same gradients and must stay equal: after every
step each roundpipe copy's parameters are compared with bitsandbytes' bit for bit, and after the
last step every state entry too (codes, absmax, codebooks, step); the first difference is
reported and makes the exit status 1. torch's fused fp32 copy shows what 8-bit state costs in
accuracy (how far its parameters end up) and in time.
"""

from __future__ import annotations

import sys
import warnings

import torch

from roundpipe import optim as rp_optim
from roundpipe.demo_common import max_abs_diff, table, train_rotating
from roundpipe.optim.bench.eightbit import state_bytes
from roundpipe.optim.bench.workloads import bits_mismatch

OPTIMIZERS = ("AdamW8bit",)
FUSED, BNB = "torch fused", "bitsandbytes"


def bitsandbytes_optim():
    """bitsandbytes' ``optim`` module, or None where it cannot be imported."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes
    except Exception:  # noqa: BLE001 - not installed, or a broken install: the demo goes on without
        return None
    return bitsandbytes.optim


def optimizer_kinds(chosen: str, hyper: dict, optimizer: str = "AdamW8bit") -> dict:
    """name -> a function making that copy's optimizer: roundpipe's on backend ``chosen``,
    torch's fused fp32 AdamW, and bitsandbytes' where it imports; ``hyper`` for all three."""
    torch_name = optimizer.removesuffix("8bit")
    kinds = {
        f"roundpipe {chosen}": lambda ps: getattr(rp_optim, optimizer)(ps, backend=chosen, **hyper),
        FUSED: lambda ps: getattr(torch.optim, torch_name)(ps, fused=True, **hyper),
    }
    bnb = bitsandbytes_optim()
    if bnb is not None:
        kinds[BNB] = lambda ps: getattr(bnb, optimizer)(ps, **hyper)
    return kinds


def params_mismatch(model, ref) -> str | None:
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters(), strict=True)):
        why = bits_mismatch(p.detach(), q.detach())
        if why:
            return f"parameter {i} {tuple(q.shape)}: {why}"
    return None


def state_mismatch(runs, name) -> str | None:
    (model, opt), (ref_model, ref_opt) = runs[name], runs[BNB]
    for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters(), strict=True)):
        ours, theirs = opt.state[p], ref_opt.state[q]
        if set(ours) != set(theirs):
            return f"parameter {i}: state keys {sorted(ours)} != bitsandbytes' {sorted(theirs)}"
        for key, v in theirs.items():
            why = bits_mismatch(ours[key], v) if torch.is_tensor(v) else (None if ours[key] == v else "")
            if why is not None:
                return f"parameter {i} {tuple(q.shape)}: state {key!r}: {why or f'{ours[key]!r} vs {v!r}'}"
    return None


def train(args, runs, data, gen, batch):
    """Every copy's steps (``demo_common.train_rotating``); after each step, each roundpipe copy's
    parameters against bitsandbytes'. Returns the medians of step and forward+backward, and per
    roundpipe copy the first mismatch (``(step, what)``) or None."""
    ours = [n for n in runs if n.startswith("roundpipe ")]
    first: dict = dict.fromkeys(ours)

    def check(step):
        for n in ours:
            why = None if first[n] else params_mismatch(runs[n][0], runs[BNB][0])
            if why:
                first[n] = (step + 1, why)

    med_step, med_fwd = train_rotating(runs, data, gen, batch, args.steps, check if BNB in runs else None)
    for n in ours:
        if BNB in runs and first[n] is None:
            why = state_mismatch(runs, n)
            first[n] = (args.steps, why) if why else None
    return med_step, med_fwd, first


def run(args, runs, data, gen, batch) -> int:
    """The 8-bit demo after ``demo.main``'s header: train, then the table and the verdicts."""
    opt = args.optimizer
    med_step, med_fwd, first = train(args, runs, data, gen, batch)
    names = list(runs)
    numel = sum(p.numel() for p in runs[FUSED][0].parameters())
    has_bnb = BNB in runs
    head = [f"median of {args.steps} steps", "step ms", "fwd+bwd ms", "step share", "vs torch fused"]
    head += ["vs bitsandbytes"] if has_bnb else []
    head += ["state B/param", f"diff from fused after {args.steps}"]
    rows = []
    for n in names:
        what = f"{n} {opt.removesuffix('8bit')} (fp32 state)" if n == FUSED else f"{n} {opt}"
        row = [what, f"{med_step[n] * 1e3:.1f}", f"{med_fwd[n] * 1e3:.1f}"]
        row += [f"{100 * med_step[n] / (med_step[n] + med_fwd[n]):.0f}%"]
        row += [f"{med_step[ref] / med_step[n]:.2f}x" for ref in (FUSED, BNB) if ref in runs]
        row += [f"{state_bytes(runs[n][1].state) / numel:.2f}"]
        row += ["-" if n == FUSED else f"{max_abs_diff(runs[n][0], runs[FUSED][0]):.2e}"]
        rows.append(row)
    print()
    print(table(head, rows))
    print(
        f"vs torch fused{', vs bitsandbytes' if has_bnb else ''}: that step's median / this step's "
        "median (> 1: this one faster); diff: max |param - torch fused fp32 copy's| (what 8-bit state "
        "changes)"
    )
    print()
    status = 0
    for n in [n for n in names if n.startswith("roundpipe ")]:
        fp32 = opt.removesuffix("8bit")
        ratios = f"speedup of {n} {opt} over torch fused fp32 {fp32}: {med_step[FUSED] / med_step[n]:.2f}x"
        if has_bnb:
            ratios += f"; over bitsandbytes' {opt}: {med_step[BNB] / med_step[n]:.2f}x"
        print(ratios)
        if not has_bnb:
            print(f"{n}: not compared with bitsandbytes (not installed here: pip install bitsandbytes)")
        elif first[n] is None:
            print(
                f"{n}: bit for bit bitsandbytes' {opt}: parameters after each of the {args.steps} steps, "
                "and every state entry after the last"
            )
        else:
            step, why = first[n]
            print(
                f"MISMATCH: {n} is not bitsandbytes' {opt} bit for bit, from step {step}: {why}",
                file=sys.stderr,
            )
            print(f"{n}: NOT bit for bit bitsandbytes' {opt} (from step {step})")
            status = 1
    return status
