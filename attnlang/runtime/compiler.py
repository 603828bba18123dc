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
import re
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from attnlang import env
from attnlang.runtime import cache
from attnlang.runtime.cache import (
    cache_dir,
    cache_key,
    clear_cache,
    clear_memory_cache,
    list_entries,
)
from attnlang.runtime.toolchain import (
    Toolchain,
    ToolchainError,
    cuda_include_dirs,
    nvrtc_module,
    nvrtc_version,
    toolchain,
    toolchain_fingerprint,
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
        supported = tuple(int(c) for c in nvrtc_module().getSupportedArchs())
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
    nvrtc = nvrtc_module()
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
