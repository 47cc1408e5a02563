"""``python -m roundpipe.demo --state-dtype bfloat16`` and ``--dtype bfloat16
[--stochastic-rounding]``: the demo's model trained with 16-bit optimizer state, or as a pure
bfloat16 model, beside float32 AdamW (``roundpipe.optim.storage``).

* ``--state-dtype bfloat16``: copies of the float32 model, ``roundpipe bf16 state``
  (``AdamW(state_dtype=torch.bfloat16)``: 4 bytes of state a parameter where fp32 AdamW keeps 8),
  ``roundpipe fp32 state`` and ``torch fused fp32``;
* ``--dtype bfloat16``: the model in bfloat16, ``roundpipe bf16 nearest`` (``AdamW`` on the
  bfloat16 parameters as they are: torch's for-loop bit for bit, each op rounded to bfloat16)
  and with ``--stochastic-rounding`` ``roundpipe bf16 SR`` (``stochastic_rounding=True``: the
  step in float32, the parameters rounded stochastically), beside ``torch fused fp32`` on a
  float32 copy of the same (bfloat16-valued) initial weights: float32 AdamW, the reference.

Every copy trains on the same batches, in rotating order, its ``optimizer.step()`` timed. The
demo prints the losses side by side, the step medians, each copy's state bytes per parameter,
and how far each 16-bit copy ended up from the float32 reference: the mean absolute difference
of the parameters, and of the losses over the last steps; with ``--stochastic-rounding``
whether stochastic rounding kept the bfloat16 model closer to float32 than nearest rounding
did, as measured in this run. Then, untimed, one step of each roundpipe copy from its own final
state against its definition written with torch.optim (``one_step_check``), bit for bit (exit
status 1 if not). On a CPU without fast bfloat16 matmuls the bfloat16 copies' forward and
backward compute in float32 from their parameters (``demo_mixed.choose_compute``).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

from roundpipe import demo_mixed
from roundpipe import optim as rp_optim
from roundpipe.optim.spec import SPECS
from roundpipe.optim.storage import stochastic_round

SR, NEAREST, BF16_STATE = "roundpipe bf16 SR", "roundpipe bf16 nearest", "roundpipe bf16 state"
FP32_STATE, FUSED = "roundpipe fp32 state", "torch fused fp32"
LAST = 10  # the losses compared over the last steps


def copies(args, model, hyper, backend) -> dict:
    """name -> (model, optimizer, whether it is a bfloat16 model), roundpipe's first."""
    out = {}

    def add(name, m, opt, low):
        out[name] = (m, opt, low)

    if args.state_dtype:
        m = copy.deepcopy(model)
        add(
            BF16_STATE,
            m,
            rp_optim.AdamW(m.parameters(), backend=backend, state_dtype=torch.bfloat16, **hyper),
            False,
        )
        m = copy.deepcopy(model)
        add(FP32_STATE, m, rp_optim.AdamW(m.parameters(), backend=backend, **hyper), False)
    else:
        low = model.to(torch.bfloat16)
        if args.stochastic_rounding:
            m = copy.deepcopy(low)
            add(
                SR,
                m,
                rp_optim.AdamW(m.parameters(), backend=backend, stochastic_rounding=True, **hyper),
                True,
            )
        m = copy.deepcopy(low)
        add(NEAREST, m, rp_optim.AdamW(m.parameters(), backend=backend, **hyper), True)
        model = low.float()  # the reference starts from the same (bfloat16) values
    m = copy.deepcopy(model)
    add(FUSED, m, torch.optim.AdamW(m.parameters(), fused=True, **hyper), False)
    return out


def train_step(model, opt, x, y, widen) -> tuple[float, float]:
    """Forward and backward (in float32 from a bfloat16 model's parameters if ``widen``), then the
    step: ``(loss, the step's seconds)``."""
    opt.zero_grad()
    if widen:  # (autograd rounds the gradients to bfloat16 into the parameters' .grad)
        wide = {name: p.float() for name, p in model.named_parameters()}
        logits = torch.func.functional_call(model, wide, (x,))
    else:
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    t0 = time.perf_counter()
    opt.step()
    return loss.item(), time.perf_counter() - t0


def state_bytes(opt, model) -> float:
    held = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim())
    return held / sum(p.numel() for p in model.parameters())


def _round_state(opt, dtype):
    with torch.no_grad():
        for st in opt.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and k not in SPECS["AdamW"].scalar_state:
                    v.copy_(v.to(dtype))


def one_step_check(name, model, opt, hyper) -> str | None:
    """One step of ``opt`` (a roundpipe copy) from its state, against its definition written with
    torch.optim's for-loop: None if bitwise equal, else where it first differs."""
    ours_model, theirs_model = copy.deepcopy(model), copy.deepcopy(model)
    ours_opt = type(opt)(
        ours_model.parameters(),
        backend=opt.backend,
        state_dtype=opt.state_dtype,
        stochastic_rounding=opt.stochastic_rounding,
        **hyper,
    )
    ours_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q, r in zip(ours_model.parameters(), theirs_model.parameters(), model.parameters(), strict=True):
        p.grad, q.grad = r.grad.clone(), r.grad.clone()
    stream = opt.state_dict().get("stochastic_rounding")
    widened = name in (SR, BF16_STATE)  # (the others: torch's for-loop on the model as it is)
    masters = [torch.nn.Parameter(q.detach().float()) if widened else q for q in theirs_model.parameters()]
    for m, q in zip(masters, theirs_model.parameters(), strict=True):
        m.grad = q.grad.float() if widened else q.grad
    ref = torch.optim.AdamW(masters, foreach=False, **hyper)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    ours_opt.step()
    if widened:
        _round_state(ref, torch.bfloat16)
    ref.step()
    if widened:
        _round_state(ref, torch.bfloat16)
    for pid, (p, m) in enumerate(zip(ours_model.parameters(), masters, strict=True)):
        if name == SR:
            expected = stochastic_round(m.detach(), stream["seed"], stream["steps"], pid)
        else:
            expected = m.detach().to(p.dtype)
        if not torch.equal(p.detach(), expected) or not torch.equal(p.detach().isnan(), expected.isnan()):
            return f"parameter {pid} {tuple(p.shape)}"
        for k, v in ref.state[m].items():
            if k not in SPECS["AdamW"].scalar_state and not torch.equal(
                ours_opt.state[p][k], v.to(ours_opt.state[p][k].dtype)
            ):
                return f"state {k!r} of parameter {pid} {tuple(p.shape)}"
    return None


def _distance(a, b) -> float:
    """The mean absolute difference of two models' parameters, over every element."""
    total = sum(
        (p.detach().float() - q.detach().float()).abs().sum().item()
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    return total / sum(p.numel() for p in a.parameters())


def run(args, model, data, gen, hyper, batch, backend) -> int:
    runs = copies(args, model, hyper, backend)
    widen, compute_line = (False, "forward and backward: float32")
    if args.dtype:
        widen, compute_line = demo_mixed.choose_compute(torch.bfloat16, args.compute)
    names = list(runs)
    what = (
        "a float32 model, AdamW's moments in bfloat16 (state_dtype=torch.bfloat16) beside float32 ones"
        if args.state_dtype
        else "a pure bfloat16 model (parameters, gradients, moments)"
        + (" rounded stochastically and to nearest" if args.stochastic_rounding else " rounded to nearest")
        + ", beside float32 AdamW on a float32 copy"
    )
    print(f"{what}; timed: optimizer.step()\n{compute_line if args.dtype else ''}".rstrip())
    print(" | ".join(["step"] + [f"loss {n}" for n in names]))
    step_s = {n: [] for n in names}
    losses = {n: [] for n in names}
    for step in range(args.steps):
        idx = torch.randint(0, data.shape[0], (batch,), generator=gen)
        x, y = data[idx, :-1], data[idx, 1:]
        for k in range(len(names)):
            name = names[(step + k) % len(names)]
            m, opt, low = runs[name]
            loss, seconds = train_step(m, opt, x, y, widen and low)
            losses[name].append(loss)
            step_s[name].append(seconds)
        if step % 5 == 0 or step == args.steps - 1:
            print(" | ".join([f"{step:>4}"] + [f"{losses[n][-1]:>{len(n) + 5}.5f}" for n in names]))
    return _report(args, runs, names, step_s, losses, hyper)


def _report(args, runs, names, step_s, losses, hyper) -> int:
    print()
    med = {n: statistics.median(step_s[n]) for n in names}
    for n in names:
        m, opt, _ = runs[n]
        print(
            f"{n}: step {med[n] * 1e3:.1f} ms (median of {args.steps}); "
            f"state {state_bytes(opt, m):.2f} bytes a parameter"
        )
    reference = runs[FUSED][0]
    last = min(LAST, args.steps)
    far = {}
    for n in names[:-1]:
        gap = statistics.mean(
            abs(a - b) for a, b in zip(losses[n][-last:], losses[FUSED][-last:], strict=True)
        )
        far[n] = (_distance(runs[n][0], reference), gap)
        print(
            f"{n} against {FUSED} after {args.steps} steps: parameters {far[n][0]:.3e} apart (mean "
            f"absolute difference), losses {far[n][1]:.3e} (mean absolute difference, last {last} steps)"
        )
    if SR in far:
        closer = far[SR][0] < far[NEAREST][0]
        print(
            "measured here: stochastic rounding kept the bfloat16 model "
            + ("closer to" if closer else "no closer to")
            + " float32 AdamW's than nearest rounding did "
            f"(parameters {far[SR][0]:.3e} vs {far[NEAREST][0]:.3e}; "
            f"losses {far[SR][1]:.3e} vs {far[NEAREST][1]:.3e})"
        )
    status = 0
    for n in names[:-1]:
        m, opt, _ = runs[n]
        where = one_step_check(n, m, opt, hyper)
        truth = {NEAREST: "torch's for-loop on the bfloat16 model", FP32_STATE: "torch's for-loop"}.get(
            n, "its composition with torch's for-loop"
        )
        if where is None:
            print(f"{n}: a step is bitwise equal to {truth} (parameters and state)")
        else:
            print(f"MISMATCH: {n}: a step differs from {truth} ({where})")
            status = 1
    return status
