"""merge_states: the exact merge of two attention states (o, lse).

Attention over a key set split in two, A and B, is recovered exactly from the two halves:
``lse = log(exp(lse_a) + exp(lse_b))`` and ``o = (exp(lse_a) o_a + exp(lse_b) o_b) /
exp(lse)``. This is how split-KV partial results, or a shared prefix's state and a
request's own suffix state (cascade attention), are combined. The kernel is
kernels_templates/merge_states.cu, compiled through the attnlang compiler (cached) for the
current GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnlang.runtime.arrays import TensorInfo, current_stream, describe, empty_output

__all__ = ["merge_states", "validate_merge_inputs", "merge_states_reference"]

_O_DTYPES = ("float16", "bfloat16", "float32")
_WARPS_PER_BLOCK = 4
_MAX_BLOCKS = 65535  # the kernel loops over rows past this



def validate_merge_inputs(o_a: Any, lse_a: Any, o_b: Any,
                          lse_b: Any) -> tuple[TensorInfo, TensorInfo, TensorInfo, TensorInfo,
                                               str]:
    """Check merge_states' inputs; return their descriptions and the kernel dtype
    ("float16" | "bfloat16" | "float32"). Pure (no GPU). Raises ValueError/TypeError naming
    the argument."""
    infos = []
    for name, x in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        info = describe(x, name)
        if not info.on_device:
            raise TypeError(f"{name} must be a device array (CuPy or a CUDA torch tensor), got a "
                            f"{info.type_name()}")
        if not info.contiguous:
            raise ValueError(f"{name} must be contiguous")
        infos.append(info)
    oa, la, ob, lb = infos
    if len(oa.shape) != 3:
        raise ValueError(f"o_a must have shape [N, num_heads, head_dim], got {oa.shape}")
    if ob.shape != oa.shape:
        raise ValueError(f"o_b must have the shape of o_a {oa.shape}, got {ob.shape}")
    for name, info in (("lse_a", la), ("lse_b", lb)):
        if info.shape != oa.shape[:2]:
            raise ValueError(f"{name} must have shape [N, num_heads] = {oa.shape[:2]}, got "
                             f"{info.shape}")
        if info.dtype != "float32":
            raise TypeError(f"{name} must be float32 (natural log), got {info.dtype}")
    if ob.dtype != oa.dtype:
        raise TypeError(f"o_b has dtype {ob.dtype} but o_a has {oa.dtype}; they must match")
    dtype = oa.dtype
    if dtype == "uint16" and oa.kind != "torch":
        dtype = "bfloat16"  # CuPy without ml_dtypes: bf16 bits (arrays.py)
    if dtype not in _O_DTYPES:
        raise TypeError(f"o_a must be float16, bfloat16 or float32, got {oa.dtype}")
    for name, info in (("lse_a", la), ("o_b", ob), ("lse_b", lb)):
        if info.device != oa.device:
            raise ValueError(f"{name} is on device {info.device} but o_a is on device "
                             f"{oa.device}")
    return oa, la, ob, lb, dtype


def merge_states(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """Merge two attention states over disjoint key sets into the state over their union.

    o_a, o_b: [N, num_heads, head_dim] float16 / bfloat16 / float32 (same dtype);
    lse_a, lse_b: [N, num_heads] float32, natural log, -inf for a state over no keys.
    CuPy arrays or CUDA torch tensors; returns (o, lse) of the same type, o in the inputs'
    dtype, on the caller's current stream. Two empty states give o = 0, lse = -inf.

    Example::

        o, lse = merge_states(o_prefix, lse_prefix, o_suffix, lse_suffix)
    """
    import cupy

    oa, la, ob, lb, dtype = validate_merge_inputs(o_a, lse_a, o_b, lse_b)
    n, h, d = oa.shape
    o, o_info = empty_output(oa, oa.shape, oa.dtype)
    lse, lse_info = empty_output(oa, (n, h), "float32")
    rows = n * h
    if rows == 0 or d == 0:
        return o, lse
    with cupy.cuda.Device(oa.device):
        fn = _function(oa.device, dtype)
        stream = current_stream([oa, la, ob, lb], oa.device)
        blocks = min(-(-rows // _WARPS_PER_BLOCK), _MAX_BLOCKS)
        ptr = np.uint64
        fn((blocks, 1, 1), (32 * _WARPS_PER_BLOCK, 1, 1),
           (ptr(oa.ptr), ptr(la.ptr), ptr(ob.ptr), ptr(lb.ptr), ptr(o_info.ptr),
            ptr(lse_info.ptr), np.int64(rows), np.int32(d)),
           stream=stream)
    return o, lse


def merge_states_reference(o_a: np.ndarray, lse_a: np.ndarray, o_b: np.ndarray,
                           lse_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same merge in NumPy float64 (the tests' oracle). Shapes as merge_states."""
    la = np.asarray(lse_a, dtype=np.float64)
    lb = np.asarray(lse_b, dtype=np.float64)
    m = np.maximum(la, lb)
    empty = np.isneginf(m)
    m_safe = np.where(empty, 0.0, m)
    wa = np.where(np.isneginf(la), 0.0, np.exp(la - m_safe))
    wb = np.where(np.isneginf(lb), 0.0, np.exp(lb - m_safe))
    total = wa + wb
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1.0, total)))
        wa_n = np.where(empty, 0.0, wa / np.where(empty, 1.0, total))[..., None]
        wb_n = np.where(empty, 0.0, wb / np.where(empty, 1.0, total))[..., None]
    oa = np.where(wa_n > 0, np.asarray(o_a, dtype=np.float64), 0.0)
    ob = np.where(wb_n > 0, np.asarray(o_b, dtype=np.float64), 0.0)
    return wa_n * oa + wb_n * ob, lse


def _function(device: int, dtype: str):
    from attnlang.runtime.module import template_module

    return template_module("merge_states.cu", device).get_function(f"merge_states_{dtype}")
