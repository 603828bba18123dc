"""An fp8 KV cache's scales as run() takes them (`k_scale=`, `v_scale=`) and as the kernels
read them: the module's last two params, float32 [num_kv_heads] device arrays
(`ir.KV_SCALE_PARAMS`). A float scale becomes such an array once per distinct value and is
kept for the BatchAttention's life, so a CUDA graph captured after a call with that value
holds a buffer that never moves. A one-element device array (a per-tensor scale kept on the
device, as serving engines keep theirs) is copied into a buffer [num_kv_heads] of the
BatchAttention's on the call's stream, before the kernels: they see its value at the time
they run, and a CUDA graph replays the copy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnlang import ir
from attnlang.codegen.config import KV_FP8
from attnlang.runtime.arrays import (
    current_stream_ptr,
    describe,
    external_stream,
    is_device_array,
    is_torch_tensor,
)
from attnlang.runtime.validate import AttentionShape

__all__ = ["KvScales"]


class KvScales:
    """The scales of one BatchAttention's fp8 cache on `device`."""

    def __init__(self, shape: AttentionShape, device: int):
        self.shape, self.device = shape, device
        self._arrays: dict[float, Any] = {}  # float scale -> its device array
        # (buffer [2 n], its k and v views by name, the copy kernel): made at the first call
        # with a one-element scale
        self._per_head: tuple | None = None

    def merge(self, params: Mapping[str, Any] | None, k_scale: Any, v_scale: Any,
              q: Any) -> dict:
        """params with k_scale and v_scale added as the module's params (float[kv_heads]):
        a float as a device array of that value per KV head, a one-element device array as
        the buffer it is copied into (`_broadcast`), a device array [num_kv_heads] as it is.
        Raises TypeError where the cache is not fp8, a scale is missing, or params already
        hold one; ValueError for a new float value while a graph is being captured."""
        if self.shape.kv_dtype != KV_FP8:
            raise TypeError(f"k_scale and v_scale are for an fp8 KV cache; this BatchAttention's "
                            f"cache is {self.shape.kv_dtype} (build it with kv_dtype='fp8')")
        if k_scale is None or v_scale is None:
            missing = "k_scale" if k_scale is None else "v_scale"
            raise TypeError(f"an fp8 KV cache needs k_scale and v_scale (missing {missing}): a "
                            "float, or a float32 device array [num_kv_heads] or of one element; "
                            "1.0 for values stored unscaled")
        params = {} if params is None else params
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be a dict of the variant's params, got "
                            f"{type(params).__name__}")
        clash = [n for n in ir.KV_SCALE_PARAMS if n in params]
        if clash:
            raise TypeError(f"pass {clash[0]} as run()'s {clash[0]}= argument, not in params")
        merged = dict(params)
        sources: dict[str, int] = {}  # one-element device scales: name -> address
        for name, value in zip(ir.KV_SCALE_PARAMS, (k_scale, v_scale), strict=True):
            if isinstance(value, (int, float, np.integer, np.floating)):
                value = self._array(name, value, q)
            elif self.shape.num_kv_heads > 1 and _one_element(value):
                sources[name] = self._address(name, describe(value, name))
                value = None  # its buffer, below
            merged[name] = value
        if sources:
            buffers = self._broadcast(sources, q)
            for name in sources:
                merged[name] = buffers[name]
        return merged

    def _address(self, name: str, info: Any) -> int:
        """A one-element scale's device address, checked."""
        if info.dtype != "float32":
            raise TypeError(f"{name} must be float32, got a {info.dtype} device array")
        if info.device != self.device:
            raise ValueError(f"{name} is on device {info.device}, the cache on {self.device}")
        return int(info.ptr)

    def _broadcast(self, sources: dict[str, int], q: Any) -> dict[str, Any]:
        """Copies the one-element scales at `sources` to every KV head of the BatchAttention's
        buffer, on the call's stream (one small kernel, kernels_templates/kv_scales.cu), and
        returns the buffer's [num_kv_heads] views by name."""
        import cupy

        from attnlang.runtime.module import template_module

        n = self.shape.num_kv_heads
        stream = current_stream_ptr(is_torch_tensor(q), self.device)
        with cupy.cuda.Device(self.device):
            if self._per_head is None:
                if cupy.cuda.runtime.streamIsCapturing(stream):
                    raise ValueError(
                        f"{next(iter(sources))} is a one-element device array, whose buffer "
                        "[num_kv_heads] is made at the first call: run once with it before "
                        "capturing a CUDA graph")
                buffer = cupy.empty(2 * n, dtype=np.float32)
                kernel = template_module("kv_scales.cu", self.device).get_function(
                    "broadcast_kv_scales")
                self._per_head = (buffer, {ir.KV_SCALE_PARAMS[0]: buffer[:n],
                                           ir.KV_SCALE_PARAMS[1]: buffer[n:]}, kernel)
            buffer, views, kernel = self._per_head
            k, v = (np.uint64(sources.get(name, 0)) for name in ir.KV_SCALE_PARAMS)
            kernel((1,), (32 * -(-n // 32),), (k, v, buffer, np.int32(n)),
                   stream=external_stream(stream, self.device))
        return views

    def _array(self, name: str, value: Any, q: Any):
        """The device array [num_kv_heads] of a float scale (one per distinct value: a model
        has a few per layer)."""
        if isinstance(value, bool):
            raise TypeError(f"{name} must be a float or a float32 device array, got a bool")
        value = float(value)
        array = self._arrays.get(value)
        if array is None:
            import cupy

            stream = current_stream_ptr(is_torch_tensor(q), self.device)
            if cupy.cuda.runtime.streamIsCapturing(stream):
                raise ValueError(
                    f"{name}={value} is a new scale while a CUDA graph is being captured: pass a "
                    "float32 device array, or run once with this value before capturing")
            with cupy.cuda.Device(self.device):
                array = cupy.full(self.shape.num_kv_heads, value, dtype=np.float32)
                # filled on CuPy's stream: done before any stream's kernel reads it
                cupy.cuda.get_current_stream().synchronize()
            self._arrays[value] = array
        return array


def _one_element(x: Any) -> bool:
    """Whether x is a device array of one element (cheap: run() asks on every call)."""
    n = x.numel() if is_torch_tensor(x) else getattr(x, "size", None)
    return n == 1 and is_device_array(x)

