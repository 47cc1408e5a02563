"""Fixtures shared by the unit tests.

``name`` runs a test for each optimizer of the spec registry (``SPECS``). ``backend`` runs it
on every engine: ``fast`` (its default, numba), ``fast:torch``, ``fast:numexpr`` and
``reference``; the fixture's value is the backend name to pass as ``backend=``.

Every test starts from the same roundpipe state, whatever ran before it in the process (and
whatever order the tests run in; see ``ROUNDPIPE_TEST_ORDER`` in the top-level
``conftest.py``, which also restores thread counts and the environment after each test):

* the ``ROUNDPIPE_OPTIM_*`` environment variables (backend, engine, threads) are cleared, so
  that a developer's shell settings cannot change what the tests check;
* ``roundpipe.optim.set_num_threads`` is unset (``None``);
* the backend objects are fresh (``roundpipe.optim.backends._instances`` is emptied for the
  test and put back after it), so their compile caches hold only what this test compiled:
  a test that looks into a backend's caches does not see what an earlier test (or the
  conformance suite, in the same process) left there.

The session runs torch (and so roundpipe's steps, which follow torch's thread count) on one
thread: on a shared 2-vCPU machine a second thread stalls whenever the other core is busy,
and elementwise results do not depend on the thread count (``test_zero_copy`` checks a
two-thread step against a one-thread step).
"""

import os

import pytest
import torch

import roundpipe.optim.threads as rp_threads
from roundpipe.optim import backends as rp_backends
from tests._util import BACKENDS, ENGINE_ENV_VAR, OPTIMIZER_NAMES

# the environment variables that select what roundpipe.optim runs (backend, engine, threads)
ROUNDPIPE_ENV_PREFIX = "ROUNDPIPE_OPTIM_"


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in [v for v in os.environ if v.startswith(ROUNDPIPE_ENV_PREFIX)]:
        monkeypatch.delenv(var)


@pytest.fixture(autouse=True)
def _fresh_roundpipe_state(monkeypatch):
    monkeypatch.setattr(rp_threads, "_num_threads", None)
    monkeypatch.setattr(rp_backends, "_instances", {})


@pytest.fixture(params=OPTIMIZER_NAMES)
def name(request):
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=["numba", "numexpr", "torch"])
def engine(request, monkeypatch):
    """Pins the fast backend's engine."""
    monkeypatch.setenv(ENGINE_ENV_VAR, request.param)
    return request.param
