"""Every environment knob attnlang reads, in one place.

Each knob has one small accessor below; nothing else in attnlang reads ``os.environ`` for an
``ATTNLANG_*`` name. An unset knob and one set to the empty string mean the same: default.

==============================  ===========================================================
knob                            meaning (default)
==============================  ===========================================================
``ATTNLANG_CACHE_DIR``          where compiled kernels are cached
                                (``platformdirs.user_cache_dir("attnlang")``)
``ATTNLANG_CUDA_INCLUDE``       CUDA header directories searched first, ``os.pathsep``-
                                separated (none; attnlang finds CUDA's headers itself)
``ATTNLANG_ARCH``               target when no arch is given, e.g. ``sm_90a``; wins over
                                the current GPU's (the current GPU, else an error)
``ATTNLANG_QUIET``              any value but ``0``/``false``/``no``/``off`` silences the
                                "compiling ..." progress lines on stderr (off)
``ATTNLANG_DUMP_DIR``           write every compiled source, its cubin and ptxas log
                                there, for debugging (off)
``ATTNLANG_HOST_PATH``          ``python``: run() never uses its C path (``c``: it does
                                when a C compiler and Python's headers are there)
``ATTNLANG_DEPENDENT_LAUNCH``   ``0``/``false``/``no``/``off``: run()'s kernels launch only
                                once the kernel before each has finished (on: on sm_90+
                                they are programmatic dependent launches, started beside
                                it; read when a BatchAttention is made)
``ATTNLANG_PREFILL_TMA``        ``0``/``false``/``no``/``off``: the prefill kernel's producer
                                copies every tile with cp.async (on: whole tiles of a
                                cache whose pages are a multiple of 16 tokens by TMA, on
                                sm_90a at head dims 128 and 256; read when a
                                BatchAttention is made)
==============================  ===========================================================

attnlang also reads two standard CUDA variables, ``CUDA_PATH`` and ``CUDA_HOME``, as places
to look for CUDA's headers (`attnlang.runtime.toolchain.cuda_include_dirs`).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "cuda_include", "arch", "quiet", "dump_dir", "host_path",
           "dependent_launch", "prefill_tma"]

_FALSE = {"0", "false", "no", "off"}


def _get(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def cache_dir() -> Path:
    """``ATTNLANG_CACHE_DIR``: the kernel cache directory (may not exist yet).

    Example: ``ATTNLANG_CACHE_DIR=/scratch/al`` -> ``Path("/scratch/al")``.
    """
    value = _get("ATTNLANG_CACHE_DIR")
    if value is not None:
        return Path(value).expanduser()
    import platformdirs  # only needed for the default

    return Path(platformdirs.user_cache_dir("attnlang"))


def cuda_include() -> list[str]:
    """``ATTNLANG_CUDA_INCLUDE``: extra CUDA header directories, in the order given.

    Example: ``ATTNLANG_CUDA_INCLUDE=/opt/cuda/include:/x`` -> ``["/opt/cuda/include", "/x"]``.
    """
    value = _get("ATTNLANG_CUDA_INCLUDE")
    if value is None:
        return []
    return [str(Path(p).expanduser()) for p in value.split(os.pathsep) if p.strip()]


def arch() -> str | None:
    """``ATTNLANG_ARCH``: the default target architecture (``"sm_90a"``), or None if unset.

    Not validated here; the compiler validates it like an explicit ``arch`` argument.
    """
    return _get("ATTNLANG_ARCH")


def quiet() -> bool:
    """``ATTNLANG_QUIET``: True when compile progress should not be printed."""
    value = _get("ATTNLANG_QUIET")
    return value is not None and value.lower() not in _FALSE


def dump_dir() -> Path | None:
    """``ATTNLANG_DUMP_DIR``: where to write every compiled source + cubin, or None."""
    value = _get("ATTNLANG_DUMP_DIR")
    return Path(value).expanduser() if value is not None else None


def host_path() -> str:
    """``ATTNLANG_HOST_PATH``: ``"c"`` (default) or ``"python"``, for run()'s per-call path.

    Raises ValueError for any other value. Example: ``ATTNLANG_HOST_PATH=python`` -> "python".
    """
    value = (_get("ATTNLANG_HOST_PATH") or "c").lower()
    if value not in ("c", "python"):
        raise ValueError(f"ATTNLANG_HOST_PATH must be 'c' or 'python', got {value!r}")
    return value


def dependent_launch() -> bool:
    """``ATTNLANG_DEPENDENT_LAUNCH``: False when set to ``0``/``false``/``no``/``off``, else
    True (the default): run()'s kernels are programmatic dependent launches on sm_90+."""
    value = _get("ATTNLANG_DEPENDENT_LAUNCH")
    return value is None or value.lower() not in _FALSE


def prefill_tma() -> bool:
    """``ATTNLANG_PREFILL_TMA``: False when set to ``0``/``false``/``no``/``off``, else True
    (the default): the prefill kernel's producer copies whole tiles by TMA where it can
    (`attnlang.runtime.tensor_maps`)."""
    value = _get("ATTNLANG_PREFILL_TMA")
    return value is None or value.lower() not in _FALSE
