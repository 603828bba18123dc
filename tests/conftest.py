"""Shared test setup: no test ever touches the user's kernel cache."""

import json
import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _session_kernel_cache(tmp_path_factory):
    # One cache for the session, shared by the xdist workers (the compiler locks each entry
    # across processes), so the suite compiles each kernel once; tests that check the cache
    # itself set their own directory per test (tests/runtime/test_compiler.py).
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory, above each worker's own
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNLANG_CACHE_DIR", str(base / "attnlang-cache"))
        yield


# ---------------------------------------------------------------------------- GPU tests
# Tests marked `gpu` run only where CuPy sees a CUDA device; elsewhere they are skipped
# (never errors), so CI without a GPU stays green.


def _gpu_available() -> tuple[bool, str]:
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device
        return False, f"no CUDA GPU ({type(e).__name__}: {e})"
    return (count > 0, "no CUDA GPU (CuPy sees 0 devices)")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    available, why = _gpu_available()
    if not available:
        skip = pytest.mark.skip(reason=why)
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def cp():
    """CuPy, for the GPU tests (imported only where they run)."""
    import cupy

    return cupy


# Largest relative L2 error seen by the GPU correctness tests, per dtype (and where), so a
# run reports them: printed in the terminal summary and, if $ATTNLANG_ERROR_LOG names a file,
# written there as JSON.
ERRORS: dict[str, dict] = {}


@pytest.fixture
def error_log():
    """record(dtype, error, where): keep the largest error per dtype."""

    def record(dtype: str, error: float, where: str) -> None:
        _append_line(dtype, error, where)
        best = ERRORS.get(dtype)
        if best is None or error > best["max_rel_l2"]:
            ERRORS[dtype] = {"max_rel_l2": float(error), "where": where,
                             "count": (best or {}).get("count", 0) + 1}
        else:
            best["count"] += 1

    return record


def _lines_path() -> str | None:
    path = os.environ.get("ATTNLANG_ERROR_LOG")
    return path + "l" if path else None  # errors.json -> errors.jsonl, one line per check


def _append_line(dtype: str, error: float, where: str) -> None:
    # pytest-xdist workers are separate processes: each appends its checks to one file,
    # which the controller aggregates in the terminal summary.
    path = _lines_path()
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"dtype": dtype, "error": float(error), "where": where}) + "\n")


def _aggregate_lines() -> None:
    path = _lines_path()
    if not path or not os.path.exists(path) or ERRORS:
        return
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            best = ERRORS.get(r["dtype"])
            count = (best or {}).get("count", 0) + 1
            if best is None or r["error"] > best["max_rel_l2"]:
                ERRORS[r["dtype"]] = {"max_rel_l2": r["error"], "where": r["where"],
                                      "count": count}
            else:
                best["count"] = count


def pytest_terminal_summary(terminalreporter):
    _aggregate_lines()
    if not ERRORS:
        return
    terminalreporter.section("attnlang GPU numerics (max relative L2 error vs float64)")
    for dtype, e in sorted(ERRORS.items()):
        terminalreporter.write_line(
            f"{dtype:>9}: {e['max_rel_l2']:.3e} over {e['count']} checks (worst: {e['where']})")
    path = os.environ.get("ATTNLANG_ERROR_LOG")
    if path:
        with open(path, "w") as f:
            json.dump(ERRORS, f, indent=2, sort_keys=True)
