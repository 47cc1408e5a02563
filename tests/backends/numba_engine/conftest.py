"""The numba engine's tests compile their kernels into one temporary cache directory
(``ROUNDPIPE_CACHE_DIR``), never into the user's."""

import pytest

from roundpipe.optim.backends import numba_engine


@pytest.fixture(scope="package", autouse=True)
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(numba_engine.CACHE_ENV_VAR, str(tmp_path_factory.mktemp("roundpipe-cache")))
        yield
