"""run()'s calls: what a validated call keeps (`CheckedCall`), the key under which a later
call with the same signature reuses it (`describe_call`: shapes, dtypes, strides and params,
not addresses), and the outputs run() allocates when none is given.

A model's layers call run() with arrays of one signature, so BatchAttention validates a
signature once (attnlang.runtime.validate) and serves the rest from this key; the C path
(hostpath.c) takes over after that.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnlang import ir
from attnlang.runtime.arrays import _READERS, TensorInfo, empty_output, read_array

__all__ = ["CheckedCall", "describe_call", "misaligned", "empty_out", "empty_lse"]


@dataclass(frozen=True)
class CheckedCall:
    """What run() keeps of a validated call: params resolved in declaration order (device
    tensor params at tensor_params, re-read per call; host ones at host_params, uploaded per
    call), the softmax scale, and whether outputs are torch tensors."""

    torch_io: bool
    param_values: tuple[tuple[ir.ParamSpec, Any], ...]
    tensor_params: tuple[tuple[int, str], ...]
    host_params: tuple[int, ...]
    sm_scale: float
    # The first call's descriptions of q, k_cache, v_cache, out, lse (None where absent):
    # their pointers serve unmemoised calls.
    arrays: tuple[TensorInfo | None, ...] = ()


def describe_call(q: Any, kv_cache: Any, params: Any, out: Any, lse: Any,
                  sm_scale: Any) -> tuple[tuple, tuple[int, ...], dict[str, int]] | None:
    """(key, pointers, tensor_param_pointers) of one run() call; None when it must be
    validated in full: not a (k, v) pair, params not a dict, host-array params (contents
    may change), arrays other than CuPy / torch / TensorInfo.

    key: under which run() reuses a validation, made of each array's signature (everything
    validation reads but the address; `arrays.read_array`), each param's name, type and value
    (device tensors by signature), and sm_scale's type and value. pointers: q, k_cache,
    v_cache, out, lse (0 where absent).

    Example: two layers' calls ``(q1, (k1, v1), {"cap": 30.0})`` and
    ``(q2, (k2, v2), {"cap": 30.0})`` with equal shapes, dtypes and strides share a key.
    """
    if (type(kv_cache) is not tuple and type(kv_cache) is not list) or len(kv_cache) != 2:
        return None
    k_cache, v_cache = kv_cache
    try:  # the hot path: array types seen before (arrays._READERS holds their readers)
        rq, rk, rv = _READERS[type(q)](q), _READERS[type(k_cache)](k_cache), _READERS[
            type(v_cache)](v_cache)
    except (KeyError, TypeError):  # a type seen first, or one without a fast path (None)
        rq, rk, rv = read_array(q), read_array(k_cache), read_array(v_cache)
        if rq is None or rk is None or rv is None:
            return None
    ro = rl = (None, 0)
    if out is not None and (ro := read_array(out)) is None:
        return None
    if lse is not None and (rl := read_array(lse)) is None:
        return None
    tensor_ptrs: dict[str, int] = {}
    if params is None:
        pkey: tuple = ()
    elif type(params) is dict:
        items = []
        for name, value in params.items():
            kind = type(value)
            if kind is float or kind is int or isinstance(value, (np.floating, np.integer)):
                items.append((name, kind, value))  # the type: True == 1 but bool is an error
            else:
                read = read_array(value)
                if read is None:
                    return None
                items.append((name, read[0]))
                tensor_ptrs[name] = read[1]
        pkey = tuple(items)
    else:
        return None
    key = (rq[0], rk[0], rv[0], ro[0], rl[0], pkey, type(sm_scale), sm_scale)
    return key, (rq[1], rk[1], rv[1], ro[1], rl[1]), tensor_ptrs


def misaligned(**pointers: int) -> str:
    bad = ", ".join(f"{name} at 0x{p:x}" for name, p in pointers.items() if p & 15)
    return (f"{bad}: the kernels read 16-byte vectors, so q, k_cache, v_cache and out must "
            "start on a 16-byte boundary; pass a contiguous copy (or a view starting at a "
            "whole row)")


def empty_out(q: Any, checked: CheckedCall, head_dim_vo: int):
    """A new output typed like q (validated: contiguous, q's dtype and device), of
    head_dim_vo elements per head."""
    shape = tuple(q.shape[:2]) + (head_dim_vo,)
    if checked.torch_io:
        return sys.modules["torch"].empty(shape, dtype=q.dtype, device=q.device)
    cupy = sys.modules["cupy"]
    if isinstance(q, cupy.ndarray):
        return cupy.empty(shape, dtype=q.dtype)  # on the current device: run() has made it q's
    info = checked.arrays[0]  # another kind of device array: a CuPy output
    return empty_output(info, shape, info.dtype)[0]


def empty_lse(q: Any, checked: CheckedCall, shape: tuple[int, int]):
    if checked.torch_io:
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=torch.float32, device=q.device)
    return sys.modules["cupy"].empty(shape, dtype=np.float32)
