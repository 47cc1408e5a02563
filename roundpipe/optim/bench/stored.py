"""``--dtype bfloat16|float16`` and ``--state-dtype bfloat16|float16``: the 16-bit layouts of
``roundpipe.optim.storage`` (docs/low-precision.md), and ``--fused [float32|bfloat16|float16]``,
timed against torch's paths on the same values, each checked first.

* ``--dtype``: 16-bit parameters, gradients and state, stepped as they are. Configurations:
  ``roundpipe`` (the default backend), ``torch for-loop`` (``foreach=False``: its ops round to the
  dtype one by one; the ground truth, which roundpipe must equal bit for bit) and ``torch fused``
  (``fused=True`` where torch has a CPU kernel: the whole update in float32, rounded once; a
  different result, named so, never the ground truth: the check counts the elements where it
  differs from the for-loop).
* ``--state-dtype``: fp32 parameters with 16-bit state (``state_dtype=``). Configurations:
  ``roundpipe <dtype> state``, ``roundpipe fp32 state`` and ``torch fused fp32`` (where torch has
  one, else its for-loop). The first is checked against its definition, torch's for-loop on the
  same fp32 parameters with the state rounded to the dtype before and after each step, bit for
  bit.

* ``--fused``: ``fused=True`` on both sides, on parameters of the dtype. Configurations:
  ``roundpipe fused=True`` (the default backend) and ``torch fused=True`` (its CPU kernel: the
  ground truth, checked bit for bit). Where the installed torch's 16-bit kernel is known wrong
  (``fused_kernels.KNOWN_WRONG``), it is timed but not checked against, and the row says so.

Each row shows the state bytes per parameter element of every configuration (measured after
the checked steps) and the bytes a one-pass step moves per element (``stored_bytes``).
"""

from __future__ import annotations

import torch

from roundpipe import optim as rp_optim
from roundpipe.optim import backends as rp_backends
from roundpipe.optim import fused_kernels
from roundpipe.optim.spec import SPECS

from .report import fmt_ms, header, row_json, table_lines
from .report import to_json as report_json
from .timing import Row, bench_one, log, state_bytes
from .traffic import bytes_per_element
from .workloads import OPTIONS, is_staged, spec_of, state_mismatch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FUSED_DTYPES = {"float32": torch.float32, **DTYPES}
FUSED_OPTIMIZERS = tuple(n for n, s in SPECS.items() if getattr(s, "fused_kernel", False))
WORKLOADS = ("large", "small", "transformer")
STEPS_CHECKED = 2
RP, LOOP, FUSED = "roundpipe", "torch for-loop", "torch fused (fp32, 1 rounding)"  # --dtype
RP_FP32, FUSED_FP32, LOOP_FP32 = "roundpipe fp32 state", "torch fused fp32", "torch for-loop fp32"
RP_FUSED, TORCH_FUSED = "roundpipe fused=True", "torch fused=True"  # --fused
NOT_CHECKED = "not checked (timed)"


def configs(mode: str, dtype_name: str, fused: bool) -> tuple:
    """The configurations of ``mode`` (``"dtype"`` or ``"state_dtype"``), roundpipe's first."""
    if mode == "dtype":
        return (RP, LOOP, *([FUSED] if fused else []))
    if mode == "fused":
        return (RP_FUSED, TORCH_FUSED)
    return (f"roundpipe {dtype_name} state", RP_FP32, FUSED_FP32 if fused else LOOP_FP32)


def check_args(p, args):
    """What the two modes refuse (``p.error`` exits)."""
    flag = "--fused" if args.fused else "--dtype" if args.dtype else "--state-dtype"
    others = [w for w in args.workloads if w not in WORKLOADS]
    if others:
        p.error(f"{flag} times {', '.join(WORKLOADS)}, not {', '.join(others)}")
    if args.backends != [rp_backends.DEFAULT]:
        p.error(f"{flag} times the default backend ({rp_backends.DEFAULT}): drop --backends")
    if args.plot:
        p.error(f"--plot draws the normal mode's times; {flag} has its own table")
    staged = [n for n in args.optimizers if is_staged(n)]
    if staged:
        p.error(f"{flag} times the elementwise optimizers, not {', '.join(staged)}")
    unfused = [n for n in args.optimizers if args.fused and n not in FUSED_OPTIMIZERS]
    if unfused:
        p.error(
            f"--fused times the optimizers torch has a fused CPU kernel for ({', '.join(FUSED_OPTIMIZERS)})"
        )


def make(mode, dtype, config, name, base_params, base_grads):
    """A configuration's optimizer over fresh copies of the inputs (16-bit ones for ``--dtype``)."""
    cast = torch.float32 if mode == "state_dtype" else dtype
    params = []
    for p, g in zip(base_params, base_grads, strict=True):
        q = torch.nn.Parameter(p.to(cast, copy=True))
        q.grad = g.to(cast, copy=True)
        params.append(q)
    kwargs = OPTIONS[name]
    torch_class = spec_of(name).torch_class
    if config in (LOOP, LOOP_FP32):
        return torch_class(params, foreach=False, **kwargs)
    if config in (FUSED, FUSED_FP32, TORCH_FUSED):
        return torch_class(params, fused=True, **kwargs)
    if config == RP_FUSED:
        return getattr(rp_optim, name)(params, backend=rp_backends.DEFAULT, fused=True, **kwargs)
    stored = {} if config in (RP, RP_FP32) else {"state_dtype": dtype}
    return getattr(rp_optim, name)(params, backend=rp_backends.DEFAULT, **stored, **kwargs)


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _rounded_state(name, opt, dtype):
    """torch's state with every tensor but the 0-d ``step`` kind rounded to ``dtype`` in place."""
    with torch.no_grad():
        for st in opt.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and k not in SPECS[name].scalar_state:
                    v.copy_(v.to(dtype))


def check(mode, dtype, dtype_name, name, base_params, base_grads, fused) -> tuple:
    """``(verdict, note, state bytes per element by config)``: None if roundpipe equals its
    ground truth bit for bit after ``STEPS_CHECKED`` steps (``--dtype``: torch's for-loop on the
    same 16-bit tensors; ``--state-dtype``: the composition), else the first difference;
    ``note``: how far ``torch fused`` on 16-bit tensors is from the for-loop."""
    numel = max(sum(p.numel() for p in base_params), 1)
    names = configs(mode, dtype_name, fused)
    if mode == "fused":
        return _check_fused(dtype, name, base_params, base_grads, numel)
    truth = LOOP if mode == "dtype" else LOOP_FP32
    opts = {c: make(mode, dtype, c, name, base_params, base_grads) for c in (*names, truth)}
    try:
        for _ in range(STEPS_CHECKED):
            for c, opt in opts.items():
                if c == truth and mode == "state_dtype":
                    _rounded_state(name, opt, dtype)
                opt.step()
                if c == truth and mode == "state_dtype":
                    _rounded_state(name, opt, dtype)
        ours, theirs = opts[names[0]], opts[truth]
        ref_state = theirs.state
        if mode == "state_dtype":  # (its values are the dtype's: compared in it)
            ref_state = {
                p: {
                    k: v.to(dtype) if k not in SPECS[name].scalar_state and isinstance(v, torch.Tensor) else v
                    for k, v in st.items()
                }
                for p, st in theirs.state.items()
            }
        verdict = state_mismatch(ours.state, _params(ours), ref_state, _params(theirs), True)
    except Exception as e:  # roundpipe's step failing
        verdict = f"{type(e).__name__}: {e}".strip()
    note = None
    if mode == "dtype" and fused:
        a = torch.cat([p.detach().reshape(-1) for p in _params(opts[FUSED])])
        b = torch.cat([p.detach().reshape(-1) for p in _params(opts[LOOP])])
        differ = int((a.view(torch.int16) != b.view(torch.int16)).sum())
        note = f"torch fused differs from the for-loop in {differ:,} of {a.numel():,} parameter elements"
    nbytes = {c: state_bytes(opts[c].state) / numel for c in names}
    return verdict, note, nbytes


def _check_fused(dtype, name, base_params, base_grads, numel) -> tuple:
    """``check`` of ``--fused``: roundpipe's fused step against torch's after ``STEPS_CHECKED``
    steps, parameters and state bit for bit; a known-wrong torch kernel is timed, not checked
    against."""
    opts = [make("fused", dtype, c, name, base_params, base_grads) for c in (RP_FUSED, TORCH_FUSED)]
    try:
        for _ in range(STEPS_CHECKED):
            for opt in opts:
                opt.step()
    except Exception as e:
        return f"{type(e).__name__}: {e}".strip(), None, {}
    nbytes = {c: state_bytes(o.state) / numel for c, o in zip((RP_FUSED, TORCH_FUSED), opts, strict=True)}
    if fused_kernels.known_wrong(name, dtype):
        return None, f"{NOT_CHECKED}: torch {torch.__version__}'s {dtype} kernel is known wrong", nbytes
    verdict, note = _fused_mismatch(*opts)
    return verdict, note, nbytes


def _fused_mismatch(ours, theirs) -> tuple:
    """``(verdict, note)``: None if parameters and state are torch's bit for bit."""
    ref_state = {p: {k: v for k, v in st.items() if k != "step"} for p, st in theirs.state.items()}
    return state_mismatch(ours.state, _params(ours), ref_state, _params(theirs), True), None


def stored_bytes(name: str, mode: str, dtype) -> int:
    """The bytes a one-pass step of ``name`` moves per element (``traffic``): each tensor it
    reads and each it writes, at 2 bytes a 16-bit one."""
    _, read, written = bytes_per_element(name)
    low = dtype.itemsize

    def size(t):
        return low if mode != "state_dtype" or t not in ("param", "grad") else 4

    return sum(size(t) for t in (*read, *written))


def bench_row(mode, name, dtype_name, fused, base_params, base_grads, warmup, repeats, wl, before=None):
    """The check, then the configurations timed by ``bench_one``."""
    dtype = FUSED_DTYPES[dtype_name]
    verdict, note, nbytes = check(mode, dtype, dtype_name, name, base_params, base_grads, fused)
    if verdict is not None:
        log(f"  [{wl}] {name}: MISMATCH with its ground truth: {verdict}")
    names = configs(mode, dtype_name, fused)

    def build(config):
        return make(mode, dtype, config, name, base_params, base_grads)

    row = bench_one(name, names, base_params, base_grads, warmup, repeats, wl, make=build, before=before)
    row.checks[names[0]] = verdict
    row.fused_note = note
    row.state_bytes_by_config = nbytes
    return row


# ---------------------------------------------------------------------------------------------
# the report


def derived(row: Row, meta: dict) -> dict:
    mode, dtype_name = meta["stored"]
    names = configs(mode, dtype_name, meta["fused_available"][row.optimizer])
    ms = row.median_ms
    ok = row.checks.get(names[0]) is None
    ours = ms.get(names[0])
    return {
        "mode": mode,
        "dtype": dtype_name,
        "configs": list(names),
        "bytes_per_element": stored_bytes(row.optimizer, mode, FUSED_DTYPES[dtype_name]),
        "state_bytes_per_element_by_config": row.state_bytes_by_config,
        "speedups": {c: ms[c] / ours for c in names[1:] if ok and ours and ms.get(c)},
        "bit_for_bit": ok,
        "fused_note": row.fused_note,
    }


def _speedup(d: dict, config: str) -> str:
    if not d["bit_for_bit"]:
        return "MISMATCH"
    return f"{d['speedups'][config]:.2f}x" if config in d["speedups"] else "n/a"


def _columns(mode: str, dtype_name: str) -> tuple:
    """A table's time columns (each row's configuration in it: ``_cell``)."""
    if mode == "dtype":
        return (RP, LOOP, FUSED)
    if mode == "fused":
        return (RP_FUSED, TORCH_FUSED)
    return (f"roundpipe {dtype_name} state", RP_FP32, "torch fp32")


def _config_in(row: Row, d: dict, column: str) -> str | None:
    """The row's configuration in ``column`` (None: torch has none, no fused kernel)."""
    if column == "torch fp32":  # torch's fused step where it has one, else its for-loop
        return d["configs"][2]
    return column if column in d["configs"] else None


def format_table(wl: str, res: dict, meta: dict) -> str:
    mode, dtype_name = meta["stored"]
    columns = _columns(mode, dtype_name)
    lines, verdicts = [], []
    for row in res["rows"]:
        d = derived(row, meta)
        found = [_config_in(row, d, c) for c in columns]
        cells = [
            "n/a" if c is None else "ERROR" if c in row.errors else fmt_ms(row.median_ms.get(c))
            for c in found
        ]
        if mode == "state_dtype":
            cells[2] += " (fused)" if found[2] == FUSED_FP32 else " (for-loop)"
        speedups = ["n/a" if c is None else _speedup(d, c) for c in found[1:]]
        nbytes = d["state_bytes_per_element_by_config"]
        state = " / ".join("n/a" if c is None else f"{nbytes[c]:.2f}" for c in found)
        lines.append([row.optimizer, *cells, *speedups, state, str(d["bytes_per_element"])])
        note = d["fused_note"] or ""
        if not d["bit_for_bit"]:
            verdict = f"MISMATCH: {row.checks[found[0]]}"
        else:
            verdict = "" if note.startswith(NOT_CHECKED) else "equal"
        verdicts.append(f"  {row.optimizer}: " + "; ".join(x for x in (verdict, note) if x))
    what = {
        "dtype": f"{dtype_name} parameters, gradients and state, stepped as they are",
        "fused": f"fused=True on {dtype_name} parameters",
        "state_dtype": f"fp32 parameters and gradients, {dtype_name} state (state_dtype=torch.{dtype_name})",
    }[mode]
    truth = {
        "dtype": "torch's for-loop on them",
        "fused": "torch's fused kernel",
        "state_dtype": "the composition with torch's for-loop",
    }[mode]
    head = ["optimizer", *columns, *[f"vs {n}" for n in columns[1:]]]
    head += ["state B/param (" + " / ".join(columns) + ")", "B/elem"]
    return "\n".join(
        [
            f"workload {wl}: {res['description']}; {res['tensors']} tensors, {res['numel']:,} elements",
            f"median ms per step, {what} (vs: that column's time / roundpipe's):",
            *(table_lines(head, lines) if lines else []),
            f"bit for bit, {columns[0]} vs {truth} after {STEPS_CHECKED} steps:",
            *verdicts,
        ]
    )


def report(result: dict) -> str:
    mode, dtype_name = result["meta"]["stored"]
    if mode == "fused":
        checked = (
            f"checked before timing: roundpipe's fused=True against torch's fused kernel on the same "
            f"{dtype_name} parameters, {STEPS_CHECKED} steps, parameters and every state tensor bit for bit"
        )
    elif mode == "dtype":
        checked = (
            f"checked before timing: roundpipe against torch's for-loop on the same {dtype_name} tensors "
            f"(the ground truth; torch fused computes in float32 and rounds once: another result, not "
            f"checked against), {STEPS_CHECKED} steps, parameters and every state tensor bit for bit"
        )
    else:
        checked = (
            f"checked before timing: roundpipe with {dtype_name} state against torch's for-loop on the "
            f"same fp32 parameters, its state rounded to {dtype_name} before and after each step, "
            f"{STEPS_CHECKED} steps, parameters and every state tensor bit for bit"
        )
    legend = (
        "state B/param: the optimizer state's bytes per parameter element after the checked steps "
        "(0-d step tensors included); B/elem: bytes a one-pass step must read and write per element "
        f"(from its spec program; {dtype_name} tensors at 2 bytes)"
    )
    out = header(result, checked, legend)
    for wl, res in result["workloads"].items():
        out += ["", format_table(wl, res, result["meta"])]
    failures = failures_of(result)
    if failures:
        out += ["", "FAILURES (errors, or roundpipe not equal to its ground truth):"]
        out += [f"  {f}" for f in failures]
    return "\n".join(out)


def failures_of(result: dict) -> list[str]:
    out = []
    for wl, res in result["workloads"].items():
        for row in res["rows"]:
            out += [f"{wl} {row.optimizer} {c}: {e}" for c, e in row.errors.items()]
            out += [f"{wl} {row.optimizer} {c}: {e}" for c, e in row.checks.items() if e]
    return out


def to_json(result: dict) -> dict:
    return report_json(result, None, lambda row: {**row_json(row, str), **derived(row, result["meta"])})
