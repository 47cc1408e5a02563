"""Fixtures shared by the unit tests.

``name`` runs a test for each of the eleven optimizers. ``backend`` runs it on the reference
backend and on the fast backend with each of its engines pinned (``ROUNDPIPE_OPTIM_ENGINE``),
so that both engines are covered whichever one calibration would pick on this machine; the
fixture's value is the backend name to pass as ``backend=``. The backend, engine and thread
environment variables are cleared for every test so that a developer's shell settings cannot
change what the tests check.

The session runs torch (and so roundpipe's steps, which follow torch's thread count) on one
thread: on a shared 2-vCPU machine a second thread stalls whenever the other core is busy,
and elementwise results do not depend on the thread count (``test_zero_copy`` checks a
two-thread step against a one-thread step).
"""

import pytest
import torch

from tests._util import BACKENDS, ENGINE_ENV_VAR, ENV_VAR, OPTIMIZER_NAMES, THREADS_ENV_VAR

# (backend, fast engine): every public backend, the fast one once per engine
BACKEND_PARAMS = [(b, e) for b in BACKENDS for e in (("numexpr", "torch") if b == "fast" else (None,))]


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in (ENV_VAR, ENGINE_ENV_VAR, THREADS_ENV_VAR):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(params=OPTIMIZER_NAMES)
def name(request):
    return request.param


@pytest.fixture(
    params=BACKEND_PARAMS,
    ids=[f"{b}-{e}" if e else b for b, e in BACKEND_PARAMS],
)
def backend(request, monkeypatch):
    name, engine = request.param
    if engine is not None:
        monkeypatch.setenv(ENGINE_ENV_VAR, engine)
    return name


@pytest.fixture(params=["numexpr", "torch"])
def engine(request, monkeypatch):
    """Pins the fast backend's engine."""
    monkeypatch.setenv(ENGINE_ENV_VAR, request.param)
    return request.param
