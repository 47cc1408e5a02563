"""roundpipe.optim against torch.optim: every case of ``cases.py`` on every backend.

Test ids read ``<Optimizer>-<kwargs>-<backend>``, e.g. ``Adam-amsgrad=True,weight_decay=0.1-fast``.
A ``fast`` or ``native`` test also checks that backend against the reference backend, step by
step.
"""

import pytest

from .cases import BACKENDS, CASES
from .harness import run_case

# Declared deviations, one reason each. Not strict: whether the one element crosses the
# tolerance depends on the CPU's sqrt (torch's kernel is chosen by CPU capability).
XFAIL = {
    ("RMSprop-momentum=0.9,weight_decay=0.1", "native"): (
        "native computes sqrt correctly rounded; torch 2.13's CPU sqrt is off by 1 ulp on about "
        "a fifth of elements, and RMSprop's division of the weight-decayed gradient by sqrt(avg) "
        "amplifies it where grad + wd*param nearly cancels: one element of 70001 ends 1.04e-5 "
        "off at step 19 (assert_close allows 1e-5)"
    ),
}
XFAIL[("RMSprop-maximize=True,momentum=0.9,weight_decay=0.1", "native")] = XFAIL[
    ("RMSprop-momentum=0.9,weight_decay=0.1", "native")
]


def _params():
    for case in CASES:
        for backend in BACKENDS:
            reason = XFAIL.get((case.id, backend))
            marks = [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
            yield pytest.param(case, backend, marks=marks, id=f"{case.id}-{backend}")


@pytest.mark.parametrize("case, backend", list(_params()))
def test_conformance(case, backend):
    run_case(case, backend)
