"""roundpipe.optim against torch.optim on bfloat16 and float16 parameters, stepped directly:
every case of ``low_precision.py`` on every backend that steps them (fast:torch: its
``TORCH_ENGINE_CASES``), bit for bit
(``harness.run_case``: parameters, state and ``state_dict()``'s structure after every step,
against torch's for-loop and against the reference backend).

Test ids read ``<Optimizer>-<kwargs>-16bit-<backend>``.
"""

import pytest

from .harness import run_case
from .low_precision import BACKENDS, CASES, NAN_CASES, TORCH_ENGINE_CASES

_TORCH_ENGINE = {c.id for c in TORCH_ENGINE_CASES}
_PARAMS = [
    pytest.param(c, b, id=f"{c.id}-{b}")
    for c in CASES
    for b in BACKENDS
    if b != "fast:torch" or c.id in _TORCH_ENGINE
] + [pytest.param(c, b, id=f"{c.id}-{b}") for c in NAN_CASES for b in BACKENDS]


@pytest.mark.parametrize("case, backend", _PARAMS)
def test_low_precision(case, backend):
    run_case(case, backend)
