"""``--partners [bfloat16|float16]``: fp32 masters paired with low-precision partners
(``roundpipe.optim.masters``), the fused step against the composition it stands for.

For each optimizer and workload (``large``, ``small``, ``transformer``), three configurations
step the same values (the partners: the workload's parameters and gradients rounded to the
dtype; the masters: their exact widening, ``fp32_masters``), timed side by side as ``bench_one``
times the normal mode:

* ``composition``: roundpipe's default backend on unpaired masters; a step is
  ``torch._foreach_copy_(master grads, partner grads)`` (widen into preallocated fp32 grads),
  ``opt.step()``, ``torch._foreach_copy_(partners, masters)`` (round back);
* ``fused``: the same masters paired (``pair``), no master grad, the partners' grads set; a step
  is ``opt.step()`` alone (the numba engine widens, steps and rounds back in one pass);
* ``torch composition``: the composition with ``torch.optim.<Name>(fused=True)`` where torch has
  a CPU kernel, else its for-loop.

With ``--amp``, every configuration runs the optimizer phase of a mixed-precision training
step around it (``roundpipe.optim.amp``): with float16 partners loss scaling and clipping, with
bfloat16 clipping (``MAX_NORM``, which clips the workloads' gradients). The compositions
unscale (``GradScaler.unscale_``) and clip (``torch.nn.utils.clip_grad_norm_``) the widened
fp32 gradients in place; ``fused`` runs ``roundpipe.optim.GradScaler`` and
``opt.clip_grad_norm_``, which read the partners' gradients once (the inf check's pass gives the
norm's sums too) and fold the unscale and the clip coefficient into the step.

Before timing, ``check`` steps ``fused`` and ``composition`` twice from the same inputs and
compares the masters, the partners and every state tensor bit for bit. There the composition
clips with the fused run's total norm (``clip_grads_with_norm_``): the numba engine's norm is
torch's to rounding (its own float64 sums), and the check reports how far it is from torch's.
"""

from __future__ import annotations

import torch

from roundpipe.optim import GradScaler
from roundpipe.optim import backends as rp_backends
from roundpipe.optim.masters import fp32_masters, unpair

from .report import fmt_ms, header, row_json, table_lines
from .report import to_json as report_json
from .timing import Row, bench_one, log
from .traffic import partner_bytes
from .workloads import FUSED, LOOP, label, make_optimizer, state_mismatch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
WORKLOADS = ("large", "small", "transformer")  # what --partners times (no one-parameter optimizers)
CONFIGS = ("composition", "fused", "torch composition")
COMPOSITION, PAIRED, TORCH_COMPOSITION = CONFIGS
STEPS_CHECKED = 2
_ONE = torch.ones(())
MAX_NORM = 1.0  # --amp: the clip threshold (the workloads' gradient norms are far above it)
INIT_SCALE = 2.0**10  # --amp with float16: the loss scale the gradients are taken to carry


class Partnered:
    """One configuration's masters, partners (with their gradients), optimizer and step.

    ``torch_path``: torch's configuration (``workloads.FUSED`` or ``LOOP``) for
    ``torch composition``."""

    def __init__(self, config, name, base_params, base_grads, dtype, torch_path=LOOP, amp=False):
        self.partners = [torch.nn.Parameter(p.to(dtype)) for p in base_params]
        for q, g in zip(self.partners, base_grads, strict=True):
            q.grad = g.to(dtype)
        self.partner_grads = [q.grad for q in self.partners]
        self.masters = fp32_masters(self.partners)
        self.grads = None  # the composition's fp32 gradients, widened into each step
        if config != PAIRED:
            for m in self.masters:
                unpair(m)
                m.grad = torch.empty_like(m)
            self.grads = [m.grad for m in self.masters]
        opt_config = torch_path if config == TORCH_COMPOSITION else "rp " + rp_backends.DEFAULT
        self.opt = make_optimizer(opt_config, name, self.masters)
        self.state = self.opt.state
        self.clip = amp
        self.norm = None  # the last step's total norm
        self.clip_with = None  # a callable giving the total norm to clip with (else torch's)
        self.torch_norm = None  # torch's own total norm, where clip_with is set
        self.scaler = None
        if amp and dtype is torch.float16:
            scaler_cls = GradScaler if config == PAIRED else torch.amp.GradScaler
            self.scaler = scaler_cls("cpu", init_scale=INIT_SCALE)

    @torch.no_grad()
    def step(self):
        if self.grads is not None:
            torch._foreach_copy_(self.grads, self.partner_grads)
        if self.scaler is not None:
            self.scaler.scale(_ONE)  # what the loss goes through each step (the scale is lazy)
            self.scaler.unscale_(self.opt)
        if self.clip:
            if self.grads is None:
                self.norm = self.opt.clip_grad_norm_(MAX_NORM)
            elif self.clip_with is None:
                self.norm = torch.nn.utils.clip_grad_norm_(self.masters, MAX_NORM)
            else:
                self.torch_norm = torch.nn.utils.get_total_norm(self.grads)
                self.norm = self.clip_with()
                torch.nn.utils.clip_grads_with_norm_(self.masters, MAX_NORM, self.norm)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        if self.grads is not None:
            torch._foreach_copy_(self.partners, self.masters)


def check(name, dtype, base_params, base_grads, steps: int = STEPS_CHECKED, amp=False) -> str | None:
    """``(verdict, norm difference)``: None if ``fused`` equals ``composition`` bit for bit
    after ``steps`` steps (masters, partners, every state tensor), else the first difference
    (or the error); with ``amp``, the largest relative difference of fused's total norm from
    torch's ``get_total_norm`` over those steps (the composition clips with fused's)."""
    worst = None
    try:
        fused = Partnered(PAIRED, name, base_params, base_grads, dtype, amp=amp)
        composed = Partnered(COMPOSITION, name, base_params, base_grads, dtype, amp=amp)
        composed.clip_with = lambda: fused.norm
        for _ in range(steps):
            fused.step()
            composed.step()
            if amp:
                theirs = composed.torch_norm.item()
                diff = abs(fused.norm.item() - theirs) / theirs
                worst = diff if worst is None else max(worst, diff)
        extra = [("partner", fused.partners, composed.partners)]
        verdict = state_mismatch(
            fused.state, fused.masters, composed.state, composed.masters, True, "master", extra
        )
    except Exception as e:  # the fused step failing
        verdict = f"{type(e).__name__}: {e}".strip()
    return verdict, worst


def bench_row(
    name, dtype_name, torch_fused, base_params, base_grads, warmup, repeats, wl, amp=False, before=None
) -> Row:
    """The check (``row.checks["fused"]``), then the three configurations timed by ``bench_one``."""
    dtype = DTYPES[dtype_name]
    verdict, norm_diff = check(name, dtype, base_params, base_grads, amp=amp)
    if verdict is not None:
        log(f"  [{wl}] {name} fused: MISMATCH with the composition: {verdict}")
    path = FUSED if torch_fused else LOOP

    def make(config):
        return Partnered(config, name, base_params, base_grads, dtype, path, amp=amp)

    row = bench_one(name, CONFIGS, base_params, base_grads, warmup, repeats, wl, make=make, before=before)
    row.checks[PAIRED] = verdict
    row.norm_vs_torch = norm_diff
    return row


# ---------------------------------------------------------------------------------------------
# the report


def derived(row: Row, meta: dict) -> dict:
    """Bytes per element of each configuration, the speedup of ``fused`` over ``composition``
    (and over ``torch composition``), the traffic ratio and the check's verdict."""
    nbytes = partner_bytes(row.optimizer, DTYPES[meta["partners"]], meta.get("amp", False))
    ms = row.median_ms
    composed, fused, torch_composed = (ms.get(c) for c in CONFIGS)
    ok = row.checks.get(PAIRED) is None
    return {
        "partners": meta["partners"],
        "torch_path": label(FUSED if meta["fused_available"][row.optimizer] else LOOP),
        "bytes_per_element_by_config": nbytes,
        "traffic_ratio": nbytes[COMPOSITION] / nbytes[PAIRED],
        "speedup_fused_vs_composition": composed / fused if ok and fused and composed else None,
        "speedup_fused_vs_torch_composition": torch_composed / fused
        if ok and fused and torch_composed
        else None,
        "bit_for_bit": ok,
        "norm_relative_difference_vs_torch": row.norm_vs_torch,
    }


def format_table(wl: str, res: dict, meta: dict) -> str:
    dtype = meta["partners"]
    lines, verdicts = [], []
    for row in res["rows"]:
        d = derived(row, meta)
        cells = ["ERROR" if c in row.errors else fmt_ms(row.median_ms.get(c)) for c in CONFIGS]
        cells[2] += f" ({d['torch_path']})"
        speedup = d["speedup_fused_vs_composition"]
        nbytes = d["bytes_per_element_by_config"]
        lines.append(
            [row.optimizer, *cells]
            + ["MISMATCH" if not d["bit_for_bit"] else "n/a" if speedup is None else f"{speedup:.2f}x"]
            + [str(nbytes[COMPOSITION]), str(nbytes[PAIRED]), f"{d['traffic_ratio']:.2f}x"]
        )
        norm_diff = row.norm_vs_torch
        verdicts.append(
            f"  {row.optimizer}: "
            + ("equal" if d["bit_for_bit"] else f"MISMATCH: {row.checks[PAIRED]}")
            + ("" if norm_diff is None else f" (total norm vs torch's get_total_norm: {norm_diff:.1e})")
        )
    head = [
        "optimizer",
        "composition",
        "fused",
        "torch composition",
        "speedup",
        "B/elem comp.",
        "B/elem fused",
    ]
    return "\n".join(
        [
            f"workload {wl}: {res['description']}; {res['tensors']} tensors, {res['numel']:,} elements",
            f"median ms per step, fp32 masters with {dtype} partners{_amp_words(meta)} "
            "(speedup: composition / fused; traffic: composition / fused B/elem):",
            *table_lines([*head, "traffic"], lines),
            f"bit for bit, fused vs composition after {STEPS_CHECKED} steps "
            f"(masters, {dtype} partners, every state tensor"
            + ("; the relative difference of the norm" if meta.get("amp") else "")
            + "):",
            *verdicts,
        ]
    )


def _amp_words(meta) -> str:
    if not meta.get("amp"):
        return ""
    return ", loss scaling and clipping" if meta["partners"] == "float16" else ", clipping"


def report(result: dict) -> str:
    dtype = result["meta"]["partners"]
    low = DTYPES[dtype].itemsize
    checked = (
        f"checked before timing: fused against composition, {STEPS_CHECKED} steps from the same inputs, "
        "masters, partners and every state tensor bit for bit (integer views, NaN by position)"
    )
    legend = (
        "B/elem: bytes a step must read and write per element (from its spec program): fused = the fp32 "
        f"step's with the gradient read at {low} bytes ({dtype}) instead of 4, plus the {low}-byte partner "
        f"write; composition (and torch composition) = the fp32 step's + widen (read {low}, write 4) + "
        f"round back (read 4, write {low})"
    )
    out = header(result, checked, legend)
    for wl, res in result["workloads"].items():
        out += ["", format_table(wl, res, result["meta"])]
    failures = failures_of(result)
    if failures:
        out += ["", "FAILURES (errors, or fused not equal to the composition):"]
        out += [f"  {f}" for f in failures]
    return "\n".join(out)


def failures_of(result: dict) -> list[str]:
    out = []
    for wl, res in result["workloads"].items():
        for row in res["rows"]:
            out += [f"{wl} {row.optimizer} {c}: {e}" for c, e in row.errors.items()]
            if row.checks.get(PAIRED):
                out.append(f"{wl} {row.optimizer} fused vs composition: {row.checks[PAIRED]}")
    return out


def to_json(result: dict) -> dict:
    """``report.to_json`` with this mode's rows: configurations by their names, ``derived``."""
    return report_json(result, None, lambda row: {**row_json(row, str), **derived(row, result["meta"])})
