"""run()'s per-call path in C (hostpath.c), built on first use with the host's C compiler.

A run() call whose signature was validated before (see BatchAttention.run) spends most of
its Python time reading arrays and packing arguments; `FastRun` does that in C and launches.
It is built the way Triton builds its launchers: the C compiler Python was built with, the
Python headers, ``-O2 -shared``, once per machine, into the kernel cache directory under a
name holding the source's hash and Python's ABI tag. Without a compiler or the headers, or
with ``ATTNLANG_HOST_PATH=python``, run() keeps its Python path (same checks, more host time)
and `unavailable_reason()` says why.

    module = hostpath.load()          # None: Python path
    fast = module.FastRun(...)        # see hostpath.c for the arguments
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import threading
import warnings
from pathlib import Path
from types import ModuleType

from .. import env

SOURCE = Path(__file__).with_name("hostpath.c")
# The driver entry points FastRun calls, in its order (cuGetErrorName only names errors;
# cuLaunchKernelEx, CUDA 11.8+, the dependent launches of sm_90+ modules).
DRIVER_FUNCTIONS = ("cuLaunchKernel", "cuStreamIsCapturing", "cuCtxGetCurrent",
                    "cuEventRecord", "cuGetErrorName", "cuLaunchKernelEx")

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_reason: str | None = None


def load() -> ModuleType | None:
    """The compiled module (built on the first call of a process), or None when run() must
    use its Python path: ATTNLANG_HOST_PATH=python (read at each call: a BatchAttention
    made while it is set keeps the Python path), or no build (warned once, with why)."""
    if env.host_path() == "python":
        return None
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _load_or_explain()
        return _loaded["module"]


def unavailable_reason() -> str | None:
    """Why `load()` returns None now (None if it does not, or was not called yet)."""
    if env.host_path() == "python":
        return "ATTNLANG_HOST_PATH=python"
    return _reason


def built_path() -> Path:
    """Where the compiled module for this source and this Python lives (may not exist)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return env.cache_dir() / "host" / f"hostpath-{digest}{suffix}"


def _load_or_explain() -> ModuleType | None:
    global _reason
    try:
        path = built_path()
        if not path.exists():
            _build(path)
        return _import(path)
    except (OSError, subprocess.SubprocessError, ImportError) as exc:
        _reason = str(exc)
        warnings.warn(f"attnlang: run() takes its Python path (about 2x the host time per "
                      f"call) because its C path could not be built: {_reason}. Install a C "
                      "compiler and Python's headers, or set ATTNLANG_HOST_PATH=python to "
                      "choose the Python path and silence this.", RuntimeWarning, stacklevel=3)
        return None


def _build(target: Path) -> None:
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise OSError(f"Python's headers are missing (no Python.h in {include})")
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    command = [*compiler, "-O2", "-shared", "-fPIC", f"-I{include}", str(SOURCE),
               "-o", str(temporary)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-5:])
            raise OSError(f"`{shlex.join(command)}` failed:\n{tail}")
        os.replace(temporary, target)  # atomic: concurrent builders each write their own
    finally:
        temporary.unlink(missing_ok=True)


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("_hostpath", str(path))
    spec = importlib.util.spec_from_file_location("_hostpath", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.cache
def libcuda() -> ctypes.CDLL:
    """The CUDA driver library (the one CuPy loaded)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so")


@functools.cache
def driver_entry_points() -> tuple[int, ...]:
    """The addresses of DRIVER_FUNCTIONS in the CUDA driver library (0: not in this driver)."""
    lib = libcuda()
    return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
                 if hasattr(lib, name) else 0 for name in DRIVER_FUNCTIONS)


def current_context() -> int:
    """The calling thread's current CUDA context (0 if none): FastRun launches only while
    it is the one run() validated the call under."""
    get = libcuda().cuCtxGetCurrent
    context = ctypes.c_void_p()
    if get(ctypes.byref(context)) != 0:
        return 0
    return context.value or 0


TORCH, CUPY = 0, 1  # hostpath.c's array kinds


def fast_run(module: ModuleType, *, arrays, params, tensor_params=(), sm_scale, launches,
             device: int, waited: set, copy_stream: int, run_done: int,
             head_dim_vo: int | None = None):
    """A FastRun for one validated call of the current plan, or None where the C path does
    not take such calls (arrays other than torch tensors / CuPy arrays, or a mix; a device
    param that is neither).

    arrays: the call's q, k_cache, v_cache, out (None when run() allocated it); params: None
    or the call's params dict, of numbers and device arrays; tensor_params: ((index, name),
    ...) of its device arrays, index their place among the variant's params (CheckedCall's);
    launches: the plan's `launches.Launch`es, packed for this call; head_dim_vo: the
    output's head dim (None: q's).
    """
    kinds = {_array_kind(x) for x in arrays if x is not None}
    if len(kinds) != 1 or None in kinds:
        return None
    kind = kinds.pop()
    spec = None
    if params is not None:
        tensors = tuple((name, params[name], _array_kind(params[name]), index)
                        for index, name in tensor_params)
        if any(t[2] is None for t in tensors):
            return None
        names = {name for _, name in tensor_params}
        spec = (tuple((name, type(value), value) for name, value in params.items()
                      if name not in names), tensors)
    api = None
    if kind == TORCH:
        torch = sys.modules["torch"]
        # torch >= 2.10: arrays and the current stream read in C, without Python calls.
        api = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        stream_fn = (functools.partial(raw, device) if raw is not None
                     else lambda: torch.cuda.current_stream(device).cuda_stream)
        empty_like = torch.empty_like
    else:
        cupy = sys.modules["cupy"]
        stream_fn, empty_like = (lambda: cupy.cuda.get_current_stream().ptr), cupy.empty_like
    if head_dim_vo is not None and head_dim_vo != arrays[0].shape[-1]:
        # MLA: out is [total_q, heads, head_dim_vo], not like q (one more Python call).
        if kind == TORCH:
            def empty_like(q):
                return torch.empty((*q.shape[:2], head_dim_vo), dtype=q.dtype, device=q.device)
        else:
            def empty_like(q):
                return cupy.empty((*q.shape[:2], head_dim_vo), dtype=q.dtype)
    context = current_context()
    if not context:
        return None
    packed = tuple((launch.fn, launch.grid, launch.block, launch.smem, *launch.args.snapshot(),
                    launch.dependent) for launch in launches)
    return module.FastRun(kind, api, tuple(arrays), spec, sm_scale, packed, stream_fn,
                          empty_like, waited, context, copy_stream, run_done,
                          driver_entry_points())


def _array_kind(x) -> int | None:
    torch, cupy = sys.modules.get("torch"), sys.modules.get("cupy")
    if torch is not None and type(x) is torch.Tensor:
        return TORCH
    if cupy is not None and type(x) is cupy.ndarray:
        return CUPY
    return None
