"""CUDA C++ source -> cubin, through NVRTC (via CuPy's bindings), cached by content.

The compile pass of the pipeline: ``compile_source(src, arch) -> Cubin``. It needs the NVRTC
library and CUDA's headers, never a GPU or a driver, so kernels can be built on a laptop or
in CI (``attnlang compile --arch sm_90a``). Loading and launching the cubin is the runtime's
job.

Lookup order for a kernel: the in-process cache, then the disk cache, then NVRTC (under a
cross-process lock, so concurrent processes compile a kernel once). The key is
`attnlang.runtime.cache.cache_key`; see that module for the disk format.

The sources attnlang renders are self-contained apart from CUDA's own headers
(``cuda_fp16.h``, ``cuda_bf16.h``, ``cuda_pipeline.h``); `cuda_include_dirs` finds them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import json
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from attnlang import env
from attnlang.runtime import cache
from attnlang.runtime.cache import (
    FORMAT_VERSION,
    cache_dir,
    cache_key,
    clear_cache,
    clear_memory_cache,
    list_entries,
)

__all__ = [
    "FunctionInfo", "Cubin", "CompileError", "ToolchainError", "compile_source",
    "resolve_arch", "cuda_include_dirs", "nvrtc_version", "toolchain_fingerprint", "toolchain",
    "Toolchain",
    "parse_ptxas_report", "cache_key", "cache_dir", "list_entries", "clear_cache",
    "clear_memory_cache",
]

# Always on. -Xptxas=-v makes ptxas report registers/spills/smem into the log. No
# --use_fast_math: kernels pick their fast intrinsics explicitly.
_BASE_OPTIONS = ("-std=c++17", "-Xptxas=-v")
_ARCH_RE = re.compile(r"sm_(\d{2,3})([af]?)")
_ARCH_OPTIONS = ("-arch", "--gpu-architecture")


@dataclass(frozen=True)
class FunctionInfo:
    """What ptxas reported for one entry function (``-Xptxas=-v``).

    Example: ``FunctionInfo("decode", registers=96, stack_bytes=0, spill_stores=0,
    spill_loads=0, shared_bytes=0)``; ``shared_bytes`` is static shared memory only.
    """

    name: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int


@dataclass(frozen=True)
class Cubin:
    """A compiled module: the cubin bytes plus what produced them.

    ``cache`` says where this call found it: "memory" (this process compiled or loaded it
    before), "disk" (an earlier process did) or "miss" (NVRTC ran now). ``compile_seconds``
    is the NVRTC time of the compile that built it, whichever process that was. ``path`` is
    the disk entry, None when the cache directory is not writable.
    """

    data: bytes = field(repr=False)
    arch: str
    key: str
    log: str = field(repr=False)
    functions: tuple[FunctionInfo, ...]
    compile_seconds: float
    cache: Literal["memory", "disk", "miss"]
    path: Path | None


class CompileError(RuntimeError):
    """NVRTC rejected a source. attnlang generated it, so this is an attnlang bug.

    Attributes: ``log`` (NVRTC's log), ``source`` (the full source), ``dump_path`` (where
    the numbered source was written), ``key`` and ``arch``.
    """

    def __init__(self, message: str, *, log: str, source: str, dump_path: Path | None,
                 key: str, arch: str):
        super().__init__(message)
        self.log = log
        self.source = source
        self.dump_path = dump_path
        self.key = key
        self.arch = arch


class ToolchainError(RuntimeError):
    """NVRTC or the CUDA headers are missing; the message says what was tried and the fix."""


# ---------------------------------------------------------------------------- toolchain


@functools.lru_cache(maxsize=1)
def _nvrtc() -> Any:
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
    major, minor = _nvrtc().getVersion()
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


# ---------------------------------------------------------------------------- arch


def resolve_arch(arch: str | None = None) -> str:
    """The target architecture: `arch` if given, else ``ATTNLANG_ARCH``, else the current
    GPU's (compute capability 9.0 -> "sm_90a", to get Hopper's wgmma/TMA). Validated.

    Raises ValueError for a malformed arch or when there is nothing to go on.
    Example: ``resolve_arch("sm_80") == "sm_80"``.
    """
    origin = "arch"
    if arch is None:
        arch, origin = env.arch(), "ATTNLANG_ARCH"
    if arch is None:
        arch, origin = _detect_gpu_arch(), "the current GPU"
    if arch is None:
        raise ValueError(
            "no target architecture: pass one (arch='sm_90a' in Python, --arch sm_90a on "
            "the command line) or set ATTNLANG_ARCH=sm_90a; there is no GPU to ask"
        )
    return _check_arch(arch, origin)


def _check_arch(arch: str, origin: str) -> str:
    m = _ARCH_RE.fullmatch(arch)
    if m is None:
        hint = _suggest_arch(arch)
        raise ValueError(
            f"{origin} {arch!r} is not a CUDA architecture: expected 'sm_' followed by the "
            "compute capability and an optional 'a', e.g. 'sm_90a' (H100) or 'sm_80' (A100)"
            + (f"; did you mean {hint!r}?" if hint else "")
        )
    cc, suffix = int(m.group(1)), m.group(2)
    # Arch-specific ('a') targets exist from Hopper on, family ('f') targets from Blackwell.
    if (suffix == "a" and cc < 90) or (suffix == "f" and cc < 100):
        raise ValueError(
            f"{origin} {arch!r}: the '{suffix}' suffix needs compute capability "
            f"{'9.0' if suffix == 'a' else '10.0'} or newer; use 'sm_{cc}'"
        )
    if cc < 80:
        # The kernels use bf16 tensor-core mma and cp.async, which start with Ampere.
        raise ValueError(
            f"{origin} {arch!r}: attnlang's kernels need compute capability 8.0 or newer "
            "(bf16 tensor cores, cp.async): use sm_80 (A100), sm_86/sm_89 (RTX 30/40) or "
            "sm_90a (H100)")
    return arch


def _suggest_arch(arch: str) -> str | None:
    """'sm_90a' for '90a', '9.0', 'compute_90a', 'SM90A'; None if nothing sensible."""
    m = re.fullmatch(r"(?:sm|compute)?_?(\d{1,2})\.?(\d)([af]?)", arch.strip().lower())
    return f"sm_{m.group(1)}{m.group(2)}{m.group(3)}" if m else None


def _detect_gpu_arch() -> str | None:
    """The current GPU's arch, or None without cupy, a driver or a GPU."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        cc = str(cupy.cuda.Device().compute_capability)
    except Exception:  # no cupy, no driver, no device: all mean "no GPU to ask"
        return None
    # Only Hopper gets its arch-specific target: the templates use sm_90a-only instructions
    # (wgmma, TMA) there and portable code everywhere else.
    return "sm_90a" if cc == "90" else f"sm_{cc}"


def _check_supported(arch: str) -> None:
    """A clear ValueError for an arch this NVRTC cannot target (its own error is cryptic)."""
    try:
        supported = tuple(int(c) for c in _nvrtc().getSupportedArchs())
    except Exception:  # binding without the query: let NVRTC itself judge
        return
    cc = int(_ARCH_RE.fullmatch(arch).group(1))
    if cc not in supported:
        major, minor = nvrtc_version()
        raise ValueError(
            f"NVRTC {major}.{minor} cannot compile for {arch}; it supports "
            + ", ".join(f"sm_{c}" for c in supported)
            + ". Use another arch or a newer NVRTC."
        )


# ---------------------------------------------------------------------------- ptxas report

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_REGS_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_ptxas_report(log: str) -> tuple[FunctionInfo, ...]:
    """The entry functions of a ``-Xptxas=-v`` log, in the order ptxas compiled them.

    Example: a log with ``Compiling entry function 'k'``, ``0 bytes stack frame, 0 bytes
    spill stores, 0 bytes spill loads`` and ``Used 10 registers, ... 512 bytes smem`` gives
    ``(FunctionInfo("k", 10, 0, 0, 0, 512),)``.
    """
    entries: dict[str, dict[str, int]] = {}
    frames: dict[str, tuple[int, int, int]] = {}
    entry = props = None
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            entry = m.group(1)
            entries[entry] = {"registers": 0, "shared_bytes": 0}
        elif m := _PROPS_RE.search(line):
            props = m.group(1)  # may be a non-inlined device function, not an entry
        elif (m := _FRAME_RE.search(line)) and props is not None:
            frames[props] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _REGS_RE.search(line)) and entry is not None:
            entries[entry]["registers"] = int(m.group(1))
            if s := _SMEM_RE.search(line):
                entries[entry]["shared_bytes"] = int(s.group(1))
    infos = []
    for name, used in entries.items():
        stack, stores, loads = frames.get(name, (0, 0, 0))
        infos.append(FunctionInfo(name, used["registers"], stack, stores, loads,
                                  used["shared_bytes"]))
    return tuple(infos)


# ---------------------------------------------------------------------------- compile


def compile_source(source: str, arch: str | None = None, *, name: str = "kernel.cu",
                   options: Sequence[str] = (), label: str | None = None) -> Cubin:
    """Compile a self-contained CUDA C++ source to a cubin for `arch`, through the caches.

    `arch` is like "sm_90a" or "sm_80"; None means ``ATTNLANG_ARCH``, else the current
    GPU's (see `resolve_arch`). `name` is the program name NVRTC reports errors against;
    `options` are extra NVRTC options (``-std=c++17``, ``-arch``, the include path and
    ``-Xptxas=-v`` are always passed); `label` names the kernel in progress lines, the
    cache listing and dumps (default: `name`).

    Raises ValueError for a bad arch or options, ToolchainError when NVRTC or the CUDA
    headers are missing, CompileError when NVRTC rejects the source.

    Example::

        cubin = compile_source(src, "sm_90a", label="softcap decode bf16 d128")
        cubin.functions[0].registers, cubin.cache   # e.g. (96, "miss")
    """
    arch = resolve_arch(arch)
    options = _check_options(options)
    label = label or name
    chain = toolchain()
    include_dirs = list(chain.include_dirs)
    key = cache_key(source, arch, (*_BASE_OPTIONS, *options), chain.fingerprint)
    _dump_debug(label, key, source=source)

    cubin = cache.memory_get(key)
    if cubin is not None:
        cubin = replace(cubin, cache="memory")
    else:
        cubin = _from_disk(key)
        if cubin is None:
            with _lock(key):
                # Another process may have built it while we waited for the lock.
                cubin = _from_disk(key)
                if cubin is None:
                    cubin = _compile(source, arch, name, options, label, key, include_dirs)
        cache.memory_put(key, cubin)
    _dump_debug(label, key, cubin=cubin)
    return cubin


def _check_options(options: Sequence[str]) -> tuple[str, ...]:
    if isinstance(options, str):
        raise ValueError(f"options must be a sequence of strings, not the string {options!r}")
    options = tuple(options)
    for o in options:
        if o.split("=")[0] in _ARCH_OPTIONS:
            raise ValueError(f"pass the target as arch=..., not as the option {o!r}")
    return options


def _compile(source: str, arch: str, name: str, options: tuple[str, ...], label: str,
             key: str, include_dirs: list[str]) -> Cubin:
    """Run NVRTC and store the result on disk (the caller holds the key's lock)."""
    _check_supported(arch)
    nvrtc = _nvrtc()
    all_options = [f"-arch={arch}", *_BASE_OPTIONS,
                   *(f"--include-path={d}" for d in include_dirs), *options]
    _progress(f"attnlang: compiling {label} for {arch} ...")
    start = time.perf_counter()
    program = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(program, all_options)
        except nvrtc.NVRTCError as e:
            raise _compile_error(e, nvrtc.getProgramLog(program), source, arch, label, key,
                                 all_options) from None
        data = _cubin_bytes(nvrtc, program)
        log = nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
    seconds = time.perf_counter() - start
    _progress(f"attnlang: compiled {label} in {seconds:.2f} s")

    functions = parse_ptxas_report(log)
    meta = {"arch": arch, "label": label, "log": log, "compile_seconds": seconds,
            "functions": [asdict(f) for f in functions], "toolchain": toolchain_fingerprint()}
    try:
        path: Path | None = cache.write_entry(key, meta, data)
    except OSError as e:
        _warn_no_disk(e)
        path = None
    return Cubin(data=data, arch=arch, key=key, log=log, functions=functions,
                 compile_seconds=seconds, cache="miss", path=path)


def _cubin_bytes(nvrtc, program) -> bytes:
    """The whole cubin of a compiled program.

    CuPy's getCUBIN treats the buffer as a C string and drops its last byte (the cubin then
    still loads, but tools such as cuobjdump reject it). Ask NVRTC itself for the size and
    the bytes, through the library CuPy already loaded; fall back to CuPy's copy elsewhere.
    """
    data = bytes(nvrtc.getCUBIN(program))
    lib = _loaded_nvrtc()
    if lib is None:
        return data
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(program), ctypes.byref(size)) != 0:
        return data
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(ctypes.c_void_p(program), buf) != 0:
        return data
    return buf.raw


@functools.lru_cache(maxsize=1)
def _loaded_nvrtc():
    """ctypes handle on the libnvrtc this process loaded (Linux: from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libnvrtc.so" in line
                     and "builtins" not in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _compile_error(error: Exception, log: str, source: str, arch: str, label: str, key: str,
                   options: list[str]) -> CompileError:
    major, minor = nvrtc_version()
    header = (f"attnlang: NVRTC {major}.{minor} failed to compile {label} for {arch}\n"
              f"options: {' '.join(options)}\n\n{log}")
    try:
        dump_path: Path | None = cache.dump_failed(key, source, header)
        where = f"the dumped source: {dump_path}"
    except OSError:
        dump_path, where = None, "the source (it could not be dumped)"
    log_text = "\n".join(f"  {line}" for line in log.strip().splitlines())
    message = (f"NVRTC failed to compile {label} for {arch} ({error}).\n"
               f"This is a bug in attnlang; please report it with {where}\n"
               f"NVRTC log:\n{log_text}")
    return CompileError(message, log=log, source=source, dump_path=dump_path, key=key,
                        arch=arch)


def _from_disk(key: str) -> Cubin | None:
    hit = cache.read_entry(key)
    if hit is None:
        return None
    meta, data, path = hit
    try:
        functions = tuple(FunctionInfo(**f) for f in meta["functions"])
        return Cubin(data=data, arch=meta["arch"], key=key, log=meta["log"],
                     functions=functions, compile_seconds=float(meta["compile_seconds"]),
                     cache="disk", path=path)
    except (KeyError, TypeError, ValueError):
        # Verified bytes in a shape this version does not write: rebuild rather than guess.
        path.unlink(missing_ok=True)
        return None


def _lock(key: str):
    """The key's cross-process lock, or no lock when the cache directory is unusable."""
    try:
        cache.cache_dir().mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _warn_no_disk(e)
        return contextlib.nullcontext()
    return cache.locked(key)


def _warn_no_disk(error: OSError) -> None:
    warnings.warn(
        f"attnlang: cannot use the kernel cache at {cache.cache_dir()} ({error}); compiled "
        "kernels will not persist. Set ATTNLANG_CACHE_DIR to a writable directory.",
        RuntimeWarning, stacklevel=3,
    )


def _progress(line: str) -> None:
    if not env.quiet():
        print(line, file=sys.stderr, flush=True)


def _dump_debug(label: str, key: str, *, source: str | None = None,
                cubin: Cubin | None = None) -> None:
    """With ATTNLANG_DUMP_DIR set, write the source (before compiling, so failures are
    there too) and then the cubin and ptxas log as ``<label>-<key prefix>.{cu,cubin,log}``."""
    directory = env.dump_dir()
    if directory is None:
        return
    stem = f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', label.removesuffix('.cu'))}-{key[:12]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if source is not None:
            (directory / f"{stem}.cu").write_text(source)
        if cubin is not None:
            (directory / f"{stem}.cubin").write_bytes(cubin.data)
            (directory / f"{stem}.log").write_text(cubin.log)
    except OSError as e:
        warnings.warn(f"attnlang: cannot write to ATTNLANG_DUMP_DIR={directory} ({e})",
                      RuntimeWarning, stacklevel=3)
