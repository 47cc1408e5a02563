"""``--optimizers AdamW8bit`` (and ``Adam8bit``): roundpipe's 8-bit optimizers side by side with
torch's fused fp32 step, bitsandbytes' 8-bit CPU step and torchao's, in one run.

Columns, for each workload: roundpipe's ``--backends`` (the default, ``fast``, first), ``torch
fused`` (``torch.optim.AdamW(fused=True)``: fp32 state, what an 8-bit optimizer replaces),
``bitsandbytes`` (``bitsandbytes.optim.AdamW8bit`` on the CPU) and ``torchao``
(``torchao.optim.AdamW8bit``), made by ``eightbit_columns`` (which alone imports bitsandbytes and
torchao, inside functions): a column whose package is not installed says so, and the run goes on
without it (roundpipe itself never imports either). Every configuration starts from the same seeded
parameters and gradients and runs torch's, bitsandbytes' and torchao's defaults.

Per column: the median step time (``timing``'s round robin), roundpipe's speedup against it,
the bytes a step must move per element and the bandwidth bound they give, the state's bytes per
parameter and the peak memory a steady-state step adds per parameter (``eightbit_memory``: a
subprocess per column). Before the tables, each roundpipe backend steps twice beside
bitsandbytes from the same inputs and must leave parameters and every state entry equal bit for
bit (a mismatch makes the exit status 1); without bitsandbytes the check says it did not run.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field

import torch

from roundpipe.optim.spec.eightbit import MIN_8BIT_SIZE

from . import eightbit_memory
from .eightbit_columns import BNB, FUSED, THIRD_PARTY, TORCHAO, make, third_party
from .report import fmt_bytes, fmt_ms, table_lines
from .timing import Row, log, measure_bandwidth, round_robin, summarize_bandwidth
from .workloads import PER_PARAM_PARTS, Workload, bits_mismatch, clone_params, make_workload
from .workloads import workload_parts as _normal_parts

LARGE_NUMEL = 4 * 2**20  # ``large`` for these rows: 4 x 4M, quick or not (the size)
# torchao compiles its step once per distinct shape (torch.compile, dynamic=False): on a
# workload of many shapes (``small``: about a thousand) that is minutes of compiling
TORCHAO_MAX_SHAPES = 16

# Bytes a steady-state step moves per element: an 8-bit Adam reads and writes the parameter (8),
# reads the gradient (4) and reads and writes two 1-byte moments (4); the absmax per 256
# elements (under 0.07 bytes) is left out. A tensor under min_8bit_size (bitsandbytes'; torchao's
# threshold is the same, and it also wants whole blocks) keeps fp32 state, as fp32 Adam: 28.
EIGHT_BIT_BYTES, FP32_BYTES = 16, 28


def workload_parts(name: str, quick: bool) -> list[Workload]:
    """The workloads ``--workloads name`` runs for the 8-bit rows: ``large`` is 4 x 4M (the size
    the issue measured) in both modes; ``small`` and ``transformer`` as for the others;
    ``per_param`` none (one optimizer per tensor: not timed for these rows)."""
    if name in ("per_param", *PER_PARAM_PARTS):
        return []
    if name == "large":
        desc = f"4 tensors of {LARGE_NUMEL // 2**20}M fp32 ({LARGE_NUMEL * 4 // 2**20} MiB each)"
        return [Workload("large", desc, ((LARGE_NUMEL,),) * 4)]
    return _normal_parts(name, quick)


def step_bytes(config: str, shapes) -> float:
    """Bytes per element a steady-state step of ``config`` must move over tensors of
    ``shapes`` (``EIGHT_BIT_BYTES`` where the tensor has 8-bit state, else ``FP32_BYTES``),
    weighted by the elements."""
    total = numel = 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        eight = n >= MIN_8BIT_SIZE and (config != TORCHAO or n % 256 == 0) and config != FUSED
        total, numel = total + n * (EIGHT_BIT_BYTES if eight else FP32_BYTES), numel + n
    per = total / numel if numel else 0.0
    return int(per) if per == int(per) else round(per, 2)


def state_bytes(state) -> int:
    """Bytes of every tensor in an optimizer's ``state``, each storage once (bitsandbytes and
    roundpipe share one codebook between parameters), a torchao 8-bit state by its inner tensors
    (codes and scales; the subclass reports itself as float32)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
            for inner in t.__tensor_flatten__()[0]:
                add(getattr(t, inner))
            return
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]

    for per_param in state.values():
        for v in per_param.values():
            if isinstance(v, torch.Tensor):
                add(v)
    return total


@dataclass
class Column:
    """One column of a workload's 8-bit table."""

    bytes_per_element: float
    median_ms: float | None = None
    samples_ms: list = field(default_factory=list)
    state_bytes_per_param: float | None = None
    peak_extra_per_param: float | None = None
    peak_note: str | None = None  # why there is no peak (or what limits it)
    error: str | None = None  # the column failed, or its package is missing ("not installed")


@dataclass
class EightRow:
    optimizer: str
    numel: int
    tensors: int
    columns: dict  # config -> Column
    checks: dict = field(default_factory=dict)  # backend -> None (bit for bit) or the mismatch
    check_skipped: str | None = None  # why nothing was checked (bitsandbytes missing)


def configs_of(backends) -> list[str]:
    return ["rp " + b for b in backends] + [FUSED, BNB, TORCHAO]


def label(config: str) -> str:
    return config.removeprefix("rp ")


def check(name: str, backend: str, base_params, base_grads, steps: int = 2) -> str | None:
    """None if roundpipe's ``name`` on ``backend`` and bitsandbytes' leave parameters and every
    state entry equal bit for bit after ``steps`` steps from the same inputs, else where they
    first differ."""
    ours_params = clone_params(base_params, base_grads)
    their_params = clone_params(base_params, base_grads)
    try:
        ours = make("rp " + backend, name, ours_params)
        theirs = make(BNB, name, their_params)
        for _ in range(steps):
            ours.step()
            theirs.step()
    except Exception as e:  # noqa: BLE001 - the failure is the check's result
        return f"{type(e).__name__}: {e}"
    for i, (q, p) in enumerate(zip(ours_params, their_params, strict=True)):
        why = bits_mismatch(q.detach(), p.detach())
        if why:
            return f"param {i}: {why}"
        st_q, st_p = ours.state[q], theirs.state[p]
        if set(st_q) != set(st_p):
            return f"param {i}: state keys {sorted(st_q)} != bitsandbytes' {sorted(st_p)}"
        for key, v in st_p.items():
            why = bits_mismatch(st_q[key], v) if torch.is_tensor(v) else (None if st_q[key] == v else "")
            if why is not None:
                return f"param {i}: state {key!r}: {why or f'{st_q[key]!r} vs {v!r}'}"
    return None


def bench_workload(name, backends, wl, warmup, repeats, threads, before=None) -> EightRow:
    """Optimizer ``name``'s row on workload ``wl``: every column timed, its state and its peak
    memory measured, each roundpipe backend checked against bitsandbytes."""
    base_params, base_grads = make_workload(wl)
    shapes = [tuple(p.shape) for p in base_params]
    numel = sum(p.numel() for p in base_params)
    columns = {c: Column(step_bytes(c, shapes)) for c in configs_of(backends)}
    for c in THIRD_PARTY:
        columns[c].error = third_party(c)[1]
    if columns[TORCHAO].error is None and len(set(shapes)) > TORCHAO_MAX_SHAPES:
        many = len(set(shapes))
        columns[TORCHAO].error = f"not timed: torchao compiles its step once per distinct shape ({many} here)"
    timed = [c for c, col in columns.items() if col.error is None]
    made: dict = {}

    def make_one(config):
        made[config] = make(config, name, clone_params(base_params, base_grads))
        return made[config]

    row = Row(name, EIGHT_BIT_BYTES, (), (), numel, tensors=len(shapes))
    round_robin(row, name, timed, make_one, warmup, repeats, wl.name, before, None)
    for c in timed:
        col = columns[c]
        col.error = row.errors.get(c)
        if c in row.median_ms:
            col.median_ms, col.samples_ms = row.median_ms[c], row.samples_ms[c]
            col.state_bytes_per_param = state_bytes(made[c].state) / max(numel, 1)
    made.clear()
    gc.collect()
    out = EightRow(name, numel, len(shapes), columns)
    if columns[BNB].error is None:
        for b in backends:
            out.checks[b] = check(name, b, base_params, base_grads)
            if out.checks[b]:
                log(f"  [{wl.name}] {name} {b}: MISMATCH with bitsandbytes: {out.checks[b]}")
    else:
        out.check_skipped = f"bitsandbytes {columns[BNB].error}"
    for c in timed:
        if columns[c].median_ms is not None:
            peak, note = eightbit_memory.measure(c, name, shapes, threads)
            columns[c].peak_extra_per_param = None if peak is None else peak / max(numel, 1)
            columns[c].peak_note = note
    return out


def run(args, names, meta: dict, before=None) -> dict:
    """The 8-bit rows of a run: ``names`` (of ``OPTIMIZERS``) on ``args.workloads``, with the
    bandwidth measured in the same run (before and after, the higher median is the ceiling)."""
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    bw_numel = (32 if args.quick else 64) * 2**20
    bw_repeats = 5 if args.quick else 9
    threads = torch.get_num_threads()
    log(f"8-bit rows: {', '.join(names)}; warm-up {warmup}, repetitions {repeats}, threads {threads}")
    samples = measure_bandwidth(bw_numel, bw_repeats)
    t0 = time.perf_counter()
    parts = [w for n in args.workloads for w in workload_parts(n, args.quick)]
    skipped = [n for n in args.workloads if not workload_parts(n, args.quick)]
    if skipped:
        log(f"8-bit rows: {', '.join(skipped)} not timed (one optimizer per tensor: not for these rows)")
    parts = [w for k, w in enumerate(parts) if w.name not in {v.name for v in parts[:k]}]
    workloads = {}
    for wl in parts:
        rows = []
        for name in names:
            log(f"[{wl.name}] {name}: {wl.description}")
            row = bench_workload(name, args.backends, wl, warmup, repeats, threads, before)
            times = ", ".join(
                f"{label(c)} {fmt_ms(col.median_ms)}" for c, col in row.columns.items() if col.median_ms
            )
            log(f"  [{wl.name}] {name}: {times} ms")
            rows.append(row)
        workloads[wl.name] = {"description": wl.description, "rows": rows}
    more = measure_bandwidth(bw_numel, bw_repeats)
    bandwidth = summarize_bandwidth({op: samples[op] + more[op] for op in samples}, bw_numel)
    versions = {c: _version(c) for c in THIRD_PARTY}
    meta = {**meta, "warmup": warmup, "repeats": repeats, "elapsed_s": time.perf_counter() - t0}
    meta.update(busy=args.busy, load_average_before=getattr(args, "load_before", None))
    return {"meta": meta, "versions": versions, "bandwidth": bandwidth, "workloads": workloads}


def _version(column: str) -> str:
    module, why = third_party(column)
    if module is None:
        return why
    return getattr(sys.modules[THIRD_PARTY[column]], "__version__", "unknown version")  # imported above


# ---------------------------------------------------------------------------------------------
# the report


def _speedup(rp: Column, other: Column) -> str:
    if rp.median_ms is None or other.median_ms is None:
        return "n/a"
    return f"{other.median_ms / rp.median_ms:.2f}x"


def _per_param(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _short(error: str) -> str:
    """A failed or missing column's cell (``errors_of`` gives the whole reason below the table)."""
    return error if error == "not installed" else "not timed" if error.startswith("not timed") else "ERROR"


def format_row(row: EightRow, backends, gbps: float) -> list[str]:
    """A row's table: one line per column, then the reasons of the columns without times."""
    rp = ["rp " + b for b in backends]
    head = ["column", "median ms", "B/elem", "bw-bound ms", "% bw", "state B/param"]
    head += ["peak extra MiB", "peak extra B/param", *[f"roundpipe {label(c)} speedup" for c in rp]]
    lines, notes = [], []
    for c, col in row.columns.items():
        bound = col.bytes_per_element * row.numel / (gbps * 1e9) * 1e3
        name = f"roundpipe {label(c)}" if c in rp else c
        if col.error is not None:
            cells = [_short(col.error)] + [""] * (len(head) - 2)
            if cells[0] != col.error:
                notes.append(f"  {name}: {col.error}")
        else:
            pct = f"{100 * bound / col.median_ms:.0f}%" if col.median_ms else "n/a"
            peak = col.peak_extra_per_param
            cells = [fmt_ms(col.median_ms), fmt_bytes(col.bytes_per_element), fmt_ms(bound), pct]
            cells += [_per_param(col.state_bytes_per_param)]
            cells += ["n/a" if peak is None else f"{peak * row.numel / 2**20:.1f}", _per_param(peak)]
            cells += [_speedup(row.columns[r], col) for r in rp]
            if col.peak_note:
                notes.append(f"  {name}: no peak: {col.peak_note}")
        lines.append([name, *cells])
    return table_lines(head, lines) + notes


def check_text(row: EightRow) -> str:
    if row.check_skipped:
        return f"not checked against bitsandbytes ({row.check_skipped})"
    parts = [f"{b} {'MISMATCH: ' + why if why else 'bit for bit'}" for b, why in row.checks.items()]
    return "against bitsandbytes (2 steps, parameters and every state entry): " + "; ".join(parts)


def report(result: dict, backends) -> str:
    meta, bw, versions = result["meta"], result["bandwidth"], result["versions"]
    gbps, load = bw["ceiling_GBps"], meta.get("load_average_before")
    out = [
        "8-bit optimizers: roundpipe against torch's fused fp32 step, bitsandbytes' and torchao's "
        f"8-bit steps on the CPU (bitsandbytes: {versions[BNB]}; torchao: {versions[TORCHAO]})",
        f"threads: torch {meta['torch_threads']}, cpus {meta['cpu_count']}; median of {meta['repeats']} "
        f"round-robin repetitions after {meta['warmup']} warm-up step(s); memory bandwidth ceiling "
        f"{gbps:.1f} GB/s (in-place mul_ and copy_, before and after the rows); busy processes "
        f"{meta['busy']}" + (f"; load average before the run {load[0]:.2f}" if load else ""),
        f"B/elem: bytes a step must move per element: {EIGHT_BIT_BYTES} for 8-bit state (param read+write "
        f"8, grad 4, two 1-byte moments read+written 4; absmax left out), {FP32_BYTES} for fp32 state "
        f"(torch fused, and bitsandbytes' and torchao's tensors under {MIN_8BIT_SIZE} elements); "
        "bw-bound: B/elem x elements / ceiling",
        "state B/param: the state's bytes after the timed steps (each storage once) / parameters; "
        f"peak extra B/param: {eightbit_memory.METHOD}",
        "(a step's temporaries live one tensor at a time: per element of the largest tensor the peak "
        "is larger by the workload's elements over that tensor's); speedup: that column's median / "
        "roundpipe's (> 1: roundpipe faster)",
    ]
    for wl, res in result["workloads"].items():
        for row in res["rows"]:
            out += ["", f"workload {wl}: {res['description']}; {row.tensors} tensors, {row.numel:,} elements"]
            out += [f"{row.optimizer}: {check_text(row)}", *format_row(row, backends, gbps)]
    fails = failures_of(result)
    if fails:
        out += [
            "",
            "FAILURES (roundpipe errors or mismatches with bitsandbytes):",
            *[f"  {f}" for f in fails],
        ]
    return "\n".join(out)


def failures_of(result: dict) -> list[str]:
    out = []
    for wl, res in result["workloads"].items():
        for row in res["rows"]:
            for c, col in row.columns.items():
                if c.startswith("rp ") and col.error:
                    out.append(f"{wl} {row.optimizer} {label(c)}: {col.error}")
            out += [f"{wl} {row.optimizer} {b}: {why}" for b, why in row.checks.items() if why]
    return out


def to_json(result: dict) -> dict:
    """The 8-bit rows for the JSON document (its ``eightbit`` entry)."""
    workloads = {}
    for wl, res in result["workloads"].items():
        rows = {}
        for row in res["rows"]:
            rows[row.optimizer] = {
                "numel": row.numel,
                "tensors": row.tensors,
                "checks_against_bitsandbytes": {b: why or "ok" for b, why in row.checks.items()},
                "check_skipped": row.check_skipped,
                "columns": {label(c): vars(col) for c, col in row.columns.items()},
            }
        workloads[wl] = {"description": res["description"], "optimizers": rows}
    return {k: v for k, v in result.items() if k != "workloads"} | {"workloads": workloads}
