"""Demo: train one small MLP twice, with torch.optim.AdamW and with roundpipe.optim.AdamW.

    python -m roundpipe.demo [--steps 50] [--backend fast] [--threads N]

Both runs start from the same weights and see the same mini-batches, so their gradients are
equal as long as their parameters are: the demo prints the largest parameter difference every
few steps, the final loss of both, and the median ``optimizer.step()`` time of each (the two
steps alternate in one process, so machine noise hits both alike). It exits with status 1 if
the parameters do not match (``torch.testing.assert_close``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import numexpr
import torch

from roundpipe import optim as rp_optim


def make_model(d_in: int, hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, 1),
    )


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roundpipe.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--backend", default=None, help="roundpipe backend (default: fast)")
    parser.add_argument("--threads", type=int, help="set torch's and numexpr's thread counts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        numexpr.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    d_in, hidden, n, batch = 64, 512, 4096, 256
    # synthetic regression: a random "teacher" network plus noise
    x = torch.randn(n, d_in)
    with torch.no_grad():
        y = make_model(d_in, 64)(x) + 0.01 * torch.randn(n, 1)
    ours = make_model(d_in, hidden)
    theirs = copy.deepcopy(ours)
    n_params = sum(p.numel() for p in ours.parameters())

    hyper = {"lr": 1e-3, "weight_decay": 1e-2}
    runs = {
        "torch.optim.AdamW": (theirs, torch.optim.AdamW(theirs.parameters(), **hyper)),
        "roundpipe.optim.AdamW": (ours, rp_optim.AdamW(ours.parameters(), backend=args.backend, **hyper)),
    }
    rp_backend = runs["roundpipe.optim.AdamW"][1].backend
    print(
        f"MLP {d_in}-{hidden}-{hidden}-1 ({n_params:,} parameters), {args.steps} AdamW steps "
        f"(lr={hyper['lr']}, weight_decay={hyper['weight_decay']}), batch {batch} of {n} samples; "
        f"roundpipe backend {rp_backend!r}; threads: torch {torch.get_num_threads()}, "
        f"numexpr {numexpr.get_num_threads()}"
    )
    print(f"{'step':>4} | {'loss torch':>12} | {'loss roundpipe':>14} | max |param diff|")

    step_times = {name: [] for name in runs}
    gen = torch.Generator().manual_seed(args.seed + 1)
    for step in range(args.steps):
        idx = torch.randint(0, n, (batch,), generator=gen)
        xb, yb = x[idx], y[idx]
        losses = {}
        names = list(runs) if step % 2 == 0 else list(reversed(runs))  # alternate who goes first
        for name in names:
            model, opt = runs[name]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            t0 = time.perf_counter()
            opt.step()
            step_times[name].append(time.perf_counter() - t0)
            losses[name] = loss.item()
        if step % 10 == 0 or step == args.steps - 1:
            lt, lr_ = losses["torch.optim.AdamW"], losses["roundpipe.optim.AdamW"]
            print(f"{step:>4} | {lt:>12.6f} | {lr_:>14.6f} | {max_param_diff(ours, theirs):.3e}")

    with torch.no_grad():
        final = {name: torch.nn.functional.mse_loss(m(x), y).item() for name, (m, _) in runs.items()}
    print()
    for name in runs:
        ms = statistics.median(step_times[name]) * 1e3
        print(f"{name:<22} final loss {final[name]:.6f}   median step {ms:.3f} ms")
    t_torch = statistics.median(step_times["torch.optim.AdamW"])
    t_rp = statistics.median(step_times["roundpipe.optim.AdamW"])
    print(f"speedup of roundpipe over torch's default (for-loop) AdamW: {t_torch / t_rp:.2f}x")

    try:
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach())
    except AssertionError as e:
        print(f"MISMATCH: roundpipe's parameters differ from torch's:\n{e}", file=sys.stderr)
        return 1
    diff = max_param_diff(ours, theirs)
    how = "bitwise equal" if diff == 0 else f"assert_close; max abs difference {diff:.3e}"
    print(f"parameters match torch's ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
