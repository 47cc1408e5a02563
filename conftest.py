"""Suite-wide pytest setup (``tests/`` and ``conformance/``): test order and process state.

Test order. ``ROUNDPIPE_TEST_ORDER`` reorders the collected tests, to show tests that pass only
because of what an earlier test left behind (or fail only after one):

* ``reverse``: the whole list backwards, so every pair of tests runs in the other order;
* ``random`` or ``random:<seed>``: modules in a random order and each module's tests shuffled
  (a module's tests stay together, so module-scoped fixtures are built once); without a seed
  one is drawn. The seed is printed in the header: ``ROUNDPIPE_TEST_ORDER=random:<seed>``
  replays the order.

CI (``.ci/run``) runs the fast unit tests a second time with ``reverse``.

Process state. After every test the autouse fixture ``_restore_process_state`` puts back what
a test may change for the whole process and forget to restore: environment variables,
torch's, numexpr's and numba's thread counts, ``roundpipe.optim.set_num_threads``, the
state of torch's global random generator and the 8-bit family's per-parameter overrides
(bitsandbytes' ``GlobalOptimManager`` and roundpipe's: emptied). Tests should still restore what they change
(``monkeypatch``, ``try``/``finally``); what one did not is restored here and listed at the
end of the run ("process state left changed"; printed also under ``-q``, like the test
order), so that the next test does not depend on it.
"""

from __future__ import annotations

import os
import random
import sys

import numexpr
import pytest
import torch

import roundpipe.optim.overrides as rp_overrides
import roundpipe.optim.threads as rp_threads

ORDER_ENV_VAR = "ROUNDPIPE_TEST_ORDER"


def _order():
    """(kind, seed) from ROUNDPIPE_TEST_ORDER: kind is None, "reverse" or "random"."""
    value = os.environ.get(ORDER_ENV_VAR, "").strip()
    if not value or value == "default":
        return None, None
    kind, _, seed = value.partition(":")
    if kind == "reverse" and not seed:
        return "reverse", None
    if kind == "random":
        if not seed:
            return "random", random.SystemRandom().randrange(10**6)
        try:
            return "random", int(seed)
        except ValueError:
            pass
    raise pytest.UsageError(f"{ORDER_ENV_VAR}={value!r}: use reverse, random or random:<integer seed>")


def pytest_configure(config):
    config._roundpipe_order = _order()
    config._roundpipe_leaks = []


def _order_line(config):
    kind, seed = config._roundpipe_order
    if kind == "reverse":
        return f"test order: reverse ({ORDER_ENV_VAR}=reverse)"
    if kind == "random":
        return f"test order: random, seed {seed} (replay: {ORDER_ENV_VAR}=random:{seed})"
    return None


def pytest_report_header(config):
    return _order_line(config)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    kind, seed = config._roundpipe_order
    if kind == "reverse":
        items.reverse()
    elif kind == "random":
        rng = random.Random(seed)
        modules: dict = {}
        for item in items:
            modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
        groups = list(modules.values())
        rng.shuffle(groups)
        for group in groups:
            rng.shuffle(group)
        items[:] = [item for group in groups for item in group]


# ---------------------------------------------------------------------------------------------
# process state


def _numba_threads():
    """numba's thread count, only if a test started numba's pool (asking would start it)."""
    numba = sys.modules.get("numba")
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if numba is None or parallel is None or not getattr(parallel, "_is_initialized", False):
        return None
    return numba.get_num_threads()


def _overrides() -> int:
    """How many overrides bitsandbytes' ``GlobalOptimManager`` and roundpipe's hold: one a test
    leaves reaches every later 8-bit optimizer (by parameter, and by position)."""
    tables = ("pid2config", "index2config", "module_weight_config_triple")
    return sum(len(getattr(m, t)) for m in rp_overrides.managers() for t in tables)


def _capture():
    return {
        "8-bit optimizer overrides": _overrides(),
        "environment": dict(os.environ),
        "torch threads": torch.get_num_threads(),
        "roundpipe.optim.set_num_threads": getattr(rp_threads, "_num_threads", None),
        "numexpr threads": numexpr.get_num_threads(),
        "numba threads": _numba_threads(),
        "torch RNG": torch.get_rng_state(),
    }


# environment variables that libraries set for themselves, left alone: pytest's (the running
# test), torch's (its compile cache's directory, on first use), threadpoolctl's (on import)
OWN_ENV = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK")
# what a test itself sets (reported when left changed); numexpr's and numba's counts are set by
# roundpipe's steps (they follow its thread setting) and torch's generator moves whenever a
# test draws from it, so those are restored but not reported
REPORTED = ("torch threads", "roundpipe.optim.set_num_threads", "8-bit optimizer overrides")


def _restore(before, after):
    """Put back what changed; return a description of what the test left changed."""
    changes = []
    env_before, env_after = before["environment"], after["environment"]
    names = sorted(
        k for k in {**env_before, **env_after} if env_before.get(k) != env_after.get(k) and k not in OWN_ENV
    )
    if names:
        changes.append(f"environment variables {', '.join(names)}")
        for k in names:
            if k in env_before:
                os.environ[k] = env_before[k]
            else:
                del os.environ[k]
    if after["torch threads"] != before["torch threads"]:
        torch.set_num_threads(before["torch threads"])
    if after["roundpipe.optim.set_num_threads"] != before["roundpipe.optim.set_num_threads"]:
        rp_threads.set_num_threads(before["roundpipe.optim.set_num_threads"])
    if after["8-bit optimizer overrides"] != before["8-bit optimizer overrides"]:
        for manager in rp_overrides.managers():
            manager.initialize()
    if after["numexpr threads"] != before["numexpr threads"]:
        numexpr.set_num_threads(before["numexpr threads"])
    if before["numba threads"] is not None and after["numba threads"] != before["numba threads"]:
        sys.modules["numba"].set_num_threads(before["numba threads"])
    # a test that draws from torch's global generator (or seeds it) would change what the next
    # test draws: every test starts from the same state
    if not torch.equal(after["torch RNG"], before["torch RNG"]):
        torch.set_rng_state(before["torch RNG"])
    changes += [f"{key} {before[key]} -> {after[key]}" for key in REPORTED if after[key] != before[key]]
    return changes


@pytest.fixture(autouse=True)
def _restore_process_state(request):
    before = _capture()
    yield
    changes = _restore(before, _capture())
    if changes:
        request.config._roundpipe_leaks.append((request.node.nodeid, changes))


def pytest_terminal_summary(terminalreporter, config):
    tr = terminalreporter
    if _order_line(config):  # also under -q, which hides the header
        tr.write_line(_order_line(config))
    leaks = config._roundpipe_leaks
    if not leaks:
        return
    tr.section("process state left changed (restored after the test; the test should restore it)")
    for nodeid, changes in leaks[:50]:
        tr.write_line(f"{nodeid}: {'; '.join(changes)}")
    if len(leaks) > 50:
        tr.write_line(f"... and {len(leaks) - 50} more tests")
