"""The pure checks of BatchAttention: geometry, batch layout, run() inputs and params.

Nothing here touches a GPU: arrays are only described (`arrays.describe`), so every check is
tested on machines without one. Each raises ValueError/TypeError (PlanError for a batch
layout) naming the argument, with what was expected and what was found.

    shape = validate_shape(32, 8, 128, "bf16", 16)
    inputs = validate_plan_inputs(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                  page_size=16)
    args = validate_run_inputs(shape, variant.params, inputs, q, (k_cache, v_cache), params)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnlang import ir
from attnlang.codegen.config import KV_FP8, check_head_dims
from attnlang.errors import did_you_mean
from attnlang.runtime.arrays import (
    TensorInfo,
    describe,
    host_int_array,
    normalize_dtype,
    normalize_kv_dtype,
)
from attnlang.runtime.planner import PlanError, lengths_from_indptr

__all__ = [
    "AttentionShape", "PlanInputs", "RunInputs", "KV_LAYOUTS", "validate_shape",
    "validate_plan_inputs", "validate_ragged_inputs", "validate_batch", "validate_run_inputs",
    "resolve_params", "check_count", "check_construction",
]

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class AttentionShape:
    """The fixed geometry of a BatchAttention (validated by `validate_shape`)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int  # of queries and keys
    dtype: str  # "float16" | "bfloat16"
    page_size: int
    head_dim_vo: int = 0  # of values and outputs; 0 (validate_shape never leaves it): head_dim
    kv_dtype: str = ""  # of k_cache and v_cache: dtype or "float8_e4m3fn"; "": dtype
    kv_layout: str = "paged"  # or "ragged": k, v [total_kv, ...], pages of one token

    def __post_init__(self):
        if not self.head_dim_vo:
            object.__setattr__(self, "head_dim_vo", self.head_dim)
        if not self.kv_dtype:
            object.__setattr__(self, "kv_dtype", self.dtype)

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def ragged(self) -> bool:
        return self.kv_layout == "ragged"


KV_LAYOUTS = ("paged", "ragged")


def validate_shape(num_qo_heads: Any, num_kv_heads: Any, head_dim: Any, dtype: Any,
                   page_size: Any, head_dim_vo: Any = None,
                   kv_dtype: Any = None, kv_layout: Any = "paged") -> AttentionShape:
    """Check BatchAttention's geometry; raise ValueError/TypeError naming the argument.
    head_dim_vo: the values' head dim (None: head_dim; `config.HEAD_DIM_PAIRS`); kv_dtype:
    the cache's element type (None: dtype; `arrays.normalize_kv_dtype`). page_size: None
    for the layout's own (16 paged; a ragged layout's requests are runs of rows, pages of
    one token to the kernels, so it takes None or 1).

    Example: ``validate_shape(32, 8, 128, "bf16", 16).group_size == 4``.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if kv_layout == "ragged":
        if page_size not in (None, 1):
            raise ValueError(
                f"page_size={page_size!r} with kv_layout='ragged': a ragged layout has no pages "
                "(k and v are [total_kv, num_kv_heads, head_dim], kv_indptr counts tokens); "
                "leave page_size out")
        page_size = 1
    elif page_size is None:
        page_size = 16
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                        ("page_size", page_size)):
        check_count(name, value)
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads}): each KV head serves a group of query heads (GQA)"
        )
    head_dim, head_dim_vo = check_head_dims(head_dim, head_dim_vo)
    dtype = normalize_dtype(dtype)
    return AttentionShape(int(num_qo_heads), int(num_kv_heads), head_dim, dtype,
                          int(page_size), head_dim_vo, normalize_kv_dtype(kv_dtype, dtype),
                          kv_layout)


@dataclass(frozen=True, eq=False)
class PlanInputs:
    """A validated batch layout, on the host. Index arrays are int32; lengths int64."""

    qo_indptr: np.ndarray  # [batch+1]
    kv_indptr: np.ndarray  # [batch+1], in pages
    kv_indices: np.ndarray  # [kv_indptr[-1]]
    kv_last_page_len: np.ndarray  # [batch]
    qo_lens: np.ndarray  # [batch]
    kv_lens: np.ndarray  # [batch], in tokens
    max_page: int  # largest page index referenced, -1 if none

    @property
    def batch_size(self) -> int:
        return int(self.qo_lens.shape[0])

    @property
    def total_q(self) -> int:
        return int(self.qo_indptr[-1])


def validate_plan_inputs(qo_indptr: Any, kv_indptr: Any, kv_indices: Any,
                         kv_last_page_len: Any, *, page_size: int) -> PlanInputs:
    """Check a batch layout (LANGUAGE.md section 6) and compute each request's KV length:
    ``kv_len = (pages - 1) * page_size + kv_last_page_len`` (0 for a request with no pages).

    Host arrays (NumPy, lists) or device arrays (copied to the host once). Raises
    PlanError (a ValueError) or TypeError naming the argument. Example::

        validate_plan_inputs([0, 1, 2], [0, 3, 4], [7, 2, 5, 0], [5, 16], page_size=16)
        # kv_lens [37, 16]
    """
    qo = _host_ints(qo_indptr, "qo_indptr")
    kvp = _host_ints(kv_indptr, "kv_indptr")
    idx = _host_ints(kv_indices, "kv_indices")
    last = _host_ints(kv_last_page_len, "kv_last_page_len").astype(np.int64, copy=False)
    qo_lens = lengths_from_indptr(qo, "qo_indptr")
    pages = lengths_from_indptr(kvp, "kv_indptr")
    batch = qo_lens.shape[0]
    if pages.shape[0] != batch:
        raise PlanError(
            f"qo_indptr and kv_indptr must both have batch_size + 1 entries, got "
            f"{qo.shape[0]} and {kvp.shape[0]}"
        )
    if last.shape[0] != batch:
        raise PlanError(
            f"kv_last_page_len must have one entry per request ({batch}), got {last.shape[0]}"
        )
    if idx.shape[0] != kvp[-1]:
        raise PlanError(
            f"kv_indices must have kv_indptr[-1] = {kvp[-1]} entries (one per page of the "
            f"batch), got {idx.shape[0]}"
        )
    max_page = -1
    if idx.size:
        # int32 page numbers cannot exceed the range: one reduction less on the largest array.
        max_page = int(idx.max())
        if int(idx.min()) < 0 or max_page > _INT32_MAX:
            idx = idx.astype(np.int64)
            i = int(np.argmax((idx < 0) | (idx > _INT32_MAX)))
            raise PlanError(f"kv_indices must be page numbers in [0, 2**31), got "
                            f"kv_indices[{i}] = {idx[i]}")
    has_pages = pages > 0
    bad = (last > page_size) | (last < has_pages)  # at least 1 with pages, 0 without
    if bad.any():
        i = int(np.argmax(bad))
        want = f"in [1, page_size={page_size}]" if has_pages[i] else (
            f"0 (it has no pages) or at most page_size={page_size}")
        raise PlanError(f"kv_last_page_len[{i}] = {last[i]} must be {want}")
    kv_lens = np.where(has_pages, (pages - 1) * page_size + last, 0)
    if (qo_lens > kv_lens).any():
        i = int(np.argmax(qo_lens > kv_lens))
        raise PlanError(
            f"request {i} has {qo_lens[i]} queries (qo_indptr) but only {kv_lens[i]} KV tokens "
            "(kv_indptr, kv_last_page_len): queries are the last tokens of their sequence, so "
            "their K/V must already be in the cache (qo_len <= kv_len)"
        )
    if int(kv_lens.max(initial=0)) > _INT32_MAX or int(qo[-1]) > _INT32_MAX:
        raise PlanError("lengths overflow int32")
    return PlanInputs(
        qo_indptr=_i32(qo), kv_indptr=_i32(kvp), kv_indices=_i32(idx),
        kv_last_page_len=_i32(last), qo_lens=qo_lens, kv_lens=kv_lens, max_page=max_page,
    )


def validate_ragged_inputs(qo_indptr: Any, kv_indptr: Any) -> PlanInputs:
    """A ragged layout's batch (BatchAttention's kv_layout="ragged"): request b owns queries
    qo_indptr[b]:qo_indptr[b+1] of q and rows kv_indptr[b]:kv_indptr[b+1] of k and v. To the
    kernels, pages of one token whose page table is the identity (so the TMA copies boxes of
    any 16 consecutive rows): what validate_plan_inputs returns for that table, built without
    scanning it. Raises PlanError naming the argument.

    Example: ``validate_ragged_inputs([0, 1, 3], [0, 5, 9]).kv_lens`` -> [5, 4].
    """
    qo = _host_ints(qo_indptr, "qo_indptr")
    kvp = _host_ints(kv_indptr, "kv_indptr")
    qo_lens = lengths_from_indptr(qo, "qo_indptr")
    rows = lengths_from_indptr(kvp, "kv_indptr")
    if rows.shape[0] != qo_lens.shape[0]:
        raise PlanError(
            f"qo_indptr and kv_indptr must both have batch_size + 1 entries, got "
            f"{qo.shape[0]} and {kvp.shape[0]}"
        )
    if (qo_lens > rows).any():
        i = int(np.argmax(qo_lens > rows))
        raise PlanError(
            f"request {i} has {qo_lens[i]} queries (qo_indptr) but only {rows[i]} rows of k and "
            "v (kv_indptr): queries are the last tokens of their sequence, so their keys must "
            "be among the rows (qo_len <= kv_len)")
    total = int(kvp[-1])
    if total > _INT32_MAX or int(qo[-1]) > _INT32_MAX:
        raise PlanError("lengths overflow int32")
    return PlanInputs(
        qo_indptr=_i32(qo), kv_indptr=_i32(kvp), kv_indices=np.arange(total, dtype=np.int32),
        kv_last_page_len=(rows > 0).astype(np.int32), qo_lens=qo_lens,
        kv_lens=rows.astype(np.int64, copy=False), max_page=total - 1,
    )


def validate_batch(shape: AttentionShape, qo_indptr: Any, kv_indptr: Any, kv_indices: Any,
                   kv_last_page_len: Any) -> PlanInputs:
    """plan()'s batch, validated for the layout: a page table (validate_plan_inputs), or a
    ragged layout's rows (validate_ragged_inputs, without kv_indices or kv_last_page_len)."""
    if shape.ragged:
        if kv_indices is not None or kv_last_page_len is not None:
            raise TypeError("this BatchAttention's kv_layout is 'ragged': plan(qo_indptr, "
                            "kv_indptr) takes no kv_indices or kv_last_page_len (request b's "
                            "keys are rows kv_indptr[b]:kv_indptr[b+1] of k and v)")
        return validate_ragged_inputs(qo_indptr, kv_indptr)
    if kv_indices is None or kv_last_page_len is None:
        raise TypeError("plan() of a paged cache takes qo_indptr, kv_indptr, kv_indices and "
                        "kv_last_page_len (kv_layout='ragged' takes the first two alone)")
    return validate_plan_inputs(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                page_size=shape.page_size)


def _host_ints(x: Any, name: str) -> np.ndarray:
    """host_int_array without its int64 copy for a 1-D NumPy integer array (plan()'s usual
    input): such an array is returned as is, to be read only."""
    if isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype.kind in "iu" and x.size:
        return x
    return host_int_array(x, name)


@dataclass(frozen=True, eq=False)
class RunInputs:
    """run()'s validated inputs: descriptions of the arrays, params in declaration order
    (np.float32 / np.int32 scalars, TensorInfo for device tensors, np.ndarray for host
    tensors still to be uploaded), the softmax scale and the device."""

    q: TensorInfo
    k_cache: TensorInfo
    v_cache: TensorInfo
    out: TensorInfo | None
    lse: TensorInfo | None
    params: tuple[tuple[ir.ParamSpec, Any], ...]
    sm_scale: float
    device: int


def validate_run_inputs(shape: AttentionShape, specs: Sequence[ir.ParamSpec],
                        inputs: PlanInputs, q: Any, kv_cache: Any, params: Any = None, *,
                        out: Any = None, lse: Any = None, sm_scale: Any = None,
                        variant_name: str = "variant",
                        dim_sizes: Mapping[str, int] | None = None,
                        plan_params: Mapping[str, Any] | None = None) -> RunInputs:
    """Check everything run() receives against the geometry and the planned batch (`inputs`,
    from validate_plan_inputs); raise ValueError/TypeError naming the argument. Pure: arrays
    are only described (TensorInfo instances may be passed in place of arrays), nothing
    touches a GPU.

    q [total_q, num_qo_heads, head_dim]; kv_cache = (k_cache, v_cache), each
    [num_pages, page_size, num_kv_heads, head_dim] (v_cache: head_dim_vo); out
    [total_q, num_qo_heads, head_dim_vo]; lse [total_q, num_qo_heads] float32. All
    contiguous, on one device, q/out of the BatchAttention's dtype, k/v of its kv_dtype (an
    fp8 cache as float8_e4m3fn or uint8 bits). dim_sizes: the length
    of each tensor param's `dim` axis (`ir.extent_sizes`; None: head_dim). plan_params: the
    kernel arguments of the per-pair masks plan() took (their device buffers).
    """
    total_q, hq, hkv, d = inputs.total_q, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    qi = _device_tensor(q, "q")
    _check_array(qi, "q", (total_q, hq, d), "[total_q, num_qo_heads, head_dim]")
    _check_dtype(qi, "q", shape.dtype)
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
        raise TypeError(
            "kv_cache must be a (k_cache, v_cache) pair of [num_pages, page_size, "
            f"num_kv_heads, head_dim] arrays, got {type(kv_cache).__name__}"
        )
    ki = _device_tensor(kv_cache[0], "k_cache")
    vi = _device_tensor(kv_cache[1], "v_cache")
    # (A ragged layout's k, v are its pages of one token without the page axis.)
    rows = "[total_kv" if shape.ragged else "[num_pages, page_size"
    row_shape = () if shape.ragged else (shape.page_size,)
    layout = f"{rows}, num_kv_heads, head_dim]"
    _check_array(ki, "k_cache", (None, *row_shape, hkv, d), layout)
    num_pages = ki.shape[0]
    if shape.head_dim_vo == d:
        _check_array(vi, "v_cache", ki.shape, f"{layout} (the shape of k_cache)")
    else:
        _check_array(vi, "v_cache", ki.shape[:-1] + (shape.head_dim_vo,),
                     f"{rows}, num_kv_heads, head_dim_vo]")
    for name, info in (("k_cache", ki), ("v_cache", vi)):
        if shape.kv_dtype == KV_FP8:
            if info.dtype not in (KV_FP8, "uint8"):
                raise TypeError(f"{name} has dtype {info.dtype} but this BatchAttention was built "
                                f"for an fp8 cache: pass {KV_FP8} (or its bits as uint8)")
        elif info.dtype != qi.dtype:
            hint = (" (for an fp8 cache build the BatchAttention with kv_dtype='fp8')"
                    if info.dtype in (KV_FP8, "uint8") else "")
            raise TypeError(f"{name} has dtype {info.dtype} but q has {qi.dtype}; they must "
                            f"match{hint}")
    if shape.ragged and inputs.max_page >= num_pages:
        raise ValueError(
            f"kv_indptr (given to plan()) spans {inputs.max_page + 1} rows of k and v, but k_cache "
            f"has only {num_pages}: kv_indptr[-1] must be <= k_cache.shape[0]"
        )
    if inputs.max_page >= num_pages:
        raise ValueError(
            f"kv_indices (given to plan()) refers to page {inputs.max_page}, but k_cache has only "
            f"{num_pages} pages: page indices must be < k_cache.shape[0]"
        )
    outi = lsei = None
    if out is not None:
        outi = _device_tensor(out, "out")
        _check_array(outi, "out", (total_q, hq, shape.head_dim_vo),
                     "[total_q, num_qo_heads, head_dim]" if shape.head_dim_vo == d
                     else "[total_q, num_qo_heads, head_dim_vo]")
        if outi.dtype != qi.dtype:
            hint = " (only the KV cache may be fp8)" if outi.dtype in (KV_FP8, "uint8") else ""
            raise TypeError(f"out has dtype {outi.dtype} but q has {qi.dtype}; they must "
                            f"match{hint}")
    if lse is not None:
        lsei = _device_tensor(lse, "lse")
        _check_array(lsei, "lse", (total_q, hq), "[total_q, num_qo_heads]")
        if lsei.dtype != "float32":
            raise TypeError(f"lse must be float32, got {lsei.dtype}")
    arrays = [("q", qi), ("k_cache", ki), ("v_cache", vi), ("out", outi), ("lse", lsei)]
    _check_same_device([(n, a) for n, a in arrays if a is not None])
    if sm_scale is None:
        scale = 1.0 / math.sqrt(d)
    else:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
            raise TypeError(f"sm_scale must be a number, got {type(sm_scale).__name__}")
        scale = float(sm_scale)
        if not math.isfinite(scale):
            raise ValueError(f"sm_scale must be finite, got {scale}")
    resolved = resolve_params(specs, params, shape=shape, batch_size=inputs.batch_size,
                              device=qi.device, variant_name=variant_name, dim_sizes=dim_sizes,
                              plan_params=plan_params)
    return RunInputs(qi, ki, vi, outi, lsei, resolved, scale, int(qi.device))


def resolve_params(specs: Sequence[ir.ParamSpec], params: Any, *, shape: AttentionShape,
                   batch_size: int, device: int | None = 0, variant_name: str = "variant",
                   dim_sizes: Mapping[str, int] | None = None,
                   plan_params: Mapping[str, Any] | None = None,
                   ) -> tuple[tuple[ir.ParamSpec, Any], ...]:
    """Match run()'s `params` dict to the variant's declared params (declaration order).

    Scalars: Python (or NumPy) numbers -> np.float32 / np.int32; a missing scalar takes its
    default. Tensors ``float[EXTENT]`` / ``int[EXTENT]``: 1-D, exactly EXTENT long (heads,
    kv_heads, batch, dim); device arrays must be float32 / int32 and contiguous (returned as
    TensorInfo); NumPy arrays and lists are converted (returned as np.ndarray to upload).
    Raises ValueError/TypeError naming the param, with a did-you-mean hint for unknown names.
    """
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of param name -> value, got "
                        f"{type(params).__name__}")
    declared = {p.name: p for p in specs}
    for name in params:
        if name not in declared:
            if not declared:
                raise ValueError(f"unknown param {name!r}: variant {variant_name} takes no params")
            hint = did_you_mean(str(name), declared)
            raise ValueError(
                f"unknown param {name!r} for variant {variant_name}"
                + (f"; {hint}" if hint else "")
                + f" (its params: {', '.join(declared)})"
            )
    extents = {"heads": shape.num_qo_heads, "kv_heads": shape.num_kv_heads,
               "batch": batch_size, "dim": shape.head_dim}
    resolved = []
    for spec in specs:
        decl = _describe_spec(spec)
        if spec.is_pair:  # plan() took it: its kernel argument is the plan's buffer
            if spec.name in params:
                raise ValueError(f"param {spec.name!r} ({decl}) is a per-pair mask: pass it to "
                                 "plan(params=...), which packs it and skips tiles by its bits")
            if plan_params is None or spec.name not in plan_params:
                raise ValueError(f"param {spec.name!r} ({decl}) comes from plan(): call "
                                 f"plan(..., params={{{spec.name!r}: ...}}) first")
            resolved.append((spec, plan_params[spec.name]))
            continue
        if spec.name not in params or params[spec.name] is None:
            if spec.is_tensor or spec.default is None:
                raise ValueError(
                    f"missing param {spec.name!r} ({decl}) of variant {variant_name}: pass "
                    f"params={{{spec.name!r}: ...}} to run()"
                )
            value: Any = spec.default
        else:
            value = params[spec.name]
        where = f"param {spec.name!r} ({decl})"
        if not spec.is_tensor:
            resolved.append((spec, _scalar_param(value, spec, where)))
        else:
            dim = (dim_sizes or {}).get(spec.name, shape.head_dim)
            resolved.append((spec, _tensor_param(value, spec, spec.shape({**extents, "dim": dim}),
                                                 where, device)))
    return tuple(resolved)


def _describe_spec(spec: ir.ParamSpec) -> str:
    if spec.is_tensor:
        return spec.declared
    return f"{spec.type}" + (f" = {spec.default}" if spec.default is not None else "")


def _scalar_param(value: Any, spec: ir.ParamSpec, where: str):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a number, got {type(value).__name__}")
    if spec.type is ir.INT:
        if not isinstance(value, numbers.Integral):
            raise TypeError(f"{where} must be an integer, got {value!r}")
        if not -2**31 <= int(value) <= _INT32_MAX:
            raise ValueError(f"{where} must fit in int32, got {value}")
        return np.int32(value)
    return np.float32(value)


def _tensor_param(value: Any, spec: ir.ParamSpec, shape: tuple[int, ...], where: str,
                  device: int | None):
    want = _TENSOR_DTYPE[spec.type]
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if isinstance(value, (bool, numbers.Number)):
        raise TypeError(f"{where} must be an array of shape {shape}, got a scalar")
    info = describe(value, where)
    if tuple(info.shape) != shape:
        named = "; ".join(f"{e} = {n}: one value per {_EXTENT_WORDS[e]}"
                          for e, n in zip(spec.extents, shape, strict=True) if isinstance(e, str))
        raise ValueError(f"{where} must have shape {shape}" + (f" ({named})" if named else "")
                         + f", got {tuple(info.shape)}")
    if math.prod(shape) > _INT32_MAX:
        raise ValueError(f"{where} has {math.prod(shape)} elements: a table is indexed by "
                         "32-bit ints")
    if info.on_device:
        if info.dtype != want:
            raise TypeError(f"{where} must be a {want} device array, got {info.dtype} "
                            f"(convert it with .astype({want}))")
        if not info.contiguous:
            raise ValueError(f"{where} must be contiguous")
        if device is not None and info.device != device:
            raise ValueError(f"{where} is on device {info.device} but q is on device {device}")
        return info
    host = np.asarray(value)
    if spec.type is ir.BOOL:
        if host.dtype != bool:
            raise TypeError(f"{where} must hold bools, got dtype {host.dtype} (convert it with "
                            ".astype(bool))")
    elif spec.type is ir.INT:
        if host.dtype == bool or not np.issubdtype(host.dtype, np.integer):
            raise TypeError(f"{where} must hold integers, got dtype {host.dtype}")
        if host.size and (host.min() < -2**31 or host.max() > _INT32_MAX):
            raise ValueError(f"{where} values must fit in int32")
    elif host.dtype == bool or not (np.issubdtype(host.dtype, np.floating)
                                    or np.issubdtype(host.dtype, np.integer)):
        raise TypeError(f"{where} must hold real numbers, got dtype {host.dtype}")
    return np.ascontiguousarray(host, dtype=want)


_EXTENT_WORDS = {"heads": "query head", "kv_heads": "KV head", "batch": "request",
                 "dim": "element of a head vector"}
# The device dtype of each tensor param type (bool tables are bytes, as torch.bool).
_TENSOR_DTYPE = {ir.INT: "int32", ir.FLOAT: "float32", ir.BOOL: "bool"}


def _device_tensor(x: Any, name: str) -> TensorInfo:
    if x is None:
        raise TypeError(f"{name} is required")
    info = describe(x, name)
    if not info.on_device:
        raise TypeError(
            f"{name} must be a device array (a CuPy array or a CUDA torch tensor), got a "
            f"{info.type_name()}; move it to the GPU first (cupy.asarray / tensor.cuda())"
        )
    return info


def _check_array(info: TensorInfo, name: str, expected: tuple, layout: str) -> None:
    if len(info.shape) != len(expected) or any(
            e is not None and s != e for s, e in zip(info.shape, expected, strict=True)):
        shown = "(" + ", ".join("N" if e is None else str(e) for e in expected) + ")"
        raise ValueError(f"{name} must have shape {layout} = {shown}, got {info.shape}")
    if not info.contiguous:
        raise ValueError(f"{name} must be contiguous (C order); pass a contiguous copy")


def _check_dtype(info: TensorInfo, name: str, dtype: str) -> None:
    if info.dtype == dtype:
        return
    # CuPy without ml_dtypes has no bfloat16: its bits travel as uint16 (arrays.py).
    if dtype == "bfloat16" and info.dtype == "uint16" and info.kind != "torch":
        return
    hint = (f"; only the KV cache may be fp8 ({name} stays {dtype})"
            if info.dtype in (KV_FP8, "float8_e5m2", "uint8") else "")
    raise TypeError(f"{name} has dtype {info.dtype} but this BatchAttention was built for "
                    f"{dtype}{hint}")


def _check_same_device(arrays: list[tuple[str, TensorInfo]]) -> None:
    first_name, first = arrays[0]
    for name, info in arrays[1:]:
        if info.device != first.device:
            raise ValueError(f"{name} is on device {info.device} but {first_name} is on device "
                             f"{first.device}; all inputs must be on one GPU")


def check_construction(*, max_batch_size: Any, max_total_q: Any, max_qo_len: Any = None,
                       max_kv_indices: Any,
                       max_pair_mask_bytes: Any, max_work_items: Any, max_partial_rows: Any,
                       max_merge_rows: Any, num_ctas: Any, num_prefill_ctas: Any,
                       prefill_min_rows: Any, cascade: Any,
                       max_dequant_bytes: Any = 0) -> None:
    """BatchAttention's capacities and knobs (None: the default) as it takes them, checked
    without a GPU: TypeError for a wrong type, ValueError for a value out of range."""
    if isinstance(max_dequant_bytes, bool) or not isinstance(max_dequant_bytes,
                                                             (int, np.integer)):
        raise TypeError("max_dequant_bytes must be an integer >= 0 (0: no converted copy), "
                        f"got {type(max_dequant_bytes).__name__}")
    if max_dequant_bytes < 0:
        raise ValueError(f"max_dequant_bytes must be an integer >= 0 (0: no converted copy), "
                         f"got {max_dequant_bytes}")
    for name, value in (("max_batch_size", max_batch_size), ("max_total_q", max_total_q),
                        ("max_kv_indices", max_kv_indices),
                        ("max_pair_mask_bytes", max_pair_mask_bytes)):
        check_count(name, value)
    if max_qo_len is not None:
        check_count("max_qo_len", max_qo_len)
        if max_qo_len > max_total_q:
            raise ValueError(f"max_qo_len ({max_qo_len}) must not exceed max_total_q "
                             f"({max_total_q}): a request's queries are part of its batch's")
    for name, value in (("max_work_items", max_work_items),
                        ("max_partial_rows", max_partial_rows),
                        ("max_merge_rows", max_merge_rows), ("num_ctas", num_ctas),
                        ("num_prefill_ctas", num_prefill_ctas)):
        if value is not None:
            check_count(name, value)
    if prefill_min_rows is not None:
        if isinstance(prefill_min_rows, bool) or not isinstance(prefill_min_rows,
                                                                (int, np.integer)):
            raise TypeError("prefill_min_rows must be an integer >= 0, got "
                            f"{type(prefill_min_rows).__name__}")
        if prefill_min_rows < 0:
            raise ValueError(f"prefill_min_rows must be an integer >= 0, got {prefill_min_rows}")
    if not isinstance(cascade, bool):
        raise TypeError(f"cascade must be True or False, got {cascade!r}")


def check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def _i32(a: np.ndarray) -> np.ndarray:
    """A contiguous int32 copy (never the caller's array: PlanInputs outlives the call)."""
    return np.array(a, dtype=np.int32)
