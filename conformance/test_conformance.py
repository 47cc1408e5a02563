"""roundpipe.optim against torch.optim: every case of ``cases.py`` on every backend.

Test ids read ``<Optimizer>-<kwargs>-<backend>``, e.g.
``Adam-amsgrad=True,weight_decay=0.1-fast:numexpr``. A test on a backend other than
``reference`` also checks that backend against the reference backend, step by step. The
deviations declared in ``deviations.py`` are applied by the harness (a declared tolerance) or
here (an expected failure, strict).
"""

import pytest

from . import deviations
from .cases import BACKENDS, CASES
from .harness import run_case

deviations.check(CASES, BACKENDS)


def case_params():
    for case in CASES:
        for backend in BACKENDS:
            deviation = deviations.lookup(case, backend)
            marks = []
            if deviation is not None and deviation.tolerance is None:
                marks.append(pytest.mark.xfail(strict=True, reason=deviation.reason))
            yield pytest.param(case, backend, marks=marks, id=f"{case.id}-{backend}")


@pytest.mark.parametrize("case, backend", list(case_params()))
def test_conformance(case, backend):
    run_case(case, backend)
