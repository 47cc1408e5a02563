"""Session summary of the conformance suite: worst errors per optimizer and backend, and per
declared deviation (``deviations.py``).

Printed at the end of the session; also written as JSON to ``$ROUNDPIPE_CONFORMANCE_REPORT``
when that is set. The error measures are defined in ``harness.py``.
"""

import json
import os

from . import deviations
from .cases import BACKENDS, CASES_BY_OPTIMIZER
from .harness import ATOL, RECORDER, RTOL

REPORT_ENV = "ROUNDPIPE_CONFORMANCE_REPORT"
COMPARISONS = BACKENDS + tuple(f"{b}-vs-reference" for b in BACKENDS if b != "reference")
# Environment that selects what the backends run (shown in the summary, not set here).
SHOWN_ENV = (
    "ROUNDPIPE_OPTIM_BACKEND",
    "ROUNDPIPE_OPTIM_ENGINE",
    "ROUNDPIPE_OPTIM_NUM_THREADS",
    "ROUNDPIPE_CONFORMANCE_THREADS",
)


def _rows():
    rows = []
    for name, cases in CASES_BY_OPTIMIZER.items():
        for comparison in COMPARISONS:
            st = RECORDER.stats.get((name, comparison))
            row = {"optimizer": name, "comparison": comparison, "cases_in_table": len(cases)}
            row.update(st.as_dict() if st else {"cases": 0})
            rows.append(row)
    return rows


def _deviation_rows():
    rows = []
    for d in deviations.DEVIATIONS:
        for backend in d.backends:
            for c in d.comparisons:
                comparison = backend if c == "torch" else f"{backend}-vs-reference"
                st = RECORDER.deviations.get((d.name, comparison))
                row = {"deviation": d.name, "comparison": comparison, "tolerance": d.tolerance or "xfail"}
                row.update(st.as_dict() if st else {"cases": 0})
                row["measured"] = d.measured
                rows.append(row)
    return rows


def _env():
    return {k: os.environ.get(k) for k in SHOWN_ENV}


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section(
        "roundpipe.optim conformance: worst errors against torch.optim (and against the reference backend)"
    )
    total = sum(len(c) for c in CASES_BY_OPTIMIZER.values())
    per = ", ".join(f"{k} {len(v)}" for k, v in CASES_BY_OPTIMIZER.items())
    cases_line = f"cases per optimizer: {per} (total {total}, each on {len(BACKENDS)} backends)"
    if not RECORDER.stats:
        tr.write_line("no conformance case ran; " + cases_line)
        return
    tr.write_line(
        f"max_abs = max|a-b|; max_rel = max|a-b|/|b| over |b| >= float32 tiny; "
        f"max_ratio = max|a-b|/({ATOL:g} + {RTOL:g}|b|) (assert_close passes at <= 1)"
    )
    tr.write_line("environment: " + ", ".join(f"{k}={v or '(unset)'}" for k, v in _env().items()))
    head = f"{'optimizer':<9} {'cases':>5} {'comparison':<25} {'run':>4} {'max_abs':>9} {'max_rel':>9} "
    tr.write_line(head + f"{'max_ratio':>9}  worst ratio at")
    not_run = 0
    for row in _rows():
        line = f"{row['optimizer']:<9} {row['cases_in_table']:>5} {row['comparison']:<25} {row['cases']:>4} "
        if not row["cases"]:
            not_run += 1
            continue
        errors = f"{row['max_abs']:>9.3g} {row['max_rel']:>9.3g} {row['max_ratio']:>9.3g}"
        tr.write_line(line + errors + "  " + (row["worst"] or "-"))
    if not_run:
        tr.write_line(f"({not_run} (optimizer, comparison) rows not run in this session are not shown)")
    tr.write_line(cases_line)
    tr.write_line("declared deviations (deviations.py; max_ratio against assert_close's defaults):")
    for row in _deviation_rows():
        line = f"  {row['deviation']} [{row['comparison']}] tolerance {row['tolerance']}: "
        if not row["cases"]:
            tr.write_line(line + "not run in this session")
            continue
        tr.write_line(
            line + f"{row['cases']} cases, max_abs {row['max_abs']:.3g}, max_ratio {row['max_ratio']:.3g}"
            f" at {row['worst'] or '-'}"
        )


def pytest_sessionfinish(session):
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    report = {
        "definitions": {
            "max_abs": "max |a-b| (double precision; complex: per real component)",
            "max_rel": "max |a-b|/|b| over elements with |b| >= float32 tiny (1.18e-38)",
            "max_ratio": f"max |a-b|/(atol + rtol*|b|), atol={ATOL}, rtol={RTOL}; <= 1 passes",
            "a": "roundpipe's value; b: torch's (for <backend>-vs-reference: the reference backend's)",
        },
        "environment": _env(),
        "cases_per_optimizer": {k: len(v) for k, v in CASES_BY_OPTIMIZER.items()},
        "results": _rows(),
        "declared_deviations": _deviation_rows(),
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
