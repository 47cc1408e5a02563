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

The forward and backward run in ``--mixed``'s dtype only where this CPU runs its matmuls fast
(AMX, AVX512-BF16 or AVX512-FP16 in hardware). Elsewhere torch emulates them, several to tens
of times slower than float32, and the model's forward and backward, not the optimizer phase,
would take the run's minutes; there the forward and backward compute in float32 from float32
copies of the 16-bit parameters, made inside autograd (``torch.func.functional_call``), so
backward rounds the gradients to the parameters' dtype into their ``.grad`` as a 16-bit
backward would leave them. The parameters, their gradients and the optimizer phase are the
same 16-bit ones either way. ``--compute auto`` (the default) decides by timing a 16-bit matmul
against float32 at startup (``matmul_slowdown``); ``--compute 16-bit`` and ``--compute
float32`` force either, and the header says which ran and why.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from roundpipe import optim as rp_optim

MAX_NORM = 1.0
INIT_SCALE = 2.0**16  # torch.amp.GradScaler's default
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
ROUNDPIPE, FUSED, LOOP = "roundpipe", "torch fused", "torch for-loop"
COMPUTE = ("auto", "16-bit", "float32")  # --compute's choices
# auto computes forward and backward in float32 where a 16-bit matmul takes more than this many
# times float32's: with the 16-bit units it is at most about as slow, emulated many times slower
SLOW_RATIO = 2.0
# the CPU flags of the hardware that runs each dtype's matmuls fast (named in the header)
FAST_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


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


def matmul_slowdown(dtype, rows: int = 128, width: int = 512, reps: int = 5) -> float:
    """How many times float32's time a ``dtype`` matmul takes on one core of this CPU:
    ``F.linear`` of ``rows`` x ``width`` by ``width`` x ``width`` (the default model's
    projections of a batch), the best of ``reps`` each, the two dtypes taking turns."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, width, generator=gen), torch.randn(width, width, generator=gen)
    pairs = {dt: (x.to(dt), w.to(dt)) for dt in (torch.float32, dtype)}
    best = dict.fromkeys(pairs, float("inf"))
    threads = torch.get_num_threads()
    # one thread: on a shared machine a second thread waits out other processes' time slices,
    # which would time the scheduler, not the arithmetic
    torch.set_num_threads(1)
    try:
        for a, b in pairs.values():
            F.linear(a, b)  # not timed: the first call sets up (oneDNN generates its kernel)
        for _ in range(reps):
            for dt, (a, b) in pairs.items():
                t0 = time.perf_counter()
                F.linear(a, b)
                best[dt] = min(best[dt], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return best[dtype] / best[torch.float32]


def cpu_flags() -> set[str] | None:
    """The CPU's flags from ``/proc/cpuinfo``; None where it cannot be read (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def choose_compute(dtype, compute: str) -> tuple[bool, str]:
    """``(widen, lines)``: whether the forward and backward compute in float32 (``--compute
    float32``, or ``auto`` where ``matmul_slowdown`` is over ``SLOW_RATIO``), and the header's
    lines saying which and why."""
    name = str(dtype).removeprefix("torch.")
    if compute == "auto":
        ratio = matmul_slowdown(dtype)
        widen = ratio > SLOW_RATIO
        flags = cpu_flags()
        have = [] if flags is None else [f for f in FAST_FLAGS[dtype] if f in flags]
        found = " and ".join(have) if have else "neither " + " nor ".join(FAST_FLAGS[dtype])
        found = f"{found} among the CPU's flags; " if flags is not None else ""
        why = (
            f"a {name} matmul took {ratio:.1f}x float32's time on one core here ({found}torch's CPU "
            f"capability {torch.backends.cpu.get_cpu_capability()}); auto computes in float32 above "
            f"{SLOW_RATIO:g}x"
        )
    else:
        widen = compute == "float32"
        why = f"--compute {compute} (auto times a {name} matmul against float32 to decide)"
    if widen:
        how = (
            f"float32, from float32 copies of the {name} parameters (autograd rounds the gradients "
            f"to {name} into the parameters' .grad)"
        )
    else:
        how = name
    force = f"--compute 16-bit forces {name}" if widen else "--compute float32 forces float32"
    return widen, f"forward and backward: {how}\n  why: {why}; {force}"


def run(args, model, data, gen, hyper, batch, backend) -> int:
    dtype = DTYPES[args.mixed]
    scaled = dtype is torch.float16
    widen, compute_line = choose_compute(dtype, args.compute)
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
        f"(max_norm {MAX_NORM}); timed: the optimizer phase after backward\n{compute_line}"
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
            t = train_step(m, runner, data, idx, widen)
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
        train_step(theirs, replay, data, idx, widen)
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


def train_step(model, runner, data, idx, widen) -> float:
    """Forward and backward on the batch ``idx`` (in float32 if ``widen``), then the runner's
    optimizer phase; returns the phase's seconds (the loss is left on ``runner.loss``)."""
    x, y = data[idx, :-1], data[idx, 1:]
    if widen:
        # the float32 copies are made by autograd, so backward lands in the 16-bit parameters'
        # .grad, rounded to their dtype, where the optimizer phase reads them
        wide = {name: p.float() for name, p in model.named_parameters()}
        logits = torch.func.functional_call(model, wide, (x,))
    else:
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    scaler = runner.scaler
    (scaler.scale(loss) if scaler is not None else loss).backward()
    t0 = time.perf_counter()
    runner.phase()
    seconds = time.perf_counter() - t0
    runner.loss = loss.item()
    return seconds
