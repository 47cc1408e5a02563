"""Reporting: the tables (median ms per step, ratios between medians), the failures, the JSON
document and the chart."""

from __future__ import annotations

import numpy as np

from roundpipe.optim import backends as rp_backends

from .timing import Row
from .workloads import (
    FOREACH,
    FUSED,
    LOOP,
    OPTIONS,
    SUMMARY_WORKLOADS,
    TORCH_CONFIGS,
    fastest_torch,
    in_summary,
    is_staged,
    label,
)


def configs_of(backends, per_param: bool = False) -> list[str]:
    """Every column, in order: the roundpipe backends (as given: the default, ``fast``, first),
    then torch's paths (no foreach for one-parameter optimizers)."""
    torch_configs = [LOOP, FUSED] if per_param else list(TORCH_CONFIGS)
    return ["rp " + b for b in backends] + torch_configs


def bound_ms(row: Row, gbps: float) -> float:
    return row.bytes_per_element * row.numel / (gbps * 1e9) * 1e3


def derived(row: Row, backends, gbps: float) -> dict:
    """Per column: speedup over torch's for-loop and over torch fused, fraction of the bound,
    and for one-parameter optimizers the time per ``step()`` call."""
    out = {"bound_ms": bound_ms(row, gbps)}
    loop, fused = row.median_ms.get(LOOP), row.median_ms.get(FUSED)
    for config in configs_of(backends, row.per_param):
        ms = row.median_ms.get(config)
        if ms is None:
            continue
        d = {
            "median_ms": ms,
            "speedup_vs_for_loop": loop / ms if loop else None,
            "speedup_vs_fused": fused / ms if fused else None,
            "fraction_of_bandwidth_limit": out["bound_ms"] / ms,
        }
        if row.per_param:
            d["us_per_step_call"] = ms * 1e3 / row.tensors
        if config.startswith("rp "):
            d["matches_torch"] = row.checks.get(label(config)) is None
        out[label(config)] = d
    return out


def fmt_ms(v):
    return "n/a" if v is None else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def fmt_bytes(v):
    """Bytes per element: an int as it is, else two decimals (``n/a`` for None)."""
    return "n/a" if v is None else str(v) if v == int(v) else f"{v:.2f}"


def table_lines(header, lines, left: int = 1) -> list[str]:
    """The lines of a table: its first ``left`` columns (names) flush left, the rest right."""
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]

    def fmt(cells):
        pairs = zip(cells, widths, strict=True)
        return " | ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(pairs))

    return [fmt(header), "-+-".join("-" * w for w in widths), *[fmt(c) for c in lines]]


def _cell(row: Row, d: dict, config: str, key: str) -> str:
    if config in row.errors:
        return "ERROR"
    if config.startswith("rp ") and row.checks.get(label(config)):
        return "MISMATCH"
    v = d.get(label(config), {}).get(key)
    if v is None:
        return "n/a"
    if key == "fraction_of_bandwidth_limit":
        return f"{100 * v:.0f}%"
    if key == "us_per_step_call":
        return f"{v:.1f}"
    return f"{v:.2f}x"


def format_tables(wl: str, res: dict, backends, gbps: float) -> str:
    """The workload's tables: median ms per step of every column, then ratios between medians."""
    per_param = res.get("per_param", False)
    configs = configs_of(backends, per_param)
    rp = [c for c in configs if c.startswith("rp ")]
    rows = res["rows"]
    ds = [derived(row, backends, gbps) for row in rows]
    times = [
        [row.optimizer, fmt_bytes(row.bytes_per_element), fmt_bytes(row.state_bytes_per_element)]
        + [fmt_ms(d["bound_ms"])]
        + [fmt_ms(row.median_ms.get(c)) for c in configs]
        for row, d in zip(rows, ds, strict=True)
    ]
    out = [
        f"workload {wl}: {res['description']}; {res['tensors']} tensors, {res['numel']:,} elements",
        *[f"  {name}: {note}" for name, note in res.get("notes", {}).items()],
        "median ms per step" + (f" ({res['tensors']} step() calls each):" if per_param else ":"),
        *table_lines(["optimizer", "B/elem", "state B/el", "bw-bound"] + [label(c) for c in configs], times),
    ]
    sections = []
    if per_param:
        sections.append(
            (
                f"us per step() call (median / {res['tensors']} calls):",
                "us_per_step_call",
                configs,
            )
        )
    sections += [
        (
            "speedup over torch for-loop (for-loop median / median):",
            "speedup_vs_for_loop",
            [c for c in configs if c != LOOP],
        ),
        ("speedup over torch fused (fused median / median):", "speedup_vs_fused", rp),
        ("% of the bandwidth bound (bw-bound / median):", "fraction_of_bandwidth_limit", [*rp, FUSED]),
    ]
    for title, key, columns in sections:
        lines = [
            [row.optimizer] + [_cell(row, d, c, key) for c in columns]
            for row, d in zip(rows, ds, strict=True)
            if key != "speedup_vs_fused" or FUSED in row.median_ms
        ]
        if lines:
            out += ["", title, *table_lines(["optimizer"] + [label(c) for c in columns], lines)]
    split = _split_lines(rows, ds, configs)
    if split:
        title = (
            "time in torch's Newton-Schulz (its bfloat16 matmuls, the same call in every column) and "
            "the rest of the step (roundpipe's elementwise passes, or torch's ops); medians, ms:"
        )
        head = ["optimizer", "column", "step", "Newton-Schulz", "rest", "rest vs for-loop", "% bw (rest)"]
        out += ["", title, *table_lines(head, split)]
    return "\n".join(out)


def _split_lines(rows, ds, configs) -> list[list[str]]:
    """The call-out table's lines (``timing.CALLOUTS``: Muon): per column, the step's median,
    the median time inside torch's call-out, the median of the rest, the for-loop's rest over
    this rest, and the bandwidth bound over the rest."""
    lines = []
    for row, d in zip(rows, ds, strict=True):
        loop_rest = row.rest_ms.get(LOOP)
        for c in configs:
            rest = row.rest_ms.get(c)
            if rest is None:
                continue
            lines.append(
                [
                    row.optimizer,
                    label(c),
                    fmt_ms(row.median_ms[c]),
                    fmt_ms(row.callout_ms[c]),
                    fmt_ms(rest),
                    f"{loop_rest / rest:.2f}x" if loop_rest and rest > 0 else "n/a",
                    f"{100 * d['bound_ms'] / rest:.0f}%" if rest > 0 else "n/a",
                ]
            )
    return lines


def header(result: dict, checked: str, legend: str) -> list[str]:
    """The report's first lines: versions, the default backend's engine, ``checked`` (how the
    results were checked), threads, busy processes, the bandwidth, ``legend``, thread pools and
    the environment."""
    meta, bw = result["meta"], result["bandwidth"]
    versions = (
        f"torch {meta['torch']}, numexpr {meta['numexpr']} (vml {meta['numexpr_use_vml']}), "
        f"numpy {meta['numpy']}, python {meta['python']}"
    )
    if meta.get("numba"):
        versions += f", numba {meta['numba']} (NUMBA_NUM_THREADS {meta['numba_threads']})"
    mode = f", --partners {meta['partners']}" if meta.get("partners") else ""
    if meta.get("stored"):
        mode = f", --{meta['stored'][0].replace('_', '-')} {meta['stored'][1]}"
    load = meta["load_average_before"]
    out = [
        f"roundpipe.optim benchmark ({'quick' if meta['quick'] else 'full'}{mode}): {versions}",
        f"default backend: {meta['fast_engine']['text']}",
        checked,
        f"threads: torch {meta['torch_threads']}, numexpr {meta['numexpr_threads']}, "
        f"roundpipe step {meta['roundpipe_threads']}, cpus {meta['cpu_count']}; "
        f"median of {meta['repeats']} round-robin repetitions "
        f"after {meta['warmup']} warm-up step(s); "
        + (
            "each timed step right after a forward and backward pass (--after-backward)"
            if meta.get("after_backward")
            else "steps back to back (--after-backward: each right after a forward and backward pass)"
        ),
        (
            f"busy: {meta['busy']} other process(es) spinning a pure-Python loop during the whole run"
            if meta["busy"]
            else "busy: none (a quiet run: no --busy processes)"
        )
        + (f"; load average before the run {load[0]:.2f}" if load else ""),
        f"memory bandwidth (bytes read + written; in-place mul_ on {bw['mul_']['bytes'] // 2**21} MiB, "
        "copy_ between two such arrays): "
        f"mul_ {bw['mul_']['GBps']:.1f} GB/s, copy_ {bw['copy_']['GBps']:.1f} GB/s; "
        f"ceiling used: {bw['ceiling_GBps']:.1f} GB/s",
        legend,
    ]
    out += state_lines(result)
    chosen = {n: o for n, o in meta.get("options", {}).items() if o}
    if chosen:
        out.append(
            "hyperparameters set (the rest are torch's defaults): "
            + "; ".join(f"{n} " + ", ".join(f"{k}={v!r}" for k, v in o.items()) for n, o in chosen.items())
        )
    if meta.get("thread_pools"):
        out.append("thread pools after the run (threadpoolctl): " + "; ".join(meta["thread_pools"]))
    if meta.get("threading"):
        out.append(f"compiled engine's threads after the run: {meta['threading']}")
    if meta["env"]:
        out.append("environment: " + " ".join(f"{k}={v}" for k, v in sorted(meta["env"].items())))
    return out


def state_lines(result: dict) -> list[str]:
    """The header's line on optimizer state: per optimizer, the bytes of its state tensors after
    the timed steps over the workload's parameter elements, once if every workload gives the
    same, else per workload."""
    by_name: dict = {}
    for wl, res in result["workloads"].items():
        for row in res["rows"]:
            if row.state_bytes_per_element is not None:
                by_name.setdefault(row.optimizer, {})[wl] = row.state_bytes_per_element
    if not by_name:
        return []
    parts = []
    for name, per_wl in by_name.items():
        values = {f"{v:.2f}".rstrip("0").rstrip(".") for v in per_wl.values()}
        if len(values) == 1:
            parts.append(f"{name} {values.pop()}")
        else:
            each = ", ".join(f"{f'{v:.3f}'.rstrip('0').rstrip('.')} {wl}" for wl, v in per_wl.items())
            parts.append(f"{name} {each}")
    return [
        "optimizer state, bytes per parameter element (state B/el: every state tensor's bytes after "
        "the timed steps / the parameters' elements): " + "; ".join(parts)
    ]


STAGED_LEGEND = (
    "B/elem of Adafactor and Muon: each pass's own traffic summed over its passes (Adafactor on a "
    "matrix: param+grad for the norms, grad for the update's norm, grad+param read and param "
    "written: 24; on a vector 32; Muon 32 with its bfloat16 update at 2 bytes), weighted by the "
    "workload's elements; Adafactor's row and column statistics and Muon's Newton-Schulz matmuls "
    "are not counted"
)


def report(result: dict, backends) -> str:
    gbps = result["bandwidth"]["ceiling_GBps"]
    legend = (
        "B/elem: bytes a step must read and write per element (from its spec program); "
        "bw-bound: B/elem x elements / bandwidth ceiling, in ms"
    )
    if any(is_staged(n) for n in result["meta"]["optimizers"]):
        legend += "\n" + STAGED_LEGEND
    out = header(result, check_line(result["meta"]["check_kind"]), legend)
    for wl, res in result["workloads"].items():
        out += ["", format_tables(wl, res, backends, gbps)]
    failures = failures_of(result, backends)
    if failures:
        out += ["", "FAILURES (roundpipe errors or mismatches with torch; no speedup reported):"]
        out += [f"  {f}" for f in failures]
    summary = format_summary(result)
    if summary:
        out += ["", summary]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# the summary: roundpipe's default backend against torch's fastest path, at the run's threads
# and at one thread


def _summary_cell(row: Row | None, fused: bool) -> dict | None:
    """A summary cell of ``row``: roundpipe's default backend's median, torch's fastest median
    of ``fastest_torch`` and its path, their ratio (torch / roundpipe: > 1, roundpipe faster),
    or roundpipe's error or mismatch with torch instead (``error``, no ratio)."""
    if row is None:
        return None
    rp = "rp " + rp_backends.DEFAULT
    timed = {c: row.median_ms[c] for c in fastest_torch(row.optimizer, fused) if c in row.median_ms}
    best = min(timed, key=timed.get) if timed else None
    cell = {
        "rp_ms": row.median_ms.get(rp),
        "torch_path": label(best) if best else None,
        "torch_ms": timed.get(best),
        "ratio": None,
        "error": None,
    }
    if rp in row.errors:
        cell["error"] = row.errors[rp]
    elif row.checks.get(rp_backends.DEFAULT):
        cell["error"] = f"MISMATCH with torch: {row.checks[rp_backends.DEFAULT]}"
    elif cell["rp_ms"] and cell["torch_ms"]:
        cell["ratio"] = cell["torch_ms"] / cell["rp_ms"]
    return cell


def summary_rows(result: dict) -> list[dict]:
    """The summary's rows: per workload of ``SUMMARY_WORKLOADS`` in the run and optimizer
    ``in_summary``, the cell at the run's threads (``run``) and the one-thread pass's
    (``one_thread``, None without the pass)."""
    fused = result["meta"].get("fused_available", {})
    one = result.get("one_thread")
    one_rows = {}
    if one is not None:
        for wl, res in one["workloads"].items():
            one_rows.update({(wl, row.optimizer): row for row in res["rows"]})
    out = []
    for wl, res in result["workloads"].items():
        if wl not in SUMMARY_WORKLOADS:
            continue
        for row in res["rows"]:
            if not in_summary(row.optimizer):
                continue
            has_fused = fused.get(row.optimizer, FUSED in row.median_ms)
            out.append(
                {
                    "workload": wl,
                    "optimizer": row.optimizer,
                    "run": _summary_cell(row, has_fused),
                    "one_thread": None
                    if one is None
                    else _summary_cell(one_rows.get((wl, row.optimizer)), has_fused),
                }
            )
    return out


def _ratio_text(cell: dict | None) -> str:
    if cell is None:
        return "n/a"
    if cell["error"]:
        return "MISMATCH" if cell["error"].startswith("MISMATCH") else "ERROR"
    return "n/a" if cell["ratio"] is None else f"{cell['ratio']:.2f}x"


def format_summary(result: dict) -> str:
    """The report's last section (empty without rows): ``summary_rows`` as a table, a column
    per thread count, then the errors of its cells; a line says why a run has no one-thread
    column."""
    rows = summary_rows(result)
    if not rows:
        return ""
    meta = result["meta"]
    n = meta["torch_threads"]
    one = "one_thread" in result
    head = ["workload", "optimizer", "torch path", f"{n} thread{'s' if n != 1 else ''}"]
    head += ["1 thread"] if one else []
    cols = ("run", "one_thread") if one else ("run",)
    lines, errors = [], []
    for r in rows:
        cells = [r[c] for c in cols]
        paths = list(dict.fromkeys(c["torch_path"] for c in cells if c and c["torch_path"]))
        lines.append(
            [r["workload"], r["optimizer"], " / ".join(paths) or "n/a", *[_ratio_text(c) for c in cells]]
        )
        for col, c in zip(head[3:], cells, strict=True):
            if c and c["error"]:
                errors.append(f"  {r['workload']} {r['optimizer']}, {col}: {c['error']}")
    out = [
        f"summary: roundpipe {rp_backends.DEFAULT} against torch's fastest path (fused where torch "
        "has it, else the faster of for-loop and foreach; median ms ratio, > 1: roundpipe faster)",
    ]
    if one:
        out.append(
            "1 thread: every thread pool at one thread, as on each rank of a torchrun launch "
            "(it sets OMP_NUM_THREADS=1)"
        )
    else:
        out.append(f"no one-thread column: {meta.get('one_thread_skipped')}")
    out += table_lines(head, lines, left=3)
    if errors:
        out += ["errors (no ratio):", *errors]
    return "\n".join(out)


def check_line(kinds: dict) -> str:
    """How each backend was checked against torch: ``kinds`` is backend -> "bit for bit" or
    "close" (``workloads.check_kind``)."""
    by_kind = {k: [b for b, v in kinds.items() if v == k] for k in ("bit for bit", "close")}
    how = {
        "bit for bit": "bit for bit (integer views, NaN by position)",
        "close": "close (torch.testing.assert_close)",
    }
    parts = [f"{', '.join(bs)} {how[k]}" for k, bs in by_kind.items() if bs]
    return (
        "checked against torch's for-loop (2 steps from the same inputs, parameters and every state "
        f"tensor; MISMATCH in a table if not): {'; '.join(parts)}"
    )


def failures_of(result: dict, backends) -> list[str]:
    out = []
    for wl, res in result["workloads"].items():
        for row in res["rows"]:
            for b in backends:
                err = row.errors.get("rp " + b)
                if err:
                    out.append(f"{wl} {row.optimizer} {b}: {err}")
                elif row.checks.get(b):
                    out.append(f"{wl} {row.optimizer} {b}: {row.checks[b]}")
            for c in (LOOP, FOREACH):
                if c in row.errors:
                    out.append(f"{wl} {row.optimizer} {c}: {row.errors[c]}")
    for wl, res in result.get("one_thread", {}).get("workloads", {}).items():
        for row in res["rows"]:
            for c in ("rp " + rp_backends.DEFAULT, LOOP, FOREACH):
                if c in row.errors:
                    out.append(f"{wl} {row.optimizer} {label(c)} (one thread): {row.errors[c]}")
    return out


def to_json(result: dict, backends, row_doc=None) -> dict:
    """The JSON document: meta, bandwidth, and per workload its rows by optimizer, each
    ``row_doc(row)`` (default: ``row_json`` and ``derived``)."""
    gbps = result["bandwidth"]["ceiling_GBps"]
    if row_doc is None:
        row_doc = lambda row: {**row_json(row), **derived(row, backends, gbps)}
    workloads = {}
    for wl, res in result["workloads"].items():
        rows = {row.optimizer: row_doc(row) for row in res["rows"]}
        workloads[wl] = {**{k: v for k, v in res.items() if k != "rows"}, "optimizers": rows}
    doc = {"meta": result["meta"], "bandwidth": result["bandwidth"], "workloads": workloads}
    if "one_thread" in result:  # the pass's rows: medians, samples, errors (no checks, no bound)
        one = result["one_thread"]
        doc["one_thread"] = {
            "threads": one["threads"],
            "workloads": {
                wl: {"optimizers": {row.optimizer: row_json(row) for row in res["rows"]}}
                for wl, res in one["workloads"].items()
            },
        }
    if not (result["meta"].get("partners") or result["meta"].get("stored")):  # (rows of other columns)
        doc["summary"] = summary_rows(result)
    return doc


def row_json(row: Row, name=label) -> dict:
    """A row's options, traffic and samples for the JSON document; ``name``: a config's key."""
    return {
        "options": dict(OPTIONS[row.optimizer]),
        "bytes_per_element": row.bytes_per_element,
        "reads": row.reads,
        "writes": row.writes,
        "numel": row.numel,
        "median_ms": {name(c): v for c, v in row.median_ms.items()},
        "min_ms": {name(c): v for c, v in row.min_ms.items()},
        "samples_ms": {name(c): v for c, v in row.samples_ms.items()},
        "errors": {name(c): v for c, v in row.errors.items()},
        "checks": {b: (m or "ok") for b, m in row.checks.items()},
        "state_bytes_per_element": row.state_bytes_per_element,
        **(
            {
                "callout_median_ms": {name(c): v for c, v in row.callout_ms.items()},
                "rest_median_ms": {name(c): v for c, v in row.rest_ms.items()},
                "callout_samples_ms": {name(c): v for c, v in row.callout_samples_ms.items()},
            }
            if row.callout_ms
            else {}
        ),
    }


def plot(result: dict, backends, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gbps = result["bandwidth"]["ceiling_GBps"]
    wls = list(result["workloads"].items())
    fig, axes = plt.subplots(len(wls), 1, figsize=(13, 3.6 * len(wls)), squeeze=False)
    for ax, (wl, res) in zip(axes[:, 0], wls, strict=True):
        configs = configs_of(backends, res.get("per_param", False))
        rows = res["rows"]
        x = np.arange(len(rows))
        width = 0.8 / len(configs)
        for k, c in enumerate(configs):
            ys = [row.median_ms.get(c, np.nan) for row in rows]
            ax.bar(x + (k - (len(configs) - 1) / 2) * width, ys, width, label=label(c))
        ax.scatter(x, [bound_ms(r, gbps) for r in rows], marker="_", s=400, c="k", label="bandwidth bound")
        ax.set_xticks(x, [r.optimizer for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"{wl}: {res['description']}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    meta = result["meta"]
    fig.suptitle(
        f"roundpipe.optim vs torch.optim on CPU (torch threads {meta['torch_threads']}, "
        f"numexpr threads {meta['numexpr_threads']}, busy processes {meta['busy']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
