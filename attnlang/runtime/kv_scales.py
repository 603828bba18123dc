"""An fp8 KV cache's scales as run() takes them (`k_scale=`, `v_scale=`) and as the kernels
read them: the module's last two params, float32 [num_kv_heads] device arrays
(`ir.KV_SCALE_PARAMS`). A float scale becomes such an array once per distinct value and is
kept for the BatchAttention's life, so a CUDA graph captured after a call with that value
holds a buffer that never moves."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnlang import ir
from attnlang.codegen.config import KV_FP8
from attnlang.runtime.arrays import current_stream_ptr, is_torch_tensor
from attnlang.runtime.validate import AttentionShape

__all__ = ["KvScales"]


class KvScales:
    """The scales of one BatchAttention's fp8 cache on `device`."""

    def __init__(self, shape: AttentionShape, device: int):
        self.shape, self.device = shape, device
        self._arrays: dict[float, Any] = {}  # float scale -> its device array

    def merge(self, params: Mapping[str, Any] | None, k_scale: Any, v_scale: Any,
              q: Any) -> dict:
        """params with k_scale and v_scale added as the module's params (float[kv_heads]):
        a float as a device array of that value per KV head, a device array as it is.
        Raises TypeError where the cache is not fp8, a scale is missing, or params already
        hold one; ValueError for a new float value while a graph is being captured."""
        if self.shape.kv_dtype != KV_FP8:
            raise TypeError(f"k_scale and v_scale are for an fp8 KV cache; this BatchAttention's "
                            f"cache is {self.shape.kv_dtype} (build it with kv_dtype='fp8')")
        if k_scale is None or v_scale is None:
            missing = "k_scale" if k_scale is None else "v_scale"
            raise TypeError(f"an fp8 KV cache needs k_scale and v_scale (missing {missing}): a "
                            "float, or a float32 device array [num_kv_heads]; 1.0 for values "
                            "stored unscaled")
        params = {} if params is None else params
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be a dict of the variant's params, got "
                            f"{type(params).__name__}")
        clash = [n for n in ir.KV_SCALE_PARAMS if n in params]
        if clash:
            raise TypeError(f"pass {clash[0]} as run()'s {clash[0]}= argument, not in params")
        merged = dict(params)
        for name, value in zip(ir.KV_SCALE_PARAMS, (k_scale, v_scale), strict=True):
            is_number = isinstance(value, (int, float, np.integer, np.floating))
            merged[name] = self._array(name, value, q) if is_number else value
        return merged

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
