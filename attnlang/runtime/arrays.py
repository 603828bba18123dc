"""Arrays at the runtime's edge: what the caller passes in, what goes back, which stream.

attnlang launches raw kernels, so all it needs of an array is a device pointer, a shape, a
dtype and the strides; `describe` reads those from a CuPy array, a PyTorch tensor, anything
with ``__cuda_array_interface__`` or DLPack, or a NumPy array, without copying and without
touching the GPU. The pure validation code (attention.validate_run_inputs) works on these
descriptions, so it runs and is tested on machines without a GPU.

bfloat16: PyTorch tensors carry it natively. CuPy has a bfloat16 dtype only when the
``ml_dtypes`` package is installed; without it, pass bf16 data to attnlang as a uint16 CuPy
array holding the bits (`float_to_bfloat16_bits` makes them) and outputs come back the same
way.

Torch is optional: it is never imported here; a tensor's own module is used when one is
passed in.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ATTENTION_DTYPES", "TensorInfo", "normalize_dtype", "normalize_kv_dtype", "describe",
    "is_torch_tensor",
    "is_device_array", "host_int_array", "current_stream", "empty_output",
    "to_device_param", "float_to_bfloat16_bits", "bfloat16_bits_to_float", "round_to_dtype",
    "cupy_bfloat16", "read_array", "signature", "data_ptr", "current_stream_ptr",
]

# The activation dtypes of the attention kernels, by canonical name -> element bytes.
ATTENTION_DTYPES = {"float16": 2, "bfloat16": 2}
_ALIASES = {
    "float16": "float16", "fp16": "float16", "half": "float16", "f2": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


def normalize_dtype(dtype: Any, name: str = "dtype") -> str:
    """The attention dtype's canonical name, "float16" or "bfloat16".

    Accepts those names, the aliases "fp16"/"half"/"bf16", and NumPy, CuPy or torch dtypes.
    Example: ``normalize_dtype(torch.bfloat16) == normalize_dtype("bf16") == "bfloat16"``.
    """
    text = _dtype_name(dtype)
    canonical = _ALIASES.get(text.lower()) if text is not None else None
    if canonical is None:
        raise ValueError(
            f"{name} must be float16 or bfloat16 (aliases fp16, half, bf16, or a NumPy/CuPy/"
            f"torch dtype), got {dtype!r}"
        )
    return canonical


_KV_FP8_ALIASES = ("float8_e4m3fn", "fp8", "e4m3", "fp8_e4m3", "float8_e4m3")


def normalize_kv_dtype(kv_dtype: Any, dtype: str) -> str:
    """The KV cache's element type: `dtype` (q's, already normalised) for None or any name of
    it, or "float8_e4m3fn" (aliases fp8, e4m3, fp8_e4m3, float8_e4m3, torch.float8_e4m3fn).

    Example: ``normalize_kv_dtype("fp8", "bfloat16") == "float8_e4m3fn"``.
    """
    if kv_dtype is None:
        return dtype
    text = _dtype_name(kv_dtype)
    if text is not None and text.lower() in _KV_FP8_ALIASES:
        return "float8_e4m3fn"
    if text is not None and _ALIASES.get(text.lower()) == dtype:
        return dtype
    raise ValueError(
        f"kv_dtype must be q's dtype ({dtype}) or float8_e4m3fn (aliases fp8, e4m3, "
        f"torch.float8_e4m3fn), got {kv_dtype!r}")


def _dtype_name(dtype: Any) -> str | None:
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    if type(dtype).__module__.startswith("torch"):  # torch.dtype: str() is "torch.float16"
        return str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return None


@dataclass(frozen=True)
class TensorInfo:
    """What the runtime needs to know of one array: no data, no GPU calls.

    kind: "cupy", "torch", "numpy" (host), "torch-cpu" (host) or "other" (a device array seen
    through ``__cuda_array_interface__`` / DLPack, viewed as CuPy). dtype is a NumPy-style name
    ("float16", "bfloat16", "uint16", "float32", "int32", ...). strides are in elements.
    device is the CUDA device ordinal, None for host memory. `obj` is the caller's object
    (kept alive while in use; excluded from equality).

    Example: ``TensorInfo((8, 32, 128), "bfloat16", kind="torch", device=0)`` describes a
    contiguous CUDA tensor (strides default to C order).
    """

    shape: tuple[int, ...]
    dtype: str
    kind: str = "cupy"
    device: int | None = 0
    strides: tuple[int, ...] | None = None
    ptr: int = 0
    obj: Any = None

    def __post_init__(self):
        if self.strides is None:
            object.__setattr__(self, "strides", _c_strides(self.shape))

    def __eq__(self, other):  # the caller's object is not part of the description
        if not isinstance(other, TensorInfo):
            return NotImplemented
        return (self.shape, self.dtype, self.kind, self.device, self.strides, self.ptr) == (
            other.shape, other.dtype, other.kind, other.device, other.strides, other.ptr)

    __hash__ = None  # type: ignore[assignment]

    @property
    def on_device(self) -> bool:
        return self.device is not None

    @property
    def contiguous(self) -> bool:
        """C-contiguous (dims of extent 1 may have any stride)."""
        expected = _c_strides(self.shape)
        pairs = zip(self.shape, self.strides, expected, strict=True)
        return all(n == 1 or s == e for n, s, e in pairs)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def type_name(self) -> str:
        return {"cupy": "CuPy array", "torch": "CUDA torch tensor", "numpy": "NumPy array",
                "torch-cpu": "CPU torch tensor", "other": "device array"}.get(self.kind, self.kind)


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


def is_torch_tensor(x: Any) -> bool:
    """True for a torch.Tensor, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cupy_array(x: Any) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def is_device_array(x: Any) -> bool:
    """True for arrays in GPU memory (CuPy, CUDA torch, CUDA array interface, CUDA DLPack)."""
    if _is_cupy_array(x):
        return True
    if is_torch_tensor(x):
        return bool(x.is_cuda)
    if hasattr(x, "__cuda_array_interface__"):
        return True
    if hasattr(x, "__dlpack_device__"):
        try:
            return x.__dlpack_device__()[0] in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, managed
        except Exception:
            return False
    return False


def describe(x: Any, name: str) -> TensorInfo:
    """The TensorInfo of any supported array, with no copy. Raises TypeError naming `name`.

    Example: ``describe(cupy.zeros((4, 2), cupy.float32), "lse").shape == (4, 2)``.
    A TensorInfo is returned as is (tests describe arrays without having them).
    """
    if isinstance(x, TensorInfo):
        return x
    if _is_cupy_array(x):
        item = x.dtype.itemsize
        return TensorInfo(tuple(x.shape), x.dtype.name, "cupy", int(x.device.id),
                          tuple(s // item for s in x.strides), int(x.data.ptr), x)
    if is_torch_tensor(x):
        dtype = str(x.dtype).removeprefix("torch.")
        if x.is_cuda:
            return TensorInfo(tuple(x.shape), dtype, "torch", int(x.device.index),
                              tuple(x.stride()), int(x.data_ptr()), x)
        return TensorInfo(tuple(x.shape), dtype, "torch-cpu", None, tuple(x.stride()),
                          int(x.data_ptr()), x)
    if isinstance(x, np.ndarray):
        item = x.dtype.itemsize
        strides = tuple(s // item for s in x.strides) if item else None
        return TensorInfo(tuple(x.shape), x.dtype.name, "numpy", None, strides,
                          int(x.ctypes.data), x)
    if is_device_array(x):
        import cupy

        try:
            if hasattr(x, "__cuda_array_interface__"):
                view = cupy.asarray(x)
            else:
                view = cupy.from_dlpack(x)
        except Exception as e:
            raise TypeError(
                f"{name}: could not view this {type(x).__name__} as a device array without a "
                f"copy ({e}); pass a CuPy array or a torch tensor"
            ) from None
        info = describe(view, name)
        return TensorInfo(info.shape, info.dtype, "other", info.device, info.strides,
                          info.ptr, view)
    raise TypeError(
        f"{name} must be an array (CuPy, torch, NumPy or anything with "
        f"__cuda_array_interface__ / DLPack), got {type(x).__name__}"
    )


# -- the per-call fast path of run(): what an array is, apart from where it is

# type -> reader(x) -> (signature, pointer), made on first sight of each array type; None for
# types without a fast path.
_READERS: dict[type, Any] = {}


def _reader(t: type):
    if t is TensorInfo:
        return lambda x: ((t, x.shape, x.strides, x.dtype, x.kind, x.device), x.ptr)
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(t, torch.Tensor):
        # get_device() is the CUDA ordinal, -1 on the CPU: validation rejects the latter.
        return lambda x: ((t, x.shape, x.stride(), x.dtype, x.get_device()), x.data_ptr())
    cupy = sys.modules.get("cupy")
    if cupy is not None and issubclass(t, cupy.ndarray):
        return lambda x: ((t, x.shape, x.strides, x.dtype, x.device.id), x.data.ptr)
    return None  # host arrays (contents may change), foreign device arrays: no fast path


def read_array(x: Any) -> tuple[tuple, int] | None:
    """(signature, pointer) of a CuPy array, torch tensor or TensorInfo; None for anything
    else. The signature is everything run()'s validation reads of an array except its
    address (type, shape, strides, dtype, device), as a hashable tuple: two arrays with one
    signature pass or fail validation alike, so run() validates a signature once and later
    reads only the pointer.

    Example: ``read_array(torch.empty(4, 8, device="cuda"))`` ->
    ``((torch.Tensor, torch.Size([4, 8]), (8, 1), torch.float32, 0), 0x7f...)``.
    """
    t = type(x)
    try:
        reader = _READERS[t]
    except KeyError:
        reader = _READERS[t] = _reader(t)
    return None if reader is None else reader(x)


def signature(x: Any) -> tuple | None:
    """The signature part of `read_array` (None where it is None)."""
    read = read_array(x)
    return None if read is None else read[0]


def data_ptr(x: Any) -> int:
    """The device address of an array that has a signature (CuPy, torch, TensorInfo)."""
    return read_array(x)[1]


def current_stream_ptr(torch_inputs: bool, device: int) -> int:
    """The raw handle of the caller's current stream on `device`: torch's when the inputs are
    torch tensors, else CuPy's. Cheaper than `current_stream` (no stream object)."""
    if torch_inputs:
        torch = sys.modules["torch"]
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what inductor calls
        if raw is not None:
            return int(raw(device))
        return int(torch.cuda.current_stream(device).cuda_stream)
    import cupy

    return int(cupy.cuda.get_current_stream().ptr)


def host_int_array(x: Any, name: str) -> np.ndarray:
    """A 1-D host integer array from NumPy, a list, or a device array (copied once). int64.

    Raises ValueError/TypeError naming `name`. Example: ``host_int_array([0, 2], "kv_indptr")``.
    """
    if is_torch_tensor(x):
        x = x.detach().cpu().numpy()
    elif _is_cupy_array(x):
        x = x.get()
    elif is_device_array(x):
        import cupy

        x = cupy.asnumpy(cupy.asarray(x) if hasattr(x, "__cuda_array_interface__")
                         else cupy.from_dlpack(x))
    try:
        a = np.asarray(x)
    except Exception as e:
        raise TypeError(f"{name} must be a 1-D array of integers: {e}") from None
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of integers, got shape {a.shape}")
    if a.size and (a.dtype == bool or not np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False) if a.size else np.zeros(0, dtype=np.int64)


def external_stream(ptr: int, device: int):
    """A raw CUDA stream handle on `device` as a CuPy stream, for CuPy launches there."""
    import cupy

    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream for raw handles
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr, device)


def current_stream(infos: list[TensorInfo], device: int):
    """The caller's current stream as a CuPy stream: torch's current stream on `device` if any
    input is a torch tensor (torch.cuda.current_stream), else CuPy's current stream."""
    import cupy

    if any(i.kind == "torch" for i in infos):
        torch = sys.modules["torch"]
        s = torch.cuda.current_stream(device)
        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None and hasattr(s, "__cuda_stream__"):
            return from_external(s)
        return external_stream(int(s.cuda_stream), device)
    return cupy.cuda.get_current_stream()


def cupy_bfloat16():
    """CuPy's bfloat16 dtype (needs ml_dtypes), or None when this CuPy has none."""
    try:
        import cupy

        return cupy.dtype("bfloat16")
    except TypeError:
        return None


def empty_output(like: TensorInfo, shape: tuple[int, ...], dtype: str) -> tuple[Any, TensorInfo]:
    """A new uninitialised array of `shape`/`dtype` in the caller's array type, on like's device.

    torch in -> torch.empty; otherwise CuPy (bfloat16 as uint16 bits if CuPy lacks the
    dtype). Returns (array, its TensorInfo).
    """
    if like.kind == "torch":
        torch = sys.modules["torch"]
        out = torch.empty(shape, dtype=getattr(torch, dtype), device=like.obj.device)
        return out, describe(out, "out")
    import cupy

    with cupy.cuda.Device(like.device):
        if dtype == "bfloat16":
            cp_dtype = cupy_bfloat16() if like.dtype == "bfloat16" else None
            out = cupy.empty(shape, dtype=cp_dtype if cp_dtype is not None else np.uint16)
        else:
            out = cupy.empty(shape, dtype=dtype)
    return out, describe(out, "out")


def to_device_param(host: np.ndarray, dtype: str, device: int) -> tuple[Any, TensorInfo]:
    """Copy a host tensor param to `device` as `dtype` (float32/int32), on the current stream."""
    import cupy

    with cupy.cuda.Device(device):
        arr = cupy.asarray(np.ascontiguousarray(host, dtype=dtype))
    return arr, describe(arr, "param")


def float_to_bfloat16_bits(x: Any) -> np.ndarray:
    """Round float values to bfloat16 (nearest even) and return the bits as uint16.

    Example: ``float_to_bfloat16_bits([1.0]) -> array([16256], dtype=uint16)`` (0x3F80).
    """
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded = np.where(nan, np.uint16(0x7FC0), rounded)
    return rounded


def bfloat16_bits_to_float(bits: Any) -> np.ndarray:
    """The float32 values of bfloat16 bits (uint16). Exact."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def round_to_dtype(x: Any, dtype: str) -> np.ndarray:
    """float32 values of x after rounding to the attention dtype (what the kernel sees)."""
    dtype = normalize_dtype(dtype)
    if dtype == "float16":
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)
    return bfloat16_bits_to_float(float_to_bfloat16_bits(x))
