"""Shared test setup: no test ever touches the user's kernel cache."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _session_kernel_cache(tmp_path_factory):
    # One cache for the session, so GPU tests compile each kernel once; tests that check the
    # cache itself set their own directory per test (tests/runtime/test_compiler.py).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNLANG_CACHE_DIR", str(tmp_path_factory.mktemp("attnlang-cache")))
        yield
