"""The toolchain attnlang compiles with: NVRTC (through CuPy's bindings), CUDA's headers,
and the fingerprint of the two that keys the kernel cache. Finding them costs imports, so
`toolchain()` remembers its answer in the cache directory under a probe of the installation.
Nothing here needs a GPU or a driver; `attnlang.runtime.compiler` compiles with what this
finds.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlang import env
from attnlang.runtime.cache import FORMAT_VERSION, cache_dir

__all__ = ["ToolchainError", "Toolchain", "toolchain", "toolchain_fingerprint",
           "nvrtc_module", "nvrtc_version", "cuda_include_dirs"]


class ToolchainError(RuntimeError):
    """NVRTC or the CUDA headers are missing; the message says what was tried and the fix."""


@functools.lru_cache(maxsize=1)
def nvrtc_module() -> Any:
    """CuPy's NVRTC binding module (createProgram, compileProgram, ...)."""
    problems = []
    # cupy_backends' binding loads NVRTC without importing cupy (and without a driver);
    # importing cupy first runs its library preloading, which some installs need.
    for what in ("cupy_backends.cuda.libs.nvrtc", "cupy.cuda.nvrtc"):
        try:
            if what.startswith("cupy_backends"):
                from cupy_backends.cuda.libs import nvrtc
            else:
                from cupy.cuda import nvrtc
            nvrtc.getVersion()  # raises if the shared library cannot be loaded
            return nvrtc
        except Exception as e:  # ImportError, OSError, CUDA errors...
            problems.append(f"{what}: {type(e).__name__}: {e}")
    raise ToolchainError(
        "NVRTC is not available, so attnlang cannot compile kernels:\n  "
        + "\n  ".join(problems)
        + "\nInstall it with `pip install 'attnlang[cuda12]'` (or 'attnlang[cuda13]')."
    )


def nvrtc_version() -> tuple[int, int]:
    """The NVRTC version as (major, minor), e.g. (12, 9). Raises ToolchainError if absent."""
    major, minor = nvrtc_module().getVersion()
    return int(major), int(minor)


@functools.lru_cache(maxsize=1)
def _cupy_version() -> str:
    try:
        import cupy

        return str(cupy.__version__)
    except Exception:
        return "unknown"


def toolchain_fingerprint() -> str:
    """What, besides the source, arch and options, decides the cubin: NVRTC, CuPy and CUDA
    header versions and the cache format. Names versions only, never paths.

    Example: ``"nvrtc 12.9 | cupy 14.2.0 | cuda headers 12090 | format 1"``.
    """
    return _fingerprint(tuple(cuda_include_dirs()))


@functools.lru_cache(maxsize=8)
def _fingerprint(include_dirs: tuple[str, ...]) -> str:
    major, minor = nvrtc_version()
    headers = next(filter(None, map(_header_version, include_dirs)), None)
    return (f"nvrtc {major}.{minor} | cupy {_cupy_version()} | cuda headers {headers} | "
            f"format {FORMAT_VERSION}")


@dataclass(frozen=True)
class Toolchain:
    """The CUDA header directories, the fingerprint and the NVRTC version of this process."""

    include_dirs: tuple[str, ...]
    fingerprint: str
    nvrtc: tuple[int, int]


_TOOLCHAINS: dict[str, Toolchain] = {}
# compile_variant's kernels compile in threads: one of them finds the toolchain, the others
# wait for it (and the memo's temp file has one writer per process).
_TOOLCHAIN_LOCK = threading.Lock()


def toolchain() -> Toolchain:
    """This process's Toolchain, remembered in the cache directory (``toolchain/memo.json``)
    under a probe of the installation, so that a cache hit imports no CuPy: finding NVRTC's
    version and CuPy's CUDA path costs ~0.15 s of imports, most of a hit's time.

    The probe names what decides the answer without importing anything: where CuPy is and
    the modification times of its ``__init__.py`` and of the NVIDIA wheels' library
    directories (an upgrade rewrites them), the CUDA environment variables and where
    /usr/local/cuda points. `clear_cache` forgets the memo.
    """
    probe = _installation_probe()
    memo = cache_dir() / "toolchain" / "memo.json"
    key = json.dumps([probe, str(memo)])
    with _TOOLCHAIN_LOCK:
        if key not in _TOOLCHAINS:
            _TOOLCHAINS[key] = _read_memo(memo, probe) or _find_toolchain(memo, probe)
        return _TOOLCHAINS[key]


def _read_memo(memo: Path, probe: list) -> Toolchain | None:
    try:
        data = json.loads(memo.read_text())
        if data["probe"] == probe:
            return Toolchain(tuple(data["include_dirs"]), str(data["fingerprint"]),
                             (int(data["nvrtc"][0]), int(data["nvrtc"][1])))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    return None


def _find_toolchain(memo: Path, probe: list) -> Toolchain:
    found = Toolchain(tuple(cuda_include_dirs()), toolchain_fingerprint(), nvrtc_version())
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".memo.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"probe": probe, "include_dirs": list(found.include_dirs),
                                   "fingerprint": found.fingerprint, "nvrtc": found.nvrtc}))
        os.replace(tmp, memo)
    except OSError:
        pass  # an unwritable cache only costs the imports next time
    return found


def _installation_probe() -> list:
    import importlib.util

    def mtime(path: str | None) -> int | None:
        try:
            return os.stat(path).st_mtime_ns if path else None
        except OSError:
            return None

    spec = importlib.util.find_spec("cupy")
    origin = spec.origin if spec is not None else None
    site = os.path.dirname(os.path.dirname(origin)) if origin else None
    wheels = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib"))) if site else []
    return [origin, mtime(origin), [[w, mtime(w)] for w in wheels],
            [os.environ.get(v) for v in ("CUDA_PATH", "CUDA_HOME", "ATTNLANG_CUDA_INCLUDE")],
            os.path.realpath("/usr/local/cuda"), FORMAT_VERSION]


# ---------------------------------------------------------------------------- headers


def cuda_include_dirs() -> list[str]:
    """The include directories passed to NVRTC.

    ``ATTNLANG_CUDA_INCLUDE`` comes first; if one of its directories holds ``cuda_fp16.h``
    nothing else is added. Otherwise one discovered CUDA header directory is appended,
    searched in this order: the pip wheels (``nvidia/cu13/include``,
    ``nvidia/cuda_runtime/include``, ...), ``$CUDA_PATH/include``, ``$CUDA_HOME/include``,
    CuPy's CUDA path, ``/usr/local/cuda/include``; one whose CUDA major version matches
    NVRTC's wins over the order, since mixing headers of another release fails in odd ways.
    Raises ToolchainError naming what was tried when none holds ``cuda_fp16.h``.
    """
    dirs = _discover(tuple(env.cuda_include()), os.environ.get("CUDA_PATH"),
                     os.environ.get("CUDA_HOME"))
    return list(dirs)


@functools.lru_cache(maxsize=8)
def _discover(extra: tuple[str, ...], cuda_path: str | None,
              cuda_home: str | None) -> tuple[str, ...]:
    missing = [d for d in extra if not os.path.isdir(d)]
    if missing:
        raise ToolchainError(
            f"ATTNLANG_CUDA_INCLUDE names directories that do not exist: {', '.join(missing)}"
        )
    if any(_has_cuda_headers(d) for d in extra):
        return extra
    candidates = _candidate_dirs(cuda_path, cuda_home)
    found = [d for d in candidates if _has_cuda_headers(d)]
    if not found:
        tried = "\n  ".join([*extra, *candidates]) or "(nothing)"
        raise ToolchainError(
            "CUDA headers not found: no directory holding cuda_fp16.h among\n  "
            f"{tried}\nInstall them with `pip install 'attnlang[cuda12]'` (or "
            "'attnlang[cuda13]'), or set ATTNLANG_CUDA_INCLUDE to a CUDA include directory."
        )
    try:
        major = nvrtc_version()[0]
    except ToolchainError:
        major = None
    found.sort(key=lambda d: (_header_version(d) or 0) // 1000 != major)  # stable
    return (*extra, found[0])


def _candidate_dirs(cuda_path: str | None, cuda_home: str | None) -> list[str]:
    """Places CUDA headers may be, best first, without duplicates."""
    dirs: list[Path] = []
    # pip wheels live in the `nvidia` namespace package, possibly in several site dirs.
    for entry in sys.path:
        root = Path(entry or ".") / "nvidia"
        if root.is_dir():
            dirs += [root / "cu13" / "include", root / "cuda_runtime" / "include"]
            dirs += sorted(root.glob("cu[0-9]*/include"), reverse=True)
    dirs += [Path(p) / "include" for p in (cuda_path, cuda_home) if p]
    try:
        from cupy import _environment

        cupy_cuda = _environment.get_cuda_path()
        if cupy_cuda:
            dirs.append(Path(cupy_cuda) / "include")
    except Exception:  # cupy missing or its probing failed: other places remain
        pass
    dirs.append(Path("/usr/local/cuda/include"))
    unique: dict[str, str] = {}
    for d in dirs:
        unique.setdefault(os.path.realpath(d), str(d))
    return list(unique.values())


def _has_cuda_headers(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "cuda_fp16.h"))


_VERSION_DEFINE = re.compile(rb"#define\s+(?:CUDA_VERSION|CUDART_VERSION)\s+(\d+)")


@functools.lru_cache(maxsize=32)
def _header_version(directory: str) -> int | None:
    """CUDA_VERSION of the headers in `directory` (12090 for 12.9), or None."""
    for name in ("cuda.h", "cuda_runtime_api.h"):
        try:
            text = Path(directory, name).read_bytes()
        except OSError:
            continue
        m = _VERSION_DEFINE.search(text)
        if m:
            return int(m.group(1))
    return None
