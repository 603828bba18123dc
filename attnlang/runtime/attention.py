"""BatchAttention: plan() a ragged batch over a paged KV cache on the CPU, run() it on the GPU.

The split of work follows FlashInfer's plan/run API:

- ``plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)`` validates the batch layout
  (host arrays), schedules it (`planner.plan_mixed`), and copies the plan and the page table
  into a device workspace allocated once at construction, with one host-to-device copy from
  a pinned staging buffer, on the current stream.
- ``run(q, (k_cache, v_cache), params)`` validates every input before anything is launched
  (`validate_run_inputs`, a pure function of shapes and dtypes), then launches the variant's
  decode kernel on a fixed grid of `num_ctas` CTAs, its prefill kernel on a fixed grid of
  `num_prefill_ctas` CTAs and the merge kernel on a fixed grid, on the caller's current
  stream. A plan sends each request to one of the two attention kernels (`plan_mixed`:
  prefill, on tensor cores, when it has more than `prefill_min_rows` fused rows, which with
  GQA groups of 4 or more includes single-token decode), each with its own work list. A
  kernel that no batch within the construction bounds can reach is never launched.
  All workspace pointers are fixed for the object's lifetime, so a CUDA graph captured
  around run() stays valid after later plan() calls: plan() only rewrites the workspace's
  contents.

Everything that can be checked without a GPU is a pure function here (validate_shape,
validate_plan_inputs, validate_run_inputs, workspace_layout, fill_workspace, kernel_args),
so it is tested on machines without one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnlang import ir
from attnlang.errors import did_you_mean
from attnlang.runtime import planner
from attnlang.runtime.arrays import (
    TensorInfo,
    current_stream,
    describe,
    empty_output,
    host_int_array,
    normalize_dtype,
    to_device_param,
)
from attnlang.runtime.module import KernelModule, check_head_dim
from attnlang.runtime.planner import (
    BatchPlan,
    CapacityError,
    Plan,
    PlanBounds,
    PlanError,
    Tiling,
    lengths_from_indptr,
    plan_mixed,
    worst_case_mixed_bounds,
)

__all__ = [
    "BatchAttention", "AttentionShape", "PlanInputs", "RunInputs", "WorkspaceLayout",
    "validate_shape", "validate_plan_inputs", "validate_run_inputs", "resolve_params",
    "workspace_layout", "fill_workspace", "kernel_args", "CapacityError", "PlanError",
]

_INT32_MAX = 2**31 - 1
# Workspace sections start on 128-byte boundaries (32 int32s): coalesced, vector-loadable.
_ALIGN = 32
# CTAs per SM when num_ctas is not given: the kernel's occupancy, capped. Beyond a few CTAs
# per SM, more CTAs only shrink the KV chunks (more partial states to merge) without adding
# memory parallelism the warps of each CTA do not already provide.
_MAX_CTAS_PER_SM = 4


# ---------------------------------------------------------------------------- pure checks


@dataclass(frozen=True)
class AttentionShape:
    """The fixed geometry of a BatchAttention (validated by `validate_shape`)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float16" | "bfloat16"
    page_size: int

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


def validate_shape(num_qo_heads: Any, num_kv_heads: Any, head_dim: Any, dtype: Any,
                   page_size: Any) -> AttentionShape:
    """Check BatchAttention's geometry; raise ValueError/TypeError naming the argument.

    Example: ``validate_shape(32, 8, 128, "bf16", 16).group_size == 4``.
    """
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                        ("page_size", page_size)):
        _check_count(name, value)
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads}): each KV head serves a group of query heads (GQA)"
        )
    head_dim = check_head_dim(head_dim)
    return AttentionShape(int(num_qo_heads), int(num_kv_heads), head_dim,
                          normalize_dtype(dtype), int(page_size))


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
                        variant_name: str = "variant") -> RunInputs:
    """Check everything run() receives against the geometry and the planned batch (`inputs`,
    from validate_plan_inputs); raise ValueError/TypeError naming the argument. Pure: arrays
    are only described (TensorInfo instances may be passed in place of arrays), nothing
    touches a GPU.

    q [total_q, num_qo_heads, head_dim]; kv_cache = (k_cache, v_cache), each
    [num_pages, page_size, num_kv_heads, head_dim]; out like q; lse [total_q, num_qo_heads]
    float32. All contiguous, on one device, q/k/v/out of the BatchAttention's dtype.
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
    layout = "[num_pages, page_size, num_kv_heads, head_dim]"
    _check_array(ki, "k_cache", (None, shape.page_size, hkv, d), layout)
    num_pages = ki.shape[0]
    _check_array(vi, "v_cache", ki.shape, f"{layout} (the shape of k_cache)")
    for name, info in (("k_cache", ki), ("v_cache", vi)):
        if info.dtype != qi.dtype:
            raise TypeError(f"{name} has dtype {info.dtype} but q has {qi.dtype}; they must match")
    if inputs.max_page >= num_pages:
        raise ValueError(
            f"kv_indices (given to plan()) refers to page {inputs.max_page}, but k_cache has only "
            f"{num_pages} pages: page indices must be < k_cache.shape[0]"
        )
    outi = lsei = None
    if out is not None:
        outi = _device_tensor(out, "out")
        _check_array(outi, "out", qi.shape, "[total_q, num_qo_heads, head_dim], like q")
        if outi.dtype != qi.dtype:
            raise TypeError(f"out has dtype {outi.dtype} but q has {qi.dtype}; they must match")
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
                              device=qi.device, variant_name=variant_name)
    return RunInputs(qi, ki, vi, outi, lsei, resolved, scale, int(qi.device))


def resolve_params(specs: Sequence[ir.ParamSpec], params: Any, *, shape: AttentionShape,
                   batch_size: int, device: int | None = 0,
                   variant_name: str = "variant") -> tuple[tuple[ir.ParamSpec, Any], ...]:
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
            resolved.append((spec, _tensor_param(value, spec, extents[spec.extent],
                                                 where, device)))
    return tuple(resolved)


def _describe_spec(spec: ir.ParamSpec) -> str:
    if spec.is_tensor:
        return f"{spec.type}[{spec.extent}]"
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


def _tensor_param(value: Any, spec: ir.ParamSpec, extent: int, where: str,
                  device: int | None):
    want = "int32" if spec.type is ir.INT else "float32"
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if isinstance(value, (bool, numbers.Number)):
        raise TypeError(f"{where} must be a 1-D array of {extent} values ({spec.extent}), "
                        f"got a scalar")
    info = describe(value, where)
    if len(info.shape) != 1 or info.shape[0] != extent:
        raise ValueError(
            f"{where} must have shape ({extent},) (one value per {_EXTENT_WORDS[spec.extent]}), "
            f"got {info.shape}"
        )
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
    if spec.type is ir.INT:
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
    raise TypeError(f"{name} has dtype {info.dtype} but this BatchAttention was built for "
                    f"{dtype}")


def _check_same_device(arrays: list[tuple[str, TensorInfo]]) -> None:
    first_name, first = arrays[0]
    for name, info in arrays[1:]:
        if info.device != first.device:
            raise ValueError(f"{name} is on device {info.device} but {first_name} is on device "
                             f"{first.device}; all inputs must be on one GPU")


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def _i32(a: np.ndarray) -> np.ndarray:
    """A contiguous int32 copy (never the caller's array: PlanInputs outlives the call)."""
    return np.array(a, dtype=np.int32)


# ---------------------------------------------------------------------------- workspace

# Sections of the int32 workspace, in memory order. The page table goes last so one copy of
# [0, its start + used length) moves everything a plan wrote.
_WORK = ("work_request", "work_kv_head", "work_row_start", "work_kv_start", "work_kv_end",
         "work_partial")
# The prefill kernel's work list: the same arrays under a "prefill_" prefix.
_PREFILL_PREFIX = "prefill_"
_SECTIONS = (
    "work_indptr", "merge_count", "qo_indptr", "kv_indptr", "kv_last_page_len", *_WORK,
    "prefill_work_indptr", *(_PREFILL_PREFIX + name for name in _WORK),
    "merge_indptr", "merge_token", "merge_head", "merge_request", "merge_slots", "kv_indices",
)


@dataclass(frozen=True)
class WorkspaceLayout:
    """Offsets and capacities (int32 elements) of the workspace sections; total size."""

    offsets: Mapping[str, int]
    capacity: Mapping[str, int]
    total: int

    def copy_elems(self, num_kv_indices: int) -> int:
        """Elements to copy for a plan whose page table has num_kv_indices entries."""
        return self.offsets["kv_indices"] + num_kv_indices


def workspace_layout(num_ctas: int, bounds: PlanBounds, max_kv_indices: int,
                     num_prefill_ctas: int | None = None) -> WorkspaceLayout:
    """The fixed layout of the int32 workspace for these capacities: the decode kernel's work
    list (num_ctas CTAs), the prefill kernel's (num_prefill_ctas, default num_ctas), each
    holding up to bounds.max_work_items items, the merge list and the page table.

    Example: ``workspace_layout(132, worst_case_bounds(...), 1 << 20).total``.
    """
    b, w = bounds.max_batch_size, bounds.max_work_items
    m, p = bounds.max_merge_rows, bounds.max_partial_rows
    prefill_ctas = num_ctas if num_prefill_ctas is None else num_prefill_ctas
    caps = {
        "work_indptr": num_ctas + 1, "prefill_work_indptr": prefill_ctas + 1, "merge_count": 1,
        "qo_indptr": b + 1, "kv_indptr": b + 1, "kv_last_page_len": b, "merge_indptr": m + 1,
        "merge_slots": p, "kv_indices": max_kv_indices,
    }
    for name in _WORK:
        caps[name] = caps[_PREFILL_PREFIX + name] = w
    for name in ("merge_token", "merge_head", "merge_request"):
        caps[name] = m
    offsets, at = {}, 0
    for name in _SECTIONS:
        offsets[name] = at
        at += -(-max(caps[name], 1) // _ALIGN) * _ALIGN
    return WorkspaceLayout(offsets, caps, at)


def fill_workspace(layout: WorkspaceLayout, host: np.ndarray, plan: BatchPlan | Plan,
                   inputs: PlanInputs) -> int:
    """Write `plan` and the page table into the host image of the workspace (int32, at
    least layout.total long). Returns how many leading elements must be copied to the GPU.
    A bare Plan (plan_batch) is a decode-only batch: the prefill list is left empty. The
    caller has checked the capacities (the planner's bounds, max_kv_indices)."""
    off = layout.offsets
    host[off["merge_count"]] = plan.merge_count
    arrays = [("qo_indptr", inputs.qo_indptr), ("kv_indptr", inputs.kv_indptr),
              ("kv_last_page_len", inputs.kv_last_page_len), ("kv_indices", inputs.kv_indices),
              *plan.merge_arrays().items()]
    if isinstance(plan, BatchPlan):
        arrays += plan.decode.work_arrays().items()
        arrays += [(_PREFILL_PREFIX + k, a) for k, a in plan.prefill.work_arrays().items()]
    else:
        arrays += plan.work_arrays().items()
        start = off["prefill_work_indptr"]
        host[start:start + layout.capacity["prefill_work_indptr"]] = 0
    for name, array in arrays:
        n = array.shape[0]
        if n:  # empty sections (an unused list, no merges) have nothing to write
            start = off[name]
            host[start:start + n] = array
    return layout.copy_elems(inputs.kv_indices.shape[0])


# ---------------------------------------------------------------------------- kernel args


def kernel_args(kind: str, *, q: int, k_cache: int, v_cache: int, out: int, lse: int,
                ws: Mapping[str, int], num_heads: int, num_kv_heads: int, page_size: int,
                sm_scale: float, params: Sequence[tuple[ir.ParamSpec, Any]]) -> tuple:
    """The argument tuple of a kernel launch, in docs/INTERNALS.md order.

    Pointers (q..lse, and ws: workspace section name -> device address, including
    "partial_o" and "partial_lse") become np.uint64; counts np.int32; sm_scale np.float32;
    params follow in declaration order (np.float32 / np.int32 scalars, TensorInfo -> its
    pointer).
    """
    ptr = np.uint64
    tail = (np.int32(num_heads), np.int32(num_kv_heads), np.int32(page_size),
            np.float32(sm_scale),
            *(ptr(v.ptr) if isinstance(v, TensorInfo) else v for _, v in params))
    if kind in ("decode", "prefill"):
        # Same arguments (INTERNALS.md); each kernel reads its own work list.
        prefix = _PREFILL_PREFIX if kind == "prefill" else ""
        work = [ptr(ws[prefix + name]) for name in ("work_indptr", *_WORK)]
        return (
            ptr(q), ptr(k_cache), ptr(v_cache), ptr(out), ptr(lse),
            ptr(ws["qo_indptr"]), ptr(ws["kv_indptr"]), ptr(ws["kv_indices"]),
            ptr(ws["kv_last_page_len"]),
            *work,
            ptr(ws["partial_o"]), ptr(ws["partial_lse"]),
            *tail,
        )
    if kind == "merge":
        return (
            ptr(ws["merge_count"]), ptr(ws["merge_indptr"]), ptr(ws["merge_slots"]),
            ptr(ws["merge_token"]), ptr(ws["merge_head"]), ptr(ws["merge_request"]),
            ptr(out), ptr(lse), ptr(ws["partial_o"]), ptr(ws["partial_lse"]),
            ptr(ws["qo_indptr"]), ptr(ws["kv_indptr"]), ptr(ws["kv_last_page_len"]),
            *tail,
        )
    raise ValueError(f"unknown kernel kind {kind!r}")


class PackedArgs:
    """One kernel's arguments, in kernel_args order, packed once into 8-byte slots: the
    kernelParams array that cuLaunchKernel reads (entry i points at slot i). update() rewrites
    only what a call supplies (array pointers, sm_scale, params) and run() launches with
    driver.launchKernel: CuPy's Function call converts all ~30 arguments on every call, ~25 us
    per launch on the H100 host. The driver copies the values at launch (and at capture), so
    the slots may be rewritten right after. Example::

        packed = PackedArgs("decode", ws, num_heads=32, num_kv_heads=8, page_size=16,
                            num_params=1)
        packed.update(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, sm_scale, params)
        packed.values() == kernel_args("decode", q=q_ptr, ..., params=params)
        driver.launchKernel(fn.ptr, *grid, *block, smem, stream.ptr, packed.kernel_params, 0)
    """

    __slots__ = ("_kind", "_u64", "_i32", "_f32", "_types", "_scale", "_pointers",
                 "kernel_params")

    def __init__(self, kind: str, ws: Mapping[str, int], *, num_heads: int, num_kv_heads: int,
                 page_size: int, num_params: int):
        fixed = kernel_args(kind, q=0, k_cache=0, v_cache=0, out=0, lse=0, ws=ws,
                            num_heads=num_heads, num_kv_heads=num_kv_heads,
                            page_size=page_size, sm_scale=0.0, params=())
        n = len(fixed) + num_params
        self._kind = kind
        self._u64 = np.zeros(n, dtype=np.uint64)
        # 4-byte values live in the low half of their slot (little-endian hosts): index 2 i.
        self._i32 = self._u64.view(np.int32)
        self._f32 = self._u64.view(np.float32)
        self._types: list[type] = [type(v) for v in fixed] + [type(None)] * num_params
        for i, value in enumerate(fixed):
            self._store(i, value)
        self._scale = len(fixed) - 1  # sm_scale's slot; params follow
        self._pointers = self._u64.ctypes.data + 8 * np.arange(n, dtype=np.uint64)
        self.kernel_params = int(self._pointers.ctypes.data)

    def _store(self, i: int, value: Any) -> None:
        if isinstance(value, TensorInfo):
            self._u64[i] = value.ptr
            self._types[i] = np.uint64
        elif isinstance(value, (np.floating, float)):
            self._f32[2 * i] = value
            self._types[i] = np.float32
        elif isinstance(value, (np.integer, int)) and not isinstance(value, np.uint64):
            self._i32[2 * i] = value
            self._types[i] = np.int32
        else:
            self._u64[i] = value
            self._types[i] = np.uint64

    def update(self, q: int, k_cache: int, v_cache: int, out: int, lse: int, sm_scale: float,
               params: Sequence[tuple[ir.ParamSpec, Any]]) -> None:
        u = self._u64
        if self._kind == "merge":
            u[6], u[7] = out, lse
        else:
            u[0], u[1], u[2], u[3], u[4] = q, k_cache, v_cache, out, lse
        self._f32[2 * self._scale] = sm_scale
        for i, (_, value) in enumerate(params, self._scale + 1):
            self._store(i, value)

    def values(self) -> tuple:
        """The packed arguments as kernel_args returns them (for tests)."""
        views = {np.uint64: self._u64, np.int32: self._i32, np.float32: self._f32}
        return tuple(t(views[t][i if t is np.uint64 else 2 * i])
                     for i, t in enumerate(self._types))


# ---------------------------------------------------------------------------- the runtime


class BatchAttention:
    """Batched attention of one variant over a paged KV cache (plan once, run per layer).

    Args:
        variant_or_module: an ir.Variant (compiled on demand, cached) or a KernelModule
            (`attnlang.load_compiled`) built for the same head_dim and dtype.
        num_qo_heads, num_kv_heads: query and KV heads (num_qo_heads % num_kv_heads == 0).
        head_dim: 64, 128 or 256.
        dtype: "bfloat16" / "float16" (or "bf16", "fp16", a NumPy/CuPy/torch dtype).
        page_size: tokens per page of the KV cache.
        max_batch_size, max_total_q: the largest batch plan() will accept; with
            max_kv_indices (most page-table entries in one batch) they size the workspace,
            allocated once here so its pointers never move (CUDA graphs).
        max_work_items, max_partial_rows, max_merge_rows: planner capacities; by default
            the worst case for (max_batch_size, max_total_q) with automatic KV splitting,
            so only a kv_chunk_size override in plan() can exceed them.
        arch: target of the compile (default: the device's; sm_90a on H100).
        num_ctas: CTAs of the decode grid (default: SMs x occupancy, at most 4 per SM) and,
            when given, of the prefill grid too.
        num_prefill_ctas: CTAs of the prefill grid (default: num_ctas if given, else SMs x
            the prefill kernel's occupancy).
        prefill_min_rows: requests with more fused rows (qo_len x group) than this run in
            the prefill kernel, the others in the decode kernel (default
            `planner.PREFILL_MIN_ROWS`, 3: see there why).
        device: CUDA device ordinal (default: CuPy's current device).

    Kernels: each planned request runs in the decode kernel (CUDA cores, up to 16 fused
    rows per work item) or, when it has more than prefill_min_rows fused rows
    (qo_len * group; by default more than 3, so GQA groups of 4 or more decode on tensor
    cores), in the prefill kernel (tensor cores, 128-row tiles); a batch may mix both
    (planner.plan_mixed). Split requests of either kind merge in one merge kernel.

    Streams: plan() copies on CuPy's current stream; run() launches on the caller's current
    stream (torch's for torch tensors) after waiting for the last plan's copy, and plan()
    waits for the last run() before rewriting the workspace, so mixing streams is safe.

    CUDA graphs: capture run() (with out=, lse= and device tensor params, so nothing is
    allocated or copied inside the graph) once; after each later plan(), replaying the graph
    runs the new plan, as long as q/out/lse/k_cache/v_cache are the same buffers (views at the
    same start), total_q fits them, and the replay is ordered after plan() (same stream, or
    synchronize). The merge kernel is always captured, so a replan that splits still merges.

    Example::

        attn = BatchAttention(al.load("examples/softcap.attn"), num_qo_heads=32,
                              num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
        attn.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)   # host int arrays
        out = attn.run(q, (k_cache, v_cache), params={"cap": 30.0})
        # q [total_q, 32, 128] bf16; k_cache/v_cache [num_pages, 16, 8, 128]; out like q
        out, lse = attn.run(q, (k_cache, v_cache), return_lse=True)    # lse [total_q, 32]
    """

    def __init__(self, variant_or_module: ir.Variant | KernelModule, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: Any = "bfloat16",
                 page_size: int = 16, *, max_batch_size: int = 256, max_total_q: int = 8192,
                 max_kv_indices: int = 1 << 20, max_work_items: int | None = None,
                 max_partial_rows: int | None = None, max_merge_rows: int | None = None,
                 arch: str | None = None, num_ctas: int | None = None,
                 num_prefill_ctas: int | None = None, prefill_min_rows: int | None = None,
                 device: int | None = None):
        # Everything checkable without a GPU first, so mistakes fail fast and anywhere.
        self.shape = validate_shape(num_qo_heads, num_kv_heads, head_dim, dtype, page_size)
        for name, value in (("max_batch_size", max_batch_size), ("max_total_q", max_total_q),
                            ("max_kv_indices", max_kv_indices)):
            _check_count(name, value)
        for name, value in (("max_work_items", max_work_items),
                            ("max_partial_rows", max_partial_rows),
                            ("max_merge_rows", max_merge_rows), ("num_ctas", num_ctas),
                            ("num_prefill_ctas", num_prefill_ctas)):
            if value is not None:
                _check_count(name, value)
        if prefill_min_rows is None:
            prefill_min_rows = planner.PREFILL_MIN_ROWS
        if isinstance(prefill_min_rows, bool) or not isinstance(prefill_min_rows,
                                                                (int, np.integer)):
            raise TypeError("prefill_min_rows must be an integer >= 0, got "
                            f"{type(prefill_min_rows).__name__}")
        if prefill_min_rows < 0:
            raise ValueError(f"prefill_min_rows must be an integer >= 0, got {prefill_min_rows}")
        self.prefill_min_rows = int(prefill_min_rows)
        if isinstance(variant_or_module, KernelModule):
            _check_module(variant_or_module, self.shape)
        elif not isinstance(variant_or_module, ir.Variant):
            raise TypeError(
                "variant_or_module must be an attnlang Variant (attnlang.load(...)) or a "
                f"compiled KernelModule (attnlang.load_compiled(...)), got "
                f"{type(variant_or_module).__name__}"
            )

        import cupy

        from attnlang.codegen.config import launch_config

        self.device = cupy.cuda.Device(device).id if device is None else int(device)
        if isinstance(variant_or_module, KernelModule):
            self.module = variant_or_module
        else:
            from attnlang import env
            from attnlang.runtime.module import compile_variant, device_arch

            if arch is None:
                # The device decides (Hopper gets its arch-specific target) unless
                # ATTNLANG_ARCH says otherwise.
                native = device_arch(self.device)
                arch = env.arch() or ("sm_90a" if native == "sm_90" else native)
            self.module = compile_variant(variant_or_module, head_dim=self.shape.head_dim,
                                          dtype=self.shape.dtype, arch=arch)
        # The IR mask trims each work unit's KV range at plan time (planner._trim). A module
        # loaded from disk (load_compiled) carries no IR: its plans cover the whole KV range
        # and the kernels skip the EMPTY tiles themselves.
        variant = (variant_or_module if isinstance(variant_or_module, ir.Variant)
                   else getattr(self.module, "variant", None))
        self._mask = variant.mask if variant is not None else None
        s = self.shape
        arch = self.module.arch  # the prefill kernel's path (and launch) depends on it
        self._decode_cfg = launch_config("decode", s.head_dim, s.group_size, s.dtype, arch)
        self._prefill_cfg = launch_config("prefill", s.head_dim, s.group_size, s.dtype, arch)
        self._merge_cfg = launch_config("merge", s.head_dim, s.group_size, s.dtype, arch)
        self._decode = self.module.function("decode", self.device,
                                            dynamic_smem=self._decode_cfg.smem_bytes)
        self._prefill = self.module.function("prefill", self.device,
                                             dynamic_smem=self._prefill_cfg.smem_bytes)
        self._merge = self.module.function("merge", self.device,
                                           dynamic_smem=self._merge_cfg.smem_bytes)
        self.num_ctas = (int(num_ctas) if num_ctas is not None
                         else self._default_num_ctas(self._decode, self._decode_cfg))
        if num_prefill_ctas is not None:
            self.num_prefill_ctas = int(num_prefill_ctas)
        elif num_ctas is not None:
            self.num_prefill_ctas = self.num_ctas
        else:
            self.num_prefill_ctas = self._default_num_ctas(self._prefill, self._prefill_cfg)
        self._tilings = {
            "decode": Tiling(self._decode_cfg.rows_per_tile, self.num_ctas,
                             max(1, int(self._decode_cfg.kv_tile or 1))),
            "prefill": Tiling(self._prefill_cfg.rows_per_tile, self.num_prefill_ctas,
                              max(1, int(self._prefill_cfg.kv_tile or 1))),
        }

        worst = worst_case_mixed_bounds(
            max_batch_size=max_batch_size, max_total_q=max_total_q,
            num_kv_heads=s.num_kv_heads, group_size=s.group_size, **self._tilings)
        self.bounds = PlanBounds(
            max_batch_size=max_batch_size, max_total_q=max_total_q,
            max_work_items=max_work_items or worst.max_work_items,
            max_partial_rows=max_partial_rows or worst.max_partial_rows,
            max_merge_rows=max_merge_rows or worst.max_merge_rows,
        )
        self.max_kv_indices = int(max_kv_indices)
        self._layout = workspace_layout(self.num_ctas, self.bounds, self.max_kv_indices,
                                        self.num_prefill_ctas)
        # The merge kernel loops over rows, so a grid of a few CTAs per SM covers any count.
        merge_ctas = -(-self.bounds.max_merge_rows // max(1, self._merge_cfg.rows_per_tile))
        self._merge_grid = max(1, min(merge_ctas, 8 * self._num_sms()))
        with cupy.cuda.Device(self.device):
            self._ints = cupy.zeros(self._layout.total, dtype=np.int32)
            rows = self.bounds.max_partial_rows
            self._partial_o = cupy.empty((rows, s.head_dim), dtype=np.float32)
            self._partial_lse = cupy.empty((rows,), dtype=np.float32)
            # lse target when the caller does not ask for lse: fixed, so graphs stay valid.
            self._lse_scratch = cupy.empty((max_total_q, s.num_qo_heads), dtype=np.float32)
        self._pinned = cupy.cuda.alloc_pinned_memory(self._layout.total * 4)
        self._host = np.frombuffer(self._pinned, dtype=np.int32, count=self._layout.total)
        with cupy.cuda.Device(self.device):
            # After the last plan's copy (guards the pinned buffer; run() waits on it) and
            # after the last run's launches (plan() waits on it before rewriting the
            # workspace, whichever streams the two use).
            self._copy_done = cupy.cuda.Event(disable_timing=True)
            self._run_done = cupy.cuda.Event(disable_timing=True)
        self._copied = self._ran = False
        base = self._ints.data.ptr
        self._ws = {name: base + 4 * off for name, off in self._layout.offsets.items()}
        self._ws["partial_o"] = self._partial_o.data.ptr
        self._ws["partial_lse"] = self._partial_lse.data.ptr
        # Per-call constants of run(): packed kernel arguments and launch dimensions.
        self._packed = {kind: PackedArgs(kind, self._ws, num_heads=s.num_qo_heads,
                                         num_kv_heads=s.num_kv_heads, page_size=s.page_size,
                                         num_params=len(self.module.params))
                        for kind in ("decode", "prefill", "merge")}
        self._launch_dims = {
            kind: ((int(grid), 1, 1), _block3(cfg.block), int(cfg.smem_bytes))
            for kind, grid, cfg in (("decode", self.num_ctas, self._decode_cfg),
                                    ("prefill", self.num_prefill_ctas, self._prefill_cfg),
                                    ("merge", self._merge_grid, self._merge_cfg))}
        # The kernels a CUDA graph must hold: those some batch within the bounds can reach.
        # A request has qo_len * group fused rows, from group up to max_total_q * group.
        self._reachable = {
            "decode": s.group_size <= self.prefill_min_rows,
            "prefill": max_total_q * s.group_size > self.prefill_min_rows,
            "merge": True,
        }
        self._run_key: tuple | None = None  # validate_run_inputs memo (see run())
        self._run_args: RunInputs | None = None
        self._plan: BatchPlan | None = None
        self._inputs: PlanInputs | None = None

    # -- properties

    @property
    def variant_name(self) -> str:
        return self.module.name

    @property
    def params(self) -> tuple[ir.ParamSpec, ...]:
        return self.module.params

    @property
    def last_plan(self) -> BatchPlan | None:
        """The BatchPlan of the last successful plan() call (for inspection and tests)."""
        return self._plan

    def __repr__(self) -> str:
        s = self.shape
        return (f"BatchAttention({self.module.name}, heads {s.num_qo_heads}/{s.num_kv_heads}, "
                f"d{s.head_dim} {s.dtype}, page_size {s.page_size}, {self.num_ctas} + "
                f"{self.num_prefill_ctas} CTAs, "
                f"{self.module.arch}, device {self.device})")

    # -- plan

    def plan(self, qo_indptr: Any, kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any,
             *, kv_chunk_size: int | None = None) -> BatchPlan:
        """Schedule a batch and upload its plan and page table (one copy, current stream).

        qo_indptr [batch+1]: request b owns queries qo_indptr[b]:qo_indptr[b+1] of q.
        kv_indptr [batch+1]: it owns pages kv_indices[kv_indptr[b]:kv_indptr[b+1]].
        kv_last_page_len [batch]: valid tokens in its last page (1..page_size; 0 if none).
        Host int arrays (device arrays are copied to the host once). kv_chunk_size: force
        the KV split bound (tests); None = automatic. On error the previous plan stays.
        Returns the BatchPlan (its .decode and .prefill work lists).
        """
        import cupy

        inputs = validate_plan_inputs(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                      page_size=self.shape.page_size)
        if inputs.kv_indices.shape[0] > self.max_kv_indices:
            raise CapacityError("max_kv_indices", inputs.kv_indices.shape[0],
                                self.max_kv_indices, "page-table entries (kv_indices)")
        plan = plan_mixed(
            inputs.qo_lens, inputs.kv_lens, num_kv_heads=self.shape.num_kv_heads,
            group_size=self.shape.group_size, **self._tilings,
            prefill_min_rows=self.prefill_min_rows, kv_chunk_size=kv_chunk_size,
            bounds=self.bounds, mask=self._mask, head_dim=self.shape.head_dim,
        )
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            if self._copied:
                self._copy_done.synchronize()  # the last copy has finished reading _host
            n = fill_workspace(self._layout, self._host, plan, inputs)
            if self._ran:
                stream.wait_event(self._run_done)  # earlier runs have read the workspace
            cupy.cuda.runtime.memcpyAsync(self._ints.data.ptr, self._host.ctypes.data, 4 * n,
                                          cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
            self._copy_done.record(stream)
        self._copied = True
        self._plan, self._inputs = plan, inputs
        return plan

    # -- run

    def run(self, q: Any, kv_cache: Any, params: Mapping[str, Any] | None = None, *,
            out: Any = None, lse: Any = None, return_lse: bool = False,
            sm_scale: float | None = None):
        """Attention of the planned batch. Validates everything before launching.

        q [total_q, num_qo_heads, head_dim]; kv_cache = (k_cache, v_cache), each
        [num_pages, page_size, num_kv_heads, head_dim]; params: the variant's run-time params
        by name; out (optional) like q; lse (optional) float32 [total_q, num_qo_heads];
        sm_scale default 1/sqrt(head_dim). Inputs are CuPy arrays or CUDA torch tensors
        (bf16 CuPy data without ml_dtypes: uint16 bits); outputs come back in the same type,
        on the caller's current stream (torch's for torch inputs).

        Returns out, or (out, lse) with return_lse=True; lse is the natural-log
        log-sum-exp of each row (-inf for a fully masked row), None for softmax-off
        variants. For CUDA-graph capture pass out= and lse= (fixed buffers), and device
        tensor params.
        """
        import cupy
        from cupy_backends.cuda.api import driver

        if self._plan is None or self._inputs is None:
            raise RuntimeError("call plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len) "
                               "before run()")
        inputs = self._inputs
        infos, key = self._run_memo_key(q, kv_cache, params, out, lse, sm_scale)
        memo = self._run_key
        if key is not None and memo is not None and memo[0] is inputs and memo[1] == key:
            # Same plan, same array descriptions (shape, dtype, strides, device, pointer),
            # same param objects, same sm_scale: the last validation holds. Fresh infos keep
            # the caller's objects (output type, stream), nothing else changes.
            last = self._run_args
            args = RunInputs(*infos, last.params, last.sm_scale, last.device)
        else:
            args = validate_run_inputs(self.shape, self.module.params, inputs, q, kv_cache,
                                       params, out=out, lse=lse, sm_scale=sm_scale,
                                       variant_name=self.module.name)
            if args.device != self.device:
                raise ValueError(f"q is on device {args.device} but this BatchAttention "
                                 f"lives on device {self.device}")
            if key is not None:
                self._run_key, self._run_args = (inputs, key), args
        with cupy.cuda.Device(self.device):
            stream = current_stream([args.q, args.k_cache, args.v_cache], self.device)
            capturing = stream.is_capturing()
            # Uploaded host params stay referenced until the launches are enqueued; freed
            # after, their memory is reused only by later work of this stream (CuPy's pool is
            # stream-ordered), i.e. after the kernels have read them.
            param_values, uploaded = args.params, []
            if self._host_params(args.params):
                param_values = []
                for spec, value in args.params:
                    if isinstance(value, np.ndarray):
                        if capturing:
                            raise ValueError(
                                f"param {spec.name!r} is a host array; while a CUDA graph is "
                                "being captured pass a device array (its copy cannot be "
                                "captured)")
                        with stream:
                            array, value = to_device_param(value, value.dtype.name,
                                                           self.device)
                        uploaded.append(array)
                    param_values.append((spec, value))
            out_obj, out_info = out, args.out
            if out_info is None:
                out_obj, out_info = empty_output(args.q, args.q.shape, args.q.dtype)
            lse_obj, lse_info = lse, args.lse
            if lse_info is None and return_lse and self.module.softmax:
                lse_obj, lse_info = empty_output(args.q, (inputs.total_q,
                                                          self.shape.num_qo_heads), "float32")
            lse_ptr = lse_info.ptr if lse_info is not None else self._lse_scratch.data.ptr
            if not capturing:
                stream.wait_event(self._copy_done)  # plan() may have used another stream
            call = (args.q.ptr, args.k_cache.ptr, args.v_cache.ptr, out_info.ptr, lse_ptr,
                    args.sm_scale, param_values)
            # A kernel whose work list is empty has nothing to do; under capture every kernel
            # a later plan() may use is recorded (fixed grids, fixed workspace).
            plan, reachable = self._plan, self._reachable
            for kind, fn, needed in (("decode", self._decode, plan.decode.num_work_items),
                                     ("prefill", self._prefill, plan.prefill.num_work_items),
                                     ("merge", self._merge, plan.merge_count)):
                if needed > 0 or (capturing and reachable[kind]):
                    (gx, gy, gz), (bx, by, bz), smem = self._launch_dims[kind]
                    packed = self._packed[kind]
                    packed.update(*call)
                    driver.launchKernel(fn.ptr, gx, gy, gz, bx, by, bz, smem, stream.ptr,
                                        packed.kernel_params, 0)
            del uploaded
            if not capturing:
                self._run_done.record(stream)
                self._ran = True
        if return_lse:
            return out_obj, (lse_obj if self.module.softmax else None)
        return out_obj

    # -- internals

    @staticmethod
    def _host_params(params) -> bool:
        for _, v in params:
            if isinstance(v, np.ndarray):
                return True
        return False

    @staticmethod
    def _run_memo_key(q, kv_cache, params, out, lse, sm_scale):
        """(infos, key) for run()'s validation memo: infos = TensorInfo of q, k_cache,
        v_cache, out, lse (None where absent); key None when the call must be validated in
        full (not a (k, v) pair, not a dict, host-array params whose contents may change)."""
        if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2 or q is None:
            return None, None
        if params is not None and not isinstance(params, dict):
            return None, None
        infos = (describe(q, "q"), describe(kv_cache[0], "k_cache"),
                 describe(kv_cache[1], "v_cache"), _describe_opt(out, "out"),
                 _describe_opt(lse, "lse"))
        arrays = tuple(None if i is None else
                       (i.shape, i.dtype, i.kind, i.device, i.strides, i.ptr) for i in infos)
        if params:
            for v in params.values():
                if not isinstance(v, (numbers.Number, TensorInfo)) and (
                        isinstance(v, (np.ndarray, list, tuple)) or not hasattr(
                            v, "__cuda_array_interface__") and not hasattr(v, "data_ptr")):
                    return infos, None
            # Identity of the values (kept alive by the key, so ids stay unique); scalars are
            # immutable, device tensors keep their pointer.
            pkey = tuple((k, id(v), v) for k, v in params.items())
        else:
            pkey = ()
        return infos, (arrays, pkey, type(sm_scale), sm_scale)

    def _num_sms(self) -> int:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(self.device)
        return int(props["multiProcessorCount"])

    def _default_num_ctas(self, fn, cfg) -> int:
        import cupy
        from cupy_backends.cuda.api import driver

        threads = math.prod(cfg.block) if isinstance(cfg.block, (tuple, list)) else cfg.block
        with cupy.cuda.Device(self.device):
            per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(
                fn.ptr, int(threads), int(cfg.smem_bytes))
        return self._num_sms() * max(1, min(int(per_sm), _MAX_CTAS_PER_SM))


def _block3(block) -> tuple[int, int, int]:
    b = tuple(int(x) for x in block) if isinstance(block, (tuple, list)) else (int(block),)
    return (b + (1, 1))[:3]


def _describe_opt(x: Any, name: str) -> TensorInfo | None:
    return None if x is None else describe(x, name)


def _check_module(module: KernelModule, shape: AttentionShape) -> None:
    if (module.head_dim, module.dtype) != (shape.head_dim, shape.dtype):
        raise ValueError(
            f"the compiled module {module.name} is {module.dtype} head_dim {module.head_dim}, "
            f"but this BatchAttention asks for {shape.dtype} head_dim {shape.head_dim}: "
            "compile the variant for those (attnlang.compile) or pass the Variant itself"
        )
    missing = [k for k in ("decode", "prefill", "merge") if k not in module.cubins]
    if missing:
        raise ValueError(f"the compiled module {module.name} lacks the {', '.join(missing)} "
                         "kernel(s) BatchAttention needs; compile it with the default kinds")

