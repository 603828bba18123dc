"""The device workspace of a BatchAttention and the arguments of its kernel launches.

plan() writes a host image of one int32 workspace (`workspace_layout`, `fill_workspace`) and
copies it to the GPU in one transfer; its sections sit at fixed offsets, so the kernels'
pointers never move and a CUDA graph captured once stays valid. `kernel_args` is the
argument list of each kernel (docs/INTERNALS.md order); `PackedArgs` holds it packed once
for cuLaunchKernel, so run() rewrites only the pointers and params of each call.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnlang import ir
from attnlang.runtime import tensor_maps
from attnlang.runtime.arrays import TensorInfo
from attnlang.runtime.dequantize import DequantPlan
from attnlang.runtime.plan_mixed import BatchPlan
from attnlang.runtime.planner import Plan, PlanBounds
from attnlang.runtime.validate import PlanInputs

__all__ = ["WorkspaceLayout", "workspace_layout", "fill_workspace", "kernel_args", "PackedArgs",
           "DeviceWorkspace", "allocate_workspace"]

# run()'s per-call array pointers, little-endian 8-byte slots (PackedArgs.update).
_FIVE_POINTERS, _TWO_POINTERS = struct.Struct("<5Q"), struct.Struct("<2Q")
_ONE_POINTER = struct.Struct("<Q")
_OUT_SLOT = 3  # the attention kernels' out (then lse)
# The merge kernel's out and lse arguments (kernel_args: after its six workspace pointers);
# the other kernels take q, k_cache, v_cache, out, lse first.
_MERGE_OUT_SLOT = 6
# Workspace sections start on 128-byte boundaries (32 int32s): coalesced, vector-loadable.
_ALIGN = 32

# Sections of the int32 workspace, in memory order. The page table goes last so one copy of
# [0, its start + used length) moves everything a plan wrote.
_WORK = ("work_request", "work_kv_head", "work_row_start", "work_kv_start", "work_kv_end",
         "work_partial")
# The prefill kernel's work list: the same arrays under a "prefill_" prefix; the cascade
# kernel's under "cascade_", with its items' group ends and q_pos ranges and each token's
# request.
_PREFILL_PREFIX = "prefill_"
_CASCADE_PREFIX = "cascade_"
_SECTIONS = (
    "work_indptr", "merge_count", "qo_indptr", "kv_indptr", "kv_last_page_len", *_WORK,
    "prefill_work_indptr", *(_PREFILL_PREFIX + name for name in _WORK),
    "cascade_work_indptr", *(_CASCADE_PREFIX + name for name in _WORK), "cascade_item",
    "token_request",
    "merge_indptr", "merge_token", "merge_head", "merge_request", "merge_slots",
    "dequant_work_indptr", "dequant_pages", "kv_indices",
)
# The kernels reading an fp8 cache's prefill pages through a converted copy
# (runtime/dequantize.py): the conversion, then the prefill kernel of a bf16/fp16 cache, which
# reads the copy (fixed pointers: k_cache, v_cache and its tensor maps are the copy's) and
# its own work-list index (the prefill list's, or empty when the plan converts nothing).
DEQUANTIZE, PREFILL_DEQUANTIZED = "dequantize", "prefill_dequantized"


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
                     num_prefill_ctas: int | None = None,
                     cascade: bool = False, dequant_pages: int = 0) -> WorkspaceLayout:
    """The fixed layout of the int32 workspace for these capacities: the decode kernel's work
    list (num_ctas CTAs), the prefill kernel's (num_prefill_ctas, default num_ctas), each
    holding up to bounds.max_work_items items, the merge list and the page table; with
    cascade, the cascade kernel's list (num_prefill_ctas) and its arrays (else they are
    empty sections); with dequant_pages (an fp8 cache's converted copy, its slots), the
    conversion's page list (its count first) and the converted prefill's work-list index.

    Example: ``workspace_layout(132, worst_case_bounds(...), 1 << 20).total``.
    """
    b, w = bounds.max_batch_size, bounds.max_work_items
    m, p = bounds.max_merge_rows, bounds.max_partial_rows
    prefill_ctas = num_ctas if num_prefill_ctas is None else num_prefill_ctas
    caps = {
        "work_indptr": num_ctas + 1, "prefill_work_indptr": prefill_ctas + 1, "merge_count": 1,
        "qo_indptr": b + 1, "kv_indptr": b + 1, "kv_last_page_len": b, "merge_indptr": m + 1,
        "merge_slots": p, "kv_indices": max_kv_indices,
        "dequant_pages": dequant_pages + 1 if dequant_pages else 0,
        "dequant_work_indptr": prefill_ctas + 1 if dequant_pages else 0,
    }
    for name in _WORK:
        caps[name] = caps[_PREFILL_PREFIX + name] = w
        caps[_CASCADE_PREFIX + name] = w if cascade else 0
    caps["cascade_work_indptr"] = prefill_ctas + 1 if cascade else 0
    caps["cascade_item"] = 3 * w if cascade else 0
    caps["token_request"] = bounds.max_total_q if cascade else 0
    for name in ("merge_token", "merge_head", "merge_request"):
        caps[name] = m
    offsets, at = {}, 0
    for name in _SECTIONS:
        offsets[name] = at
        at += -(-max(caps[name], 1) // _ALIGN) * _ALIGN
    return WorkspaceLayout(offsets, caps, at)


def fill_workspace(layout: WorkspaceLayout, host: np.ndarray, plan: BatchPlan | Plan,
                   inputs: PlanInputs, dequant: DequantPlan | None = None) -> int:
    """Write `plan` and the page table into the host image of the workspace (int32, at
    least layout.total long). Returns how many leading elements must be copied to the GPU.
    A bare Plan (plan_batch) is a decode-only batch: the prefill list is left empty. With
    `dequant` (an fp8 cache's prefill through its converted copy) the prefill list is the
    converted prefill's, the conversion's page list is written and the page table is
    dequant.kv_indices. The caller has checked the capacities (the planner's bounds,
    max_kv_indices, the copy's slots)."""
    off = layout.offsets
    host[off["merge_count"]] = plan.merge_count
    kv_indices = inputs.kv_indices if dequant is None else dequant.kv_indices
    arrays = [("qo_indptr", inputs.qo_indptr), ("kv_indptr", inputs.kv_indptr),
              ("kv_last_page_len", inputs.kv_last_page_len), ("kv_indices", kv_indices),
              *plan.merge_arrays().items()]
    if isinstance(plan, BatchPlan):
        arrays += plan.decode.work_arrays().items()
        arrays += [(_PREFILL_PREFIX + k, a) for k, a in plan.prefill.work_arrays().items()]
        if layout.capacity["cascade_work_indptr"]:
            start = off["cascade_work_indptr"]
            host[start:start + layout.capacity["cascade_work_indptr"]] = 0
        if plan.cascade is not None:
            arrays += [(_CASCADE_PREFIX + k, a) for k, a in plan.cascade.work_arrays().items()]
            arrays += [("cascade_item", plan.cascade_item),
                       ("token_request", plan.token_request)]
    else:
        arrays += plan.work_arrays().items()
        start = off["prefill_work_indptr"]
        host[start:start + layout.capacity["prefill_work_indptr"]] = 0
    for name, array in arrays:
        n = array.shape[0]
        if n:  # empty sections (an unused list, no merges) have nothing to write
            start = off[name]
            host[start:start + n] = array
    if layout.capacity["dequant_pages"]:
        _fill_dequant(layout, host, dequant)
    elif dequant is not None:
        raise ValueError("this workspace has no room for a converted copy's pages")
    return layout.copy_elems(inputs.kv_indices.shape[0])


def _fill_dequant(layout: WorkspaceLayout, host: np.ndarray, dequant: DequantPlan | None):
    """The conversion's page list (count first) and the converted prefill's list index: the
    prefill list runs in the converted prefill (its index moved there, the fp8 cache's
    prefill kernel's zeroed) or in the fp8 cache's prefill kernel, never both."""
    off, size = layout.offsets, layout.capacity["dequant_work_indptr"]
    moved, index = off["dequant_work_indptr"], off["prefill_work_indptr"]
    pages = off["dequant_pages"]
    if dequant is None:
        host[pages] = 0
        host[moved:moved + size] = 0
        return
    n = dequant.pages.shape[0]
    host[pages] = n
    host[pages + 1:pages + 1 + n] = dequant.pages
    host[moved:moved + size] = host[index:index + size]
    host[index:index + size] = 0


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
    if kind == PREFILL_DEQUANTIZED:
        # The prefill kernel's arguments over the converted copy: its pages, its tensor maps,
        # and the prefill list behind its own index.
        return kernel_args("prefill", q=q, k_cache=ws["dequant_k"], v_cache=ws["dequant_v"],
                           out=out, lse=lse, ws={**ws, "tma_maps": ws["dequant_tma_maps"],
                                                 "prefill_work_indptr":
                                                     ws["dequant_work_indptr"]},
                           num_heads=num_heads, num_kv_heads=num_kv_heads,
                           page_size=page_size, sm_scale=sm_scale, params=params)
    if kind == DEQUANTIZE:
        return (ptr(q), ptr(k_cache), ptr(v_cache), ptr(out), ptr(lse),
                ptr(ws["dequant_pages"]), ptr(ws["dequant_k"]), ptr(ws["dequant_v"]), *tail)
    if kind in ("decode", "prefill", "cascade"):
        # Same arguments (INTERNALS.md); each kernel reads its own work list, the cascade
        # kernel two more arrays after it.
        prefix = {"prefill": _PREFILL_PREFIX, "cascade": _CASCADE_PREFIX}.get(kind, "")
        work = [ptr(ws[prefix + name]) for name in ("work_indptr", *_WORK)]
        if kind == "cascade":
            work += [ptr(ws["cascade_item"]), ptr(ws["token_request"])]
        if kind != "decode":  # the producer's tensor maps (tensor_maps.py; 0: none)
            work.append(ptr(ws.get("tma_maps", 0)))
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
                 "_bytes", "_floats", "kernel_params")

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
        # The same bytes seen by struct.pack_into and as floats: one pack_into call writes
        # a call's five pointers (NumPy item assignment costs ~5x more, on the hot path).
        self._bytes, self._floats = memoryview(self._u64).cast("B"), memoryview(self._f32)
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
        if self._kind == "merge":
            _TWO_POINTERS.pack_into(self._bytes, 8 * _MERGE_OUT_SLOT, out, lse)
        elif self._kind == PREFILL_DEQUANTIZED:  # its k_cache and v_cache are the copy's
            _ONE_POINTER.pack_into(self._bytes, 0, q)
            _TWO_POINTERS.pack_into(self._bytes, 8 * _OUT_SLOT, out, lse)
        else:
            _FIVE_POINTERS.pack_into(self._bytes, 0, q, k_cache, v_cache, out, lse)
        self._floats[2 * self._scale] = sm_scale
        for i, (_, value) in enumerate(params, self._scale + 1):
            self._store(i, value)

    def snapshot(self) -> tuple[tuple[int, int, int, int], int, bytes]:
        """(the slots of q, k_cache, v_cache, out: -1 where the kernel has none; the slot of
        the variant's first param; the packed bytes as they are now), what hostpath.FastRun
        launches from."""
        slots = ((-1, -1, -1, _MERGE_OUT_SLOT) if self._kind == "merge" else
                 (0, -1, -1, _OUT_SLOT) if self._kind == PREFILL_DEQUANTIZED else
                 (0, 1, 2, _OUT_SLOT))
        return slots, self._scale + 1, bytes(self._bytes)

    def values(self) -> tuple:
        """The packed arguments as kernel_args returns them (for tests)."""
        views = {np.uint64: self._u64, np.int32: self._i32, np.float32: self._f32}
        return tuple(t(views[t][i if t is np.uint64 else 2 * i])
                     for i, t in enumerate(self._types))


@dataclass(frozen=True)
class DeviceWorkspace:
    """A BatchAttention's device memory, allocated once so that every pointer a kernel (or a
    captured CUDA graph) holds stays valid: the int32 workspace (`ints`, with its pinned host
    image `host` that plan() fills and copies in one transfer), the partial states of split
    requests, the lse target of calls that do not ask for lse, and one fixed buffer per
    per-pair mask param (rewritten by every plan()). `pointers`: each section's address by
    name (`kernel_args`' `ws`), partial_o and partial_lse included."""

    layout: WorkspaceLayout
    ints: Any               # cupy int32 [layout.total]
    host: np.ndarray        # int32 [layout.total], over `pinned`
    pinned: Any             # the page-locked host memory under `host`
    partial_o: Any          # cupy float32 [max_partial_rows, head_dim_vo]
    partial_lse: Any        # cupy float32 [max_partial_rows]
    lse_scratch: Any        # cupy float32 [max_total_q, num_qo_heads]
    pair_buffers: Mapping[str, Any]       # cupy uint8 [max_pair_mask_bytes] per pair param
    pair_values: Mapping[str, np.uint64]  # their addresses, as the kernels take them
    tma_maps: Any           # cupy uint8: the prefill producer's tensor maps, or None
    pointers: Mapping[str, int]


def allocate_workspace(layout: WorkspaceLayout, bounds: PlanBounds, *, max_total_q: int,
                       num_qo_heads: int, head_dim_vo: int, pair_names: Sequence[str],
                       max_pair_mask_bytes: int, device: int,
                       tma_templates: Callable[[int], bytes] | None = None,
                       tma_ctas: int = 0) -> DeviceWorkspace:
    """Allocate a `DeviceWorkspace` on `device` (needs a GPU). tma_templates: where the prefill
    kernel copies tiles by TMA, the maps' templates for the buffer's address
    (tensor_maps.map_templates), written once; the buffer has room for tma_ctas CTAs' maps."""
    import cupy

    tma_maps = None
    with cupy.cuda.Device(device):
        if tma_templates is not None:
            tma_maps = cupy.zeros(tensor_maps.buffer_bytes(tma_ctas), dtype=np.uint8)
            templates = np.frombuffer(tma_templates(tma_maps.data.ptr), dtype=np.uint8)
            tma_maps[:templates.size].set(templates)
        pair_buffers = {name: cupy.zeros(max_pair_mask_bytes, dtype=np.uint8)
                        for name in pair_names}
        ints = cupy.zeros(layout.total, dtype=np.int32)
        rows = bounds.max_partial_rows
        partial_o = cupy.empty((rows, head_dim_vo), dtype=np.float32)
        partial_lse = cupy.empty((rows,), dtype=np.float32)
        lse_scratch = cupy.empty((max_total_q, num_qo_heads), dtype=np.float32)
    pinned = cupy.cuda.alloc_pinned_memory(layout.total * 4)
    host = np.frombuffer(pinned, dtype=np.int32, count=layout.total)
    base = ints.data.ptr
    pointers = {name: base + 4 * off for name, off in layout.offsets.items()}
    pointers["partial_o"] = partial_o.data.ptr
    pointers["partial_lse"] = partial_lse.data.ptr
    pointers["tma_maps"] = tma_maps.data.ptr if tma_maps is not None else 0
    return DeviceWorkspace(layout, ints, host, pinned, partial_o, partial_lse, lse_scratch,
                           pair_buffers,
                           {name: np.uint64(buf.data.ptr) for name, buf in pair_buffers.items()},
                           tma_maps, pointers)
