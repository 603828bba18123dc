"""Prefill of an fp8 cache through a converted copy of its pages.

The prefill kernel reads each key tile of a request once per 128-row query tile: a causal
4096-token prompt with GQA 4 reads a page ~66 times. Converting e4m3 -> bf16 inside the
kernel costs on every read (the producer's conversion: 0.79x of a bf16 cache's prefill at
S4096), so where a plan's prefill reads its keys often enough, run() first converts the pages
it reads once (the dequantize kernel, dequantize.cu.j2) into a bf16/fp16 copy of fixed size,
and the prefill kernel compiled for a bf16/fp16 cache attends over the copy: the same variant,
whose hooks see the dequantised values. Decode steps keep reading the fp8 pages (they read
each page once).

`why_no_copy` says whether a BatchAttention builds a copy, `choose_pages` which pages a plan
converts and `plan_copy` what plan() takes (pure, CPU); `Dequantizer` holds the two kernels
and the copy on one device. The copy's slots are the plan's pages in the order its prefill
requests list them, so the page table the prefill kernel reads is the plan's with those
entries replaced by their slots (the decode kernel's requests keep theirs: a request runs in
one kernel only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from attnlang.codegen.config import KV_FP8
from attnlang.runtime.plan_mixed import BatchPlan
from attnlang.runtime.planner import CapacityError
from attnlang.runtime.validate import AttentionShape, PlanInputs

__all__ = ["MIN_READS_PER_KEY", "DequantPlan", "choose_pages", "plan_copy", "reachable",
           "why_no_copy", "page_bytes", "capacity_pages", "Dequantizer"]

# Reads of each converted key by the plan's prefill items at and above which converting
# first pays (benchmarks/NOTES.md, "fp8 prefill through a converted copy").
MIN_READS_PER_KEY = 24
# The dequantize kernel's CTAs (256 threads) per SM: a grid-stride loop over the chunks. In
# a prompt's graph 8 ran S4096 0.4-1% faster than 4 (6 fit at once; the rest start as the
# first finish) and S16384 the same (benchmarks/NOTES.md, thirtieth session).
_CTAS_PER_SM = 8


@dataclass(frozen=True)
class DequantPlan:
    """The pages one plan's prefill reads, converted before it runs.

    pages: the cache page of each slot of the copy (int32, slot order); kv_indices: the page
    table the kernels read (the plan's, the prefill requests' entries replaced by slots);
    reads_per_key: the prefill items' key reads per converted key (why it was chosen).
    """

    pages: np.ndarray
    kv_indices: np.ndarray
    reads_per_key: float


def reachable(max_qo_len: int, *, group_size: int, rows_per_tile: int) -> bool:
    """Can a plan within these bounds read a key MIN_READS_PER_KEY times, so that it would
    take the copy by itself? A request's items read each of its keys at most once per tile
    of rows_per_tile fused rows (qo_len * group_size). Where not, a BatchAttention builds no
    copy and its CUDA graphs hold no launch of it (an empty launch costs a graph 3-5 us).

    >>> reachable(1, group_size=4, rows_per_tile=128), reachable(737, group_size=4,
    ...                                                          rows_per_tile=128)
    (False, True)
    """
    return -(-max_qo_len * group_size // rows_per_tile) >= MIN_READS_PER_KEY


def why_no_copy(shape: AttentionShape, *, max_bytes: int, has_variant: bool,
                prefill_reachable: bool, max_qo_len: int, rows_per_tile: int) -> str | None:
    """Why a BatchAttention of `shape` builds no copy (plan(dequantize=True)'s error says
    it), or None where it builds one: an fp8 cache whose prefill a request within the bounds
    reaches and reads often enough (`reachable`), room for a page, and the variant itself to
    compile the copy's prefill kernel from."""
    if shape.kv_dtype != KV_FP8:
        return "its cache is not fp8"
    if capacity_pages(shape, max_bytes) == 0:
        return f"max_dequant_bytes={max_bytes} holds no page ({page_bytes(shape)} bytes)"
    if not has_variant:
        return ("it runs a compiled module without its variant (load_compiled); pass the "
                "Variant")
    if not prefill_reachable or not reachable(max_qo_len, group_size=shape.group_size,
                                              rows_per_tile=rows_per_tile):
        return (f"no request of max_qo_len={max_qo_len} queries reads a key "
                f"{MIN_READS_PER_KEY} times (one read per {rows_per_tile} fused rows)")
    return None


def plan_copy(plan: BatchPlan, inputs: PlanInputs, shape: AttentionShape, *, capacity: int,
              max_bytes: int, no_copy: str | None,
              force: bool | None = None) -> DequantPlan | None:
    """`choose_pages` for a BatchAttention (its copy's `capacity` slots, or `no_copy`, the
    reason it has none); force=True is refused where there is no copy (ValueError) or the
    pages do not fit it (CapacityError naming max_dequant_bytes)."""
    if force not in (None, True, False):
        raise TypeError(f"dequantize must be None, True or False, got {force!r}")
    if no_copy is not None:
        if force:
            raise ValueError(f"plan(dequantize=True): this BatchAttention has no converted "
                             f"copy: {no_copy}")
        return None
    chosen = choose_pages(plan, inputs, page_size=shape.page_size, capacity=capacity,
                          force=force)
    if force and chosen is None:
        needed = choose_pages(plan, inputs, page_size=shape.page_size, capacity=1 << 62,
                              force=True)
        if needed is not None:  # (None: no prefill item reads a key)
            raise CapacityError("max_dequant_bytes", needed.pages.size * page_bytes(shape),
                                max_bytes, "bytes of converted pages")
    return chosen


def page_bytes(shape: AttentionShape) -> int:
    """Bytes one page takes in the copy: its keys and values in the query dtype."""
    return shape.page_size * shape.num_kv_heads * (shape.head_dim + shape.head_dim_vo) * 2


def capacity_pages(shape: AttentionShape, max_bytes: int) -> int:
    """Pages a copy of max_bytes holds (0: none)."""
    return int(max_bytes) // page_bytes(shape)


def choose_pages(plan: BatchPlan, inputs: PlanInputs, *, page_size: int, capacity: int,
                 force: bool | None = None) -> DequantPlan | None:
    """Whether `plan`'s prefill reads a converted copy, and of which pages.

    The pages of each prefill request covering its items' KV ranges are converted when they
    fit `capacity` slots and the items read each converted key MIN_READS_PER_KEY times or
    more (force=True: whenever they fit; False: never). Not with a cascade's shared levels
    (the cascade kernel reads the grouped requests' pages itself). Returns None for no copy.

    Example: a causal prompt of 4096 queries over its 4096 keys, GQA 4, reads each key ~66
    times (64 tiles of 128 fused rows per KV head, each its keys up to the diagonal), so
    ``choose_pages(plan, inputs, page_size=16, capacity=4096).pages`` are its 256 pages.
    """
    if force is False or capacity <= 0 or plan.cascade is not None:
        return None
    work = plan.prefill
    if work.num_work_items == 0:
        return None
    requests = work.work_request
    starts = np.full(inputs.batch_size, np.iinfo(np.int64).max, dtype=np.int64)
    ends = np.zeros(inputs.batch_size, dtype=np.int64)
    np.minimum.at(starts, requests, work.work_kv_start)
    np.maximum.at(ends, requests, work.work_kv_end)
    chosen = np.flatnonzero(ends > starts)  # requests whose items read keys
    if chosen.size == 0:
        return None
    first_page, end_page = starts[chosen] // page_size, -(-ends[chosen] // page_size)
    counts = end_page - first_page
    if int(counts.sum()) > capacity:
        return None
    reads = int((work.work_kv_end - work.work_kv_start).sum())
    converted = int((ends[chosen] - starts[chosen]).sum()) * plan.prefill.num_kv_heads
    reads_per_key = reads / converted
    if force is None and reads_per_key < MIN_READS_PER_KEY:
        return None
    # The table entries of those pages, in request order: entry kv_indptr[b] + page.
    entries = np.repeat(inputs.kv_indptr[chosen].astype(np.int64) + first_page, counts)
    entries += np.arange(entries.size) - np.repeat(np.cumsum(counts) - counts, counts)
    kv_indices = inputs.kv_indices.copy()
    pages = kv_indices[entries].astype(np.int32)
    kv_indices[entries] = np.arange(entries.size, dtype=kv_indices.dtype)
    return DequantPlan(pages, kv_indices, reads_per_key)


class Dequantizer:
    """The copy and its two kernels for one fp8 BatchAttention on `device` (needs a GPU).

    variant: the fp8 module's variant (the prefill kernel of a bf16/fp16 cache is compiled
    from it); params: the fp8 module's params (k_scale, v_scale last); capacity: slots of the
    copy (pages); prefill_smem, prefill_ctas: the prefill kernel's launch (the fp8 one's).
    `pointers` are the copy's workspace entries (workspace.kernel_args' dequant_*).
    """

    THREADS = 256  # dequantize.cu.j2's kThreads

    def __init__(self, variant: Any, params: tuple, shape: AttentionShape, *, arch: str,
                 device: int, capacity: int, prefill_smem: int, prefill_ctas: int):
        import cupy

        from attnlang.codegen.render import render_dequantize
        from attnlang.runtime import tensor_maps
        from attnlang.runtime.compiler import compile_source
        from attnlang.runtime.module import compile_variant

        s = shape
        self.capacity = int(capacity)
        self.module = compile_variant(variant, head_dim=s.head_dim, dtype=s.dtype, arch=arch,
                                      head_dim_vo=s.head_dim_vo, kv_dtype=None,
                                      kinds=("prefill",))
        self.prefill = self.module.function("prefill", device, dynamic_smem=prefill_smem)
        source = render_dequantize(tuple(params), s.dtype, s.head_dim, s.head_dim_vo)
        self._cubin = compile_source(source, arch, name="dequantize.cu",
                                     label=f"dequantize {s.dtype} d{s.head_dim}")
        with cupy.cuda.Device(device):
            self._cupy_module = cupy.cuda.Module()
            self._cupy_module.load(bytes(self._cubin.data))
            self.convert = self._cupy_module.get_function("dequantize")
            rows = (self.capacity, s.page_size, s.num_kv_heads)
            self.k_pages = cupy.empty((*rows, s.head_dim), dtype=np.uint16)
            self.v_pages = cupy.empty((*rows, s.head_dim_vo), dtype=np.uint16)
            self.tma_maps = None
            if tensor_maps.uses_tma(s.head_dim, s.head_dim_vo, s.dtype, s.dtype, s.page_size,
                                    arch, s.ragged):
                self.tma_maps = cupy.zeros(tensor_maps.buffer_bytes(prefill_ctas),
                                           dtype=np.uint8)
                templates = tensor_maps.map_templates(s.head_dim, s.head_dim_vo,
                                                      s.num_kv_heads, s.dtype,
                                                      self.tma_maps.data.ptr)
                self.tma_maps[:len(templates)].set(np.frombuffer(templates, dtype=np.uint8))
        sms = int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])
        self.convert_ctas = sms * _CTAS_PER_SM
        self.pointers = {"dequant_k": self.k_pages.data.ptr, "dequant_v": self.v_pages.data.ptr,
                         "dequant_tma_maps": 0 if self.tma_maps is None
                         else self.tma_maps.data.ptr}
