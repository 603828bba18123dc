"""BatchAttention: plan() a ragged batch over a paged KV cache on the CPU, run() it on the GPU.

The split of work follows FlashInfer's plan/run API:

- ``plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)`` validates the batch layout
  (host arrays), schedules it (`plan_mixed.plan_mixed`), and copies the plan and the page table
  into a device workspace allocated once at construction, with one host-to-device copy from
  a pinned staging buffer, on the current stream.
- ``run(q, (k_cache, v_cache), params)`` validates every input before anything is launched
  (`validate_run_inputs`, a pure function of shapes and dtypes), then launches the variant's
  decode kernel on a fixed grid of `num_ctas` CTAs, its prefill kernel on a fixed grid of
  `num_prefill_ctas` CTAs and the merge kernel on a fixed grid, on the caller's current
  stream. A plan sends each request to one of the two attention kernels (`plan_mixed`:
  prefill, on tensor cores, when it has more than `prefill_min_rows` fused rows, which with
  GQA groups of 4 or more includes single-token decode; with an fp8 cache (head dims 64-256)
  the decode kernel runs on tensor cores itself and keeps groups up to 8), each with its own
  work list. A kernel that no batch within the construction bounds can reach is never
  launched.
  All workspace pointers are fixed for the object's lifetime, so a CUDA graph captured
  around run() stays valid after later plan() calls: plan() only rewrites the workspace's
  contents.

Everything that can be checked without a GPU is a pure function in the modules beside this
one, so it is tested on machines without one: `validate` (validate_shape,
check_construction, validate_plan_inputs, validate_run_inputs, resolve_params), `workspace`
(workspace_layout, fill_workspace, kernel_args, PackedArgs; re-exported here), `module`
(check_module_fits) and `pairmask` (plan_masks). What needs the GPU lives beside them too:
the compiled module (`module.module_for`), the device buffers (`workspace.allocate_workspace`),
the kernels and their launches (`launches`) and an fp8 cache's scales (`kv_scales`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np

from attnlang import ir
from attnlang.codegen.config import KV_FP8
from attnlang.runtime import cascade as cascades
from attnlang.runtime import hostpath, pairmask, tensor_maps
from attnlang.runtime.arrays import (
    TensorInfo,
    current_stream_ptr,
    data_ptr,
    external_stream,
    to_device_param,
)
from attnlang.runtime.calls import CheckedCall, describe_call, empty_lse, empty_out, misaligned
from attnlang.runtime.dequantize import (
    Dequantizer,
    DequantPlan,
    capacity_pages,
    plan_copy,
    why_no_copy,
)
from attnlang.runtime.kv_scales import KvScales
from attnlang.runtime.launches import (
    graph_kernels,
    launch,
    load_kernels,
    merge_grid,
    pack_launches,
)
from attnlang.runtime.module import KernelModule, check_module_fits, module_for
from attnlang.runtime.plan_mixed import BatchPlan, plan_mixed, worst_case_mixed_bounds
from attnlang.runtime.planner import CapacityError, PlanBounds, PlanError
from attnlang.runtime.validate import (
    AttentionShape,
    PlanInputs,
    RunInputs,
    check_construction,
    resolve_params,
    validate_batch,
    validate_plan_inputs,
    validate_run_inputs,
    validate_shape,
)
from attnlang.runtime.workspace import (
    _SECTIONS,
    DEQUANTIZE,
    PREFILL_DEQUANTIZED,
    PackedArgs,
    WorkspaceLayout,
    allocate_workspace,
    fill_workspace,
    kernel_args,
    workspace_layout,
)

__all__ = [
    "BatchAttention", "AttentionShape", "PlanInputs", "RunInputs", "WorkspaceLayout",
    "validate_shape", "validate_plan_inputs", "validate_run_inputs", "resolve_params",
    "workspace_layout", "fill_workspace", "kernel_args", "PackedArgs", "describe_call",
    "CapacityError", "PlanError", "_SECTIONS",
]

# ---------------------------------------------------------------------------- the runtime


class BatchAttention:
    """Batched attention of one variant over a paged KV cache (plan once, run per layer).

    Args:
        variant_or_module: an ir.Variant (compiled on demand, cached) or a KernelModule
            (`attnlang.load_compiled`) built for the same head_dim and dtype.
        num_qo_heads, num_kv_heads: query and KV heads (num_qo_heads % num_kv_heads == 0).
        head_dim: 64, 128 or 256 (queries and keys; 192 with head_dim_vo 128).
        dtype: "bfloat16" / "float16" (or "bf16", "fp16", a NumPy/CuPy/torch dtype).
        page_size: tokens per page of the KV cache (default 16; not with kv_layout="ragged").
        kv_layout: "paged" (default) or "ragged": k and v are [total_kv, num_kv_heads,
            head_dim], request b's keys rows kv_indptr[b]:kv_indptr[b+1] of them, and plan()
            takes (qo_indptr, kv_indptr) alone (the layout of FlashInfer's ragged wrapper and
            of a prompt's K/V before any cache). max_kv_indices then bounds kv_indptr[-1].
        max_batch_size, max_total_q: the largest batch plan() will accept; with
            max_kv_indices (most page-table entries in one batch) they size the workspace,
            allocated once here so its pointers never move (CUDA graphs).
        max_qo_len: the most queries one request has in any plan (default: max_total_q).
            A decode loop passes 1 (or its speculative depth): the kernels of the longer
            requests it will never plan are then left out of the CUDA graphs run() is
            captured in (an fp8 cache's decode step in a graph ran 2.5-7% faster without the
            prefill kernel's empty launch: benchmarks/NOTES.md). plan() refuses a longer
            request.
        max_work_items, max_partial_rows, max_merge_rows: planner capacities; by default
            the worst case for (max_batch_size, max_total_q) with automatic KV splitting,
            so only a kv_chunk_size override in plan() can exceed them (with cascade=True,
            sized for one shared level: every grouped row merges, two partial states more
            per (token, head); nested levels may need more, plan() says which bound).
        arch: target of the compile (default: the device's; sm_90a on H100).
        num_ctas: CTAs of the decode grid (default: SMs x occupancy, at most 4 per SM) and,
            when given, of the prefill grid too.
        num_prefill_ctas: CTAs of the prefill grid (default: num_ctas if given, else SMs x
            the prefill kernel's occupancy).
        prefill_min_rows: requests with more fused rows (qo_len x group) than this run in
            the prefill kernel, the others in the decode kernel (default
            `planner.PREFILL_MIN_ROWS`, 3: see there why; 8 where the decode kernel runs on
            tensor cores, `config.decode_mma`: an fp8 cache at head_dim 64, 128 or 256).
        device: CUDA device ordinal (default: CuPy's current device).
        head_dim_vo: the values' (and outputs') head dim when it differs from head_dim:
            128 with head_dim 192, MLA's shape without weight absorption (DeepSeek-V2/V3
            prefill). v_cache is then [num_pages, page_size, num_kv_heads, head_dim_vo] and
            out [total_q, num_qo_heads, head_dim_vo]. Default: head_dim.
        kv_dtype: the K/V cache's element type: dtype (default), or "float8_e4m3fn" (alias
            "fp8"; torch.float8_e4m3fn tensors, or uint8 arrays of the bits). An fp8 cache is
            dequantised after each copy (in registers by the tensor-core decode kernel, in
            shared memory elsewhere), value = e4m3 * scale of its KV head, before any hook
            sees it: run() then takes k_scale and v_scale, each a
            float (one scale for the tensor) or a float32 device array [num_kv_heads] (or of
            one element, one scale for the tensor read when the kernels run), and q, out stay
            in dtype. See the README's "fp8 KV cache".
        cascade: also build the cascade kernel, so plan() can attend a prefix that several
            requests' page lists share once for all their queries (plan()'s `cascade`;
            the README's "Shared-prefix cascades"). Refused for a variant whose key or value
            hook reads `batch`, `qo_len` or `kv_len`.
        max_dequant_bytes: an fp8 cache's converted copy (runtime/dequantize.py): a prefill
            that reads its keys 24 times or more (a long prompt) converts its pages once into
            a bf16/fp16 copy of at most this size (default 256 MB, allocated at construction
            where a request within the bounds can read a key that often; 0: never) and the
            prefill kernel of such a cache reads it (plan()'s `dequantize`, `last_dequant`).

    Kernels: each planned request runs in the decode kernel (CUDA cores, up to 16 fused
    rows per work item) or, when it has more than prefill_min_rows fused rows
    (qo_len * group; by default more than 3, so GQA groups of 4 or more decode on tensor
    cores), in the prefill kernel (tensor cores, 128-row tiles); a batch may mix both
    (`plan_mixed`). Split requests of either kind merge in one merge kernel. An fp8 cache
    at head dim 64, 128 or 256 whose variant has the softmax on and no key or value hook
    decodes on tensor cores in the decode kernel (`config.decode_mma`: up to 8 fused rows
    per work item, prefill_min_rows 8 by default).

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
                 page_size: int | None = None, *, kv_layout: str = "paged",
                 max_batch_size: int = 256, max_total_q: int = 8192,
                 max_qo_len: int | None = None, max_kv_indices: int = 1 << 20,
                 max_work_items: int | None = None, max_partial_rows: int | None = None,
                 max_merge_rows: int | None = None,
                 arch: str | None = None, num_ctas: int | None = None,
                 num_prefill_ctas: int | None = None, prefill_min_rows: int | None = None,
                 device: int | None = None, head_dim_vo: int | None = None,
                 max_pair_mask_bytes: int = 64 << 20, kv_dtype: Any = None,
                 cascade: bool = False, max_dequant_bytes: int = 256 << 20):
        # Everything checkable without a GPU first, so mistakes fail fast and anywhere.
        self.shape = validate_shape(num_qo_heads, num_kv_heads, head_dim, dtype, page_size,
                                    head_dim_vo, kv_dtype, kv_layout)
        check_construction(max_batch_size=max_batch_size, max_total_q=max_total_q,
                           max_qo_len=max_qo_len, max_kv_indices=max_kv_indices,
                           max_pair_mask_bytes=max_pair_mask_bytes,
                           max_work_items=max_work_items, max_partial_rows=max_partial_rows,
                           max_merge_rows=max_merge_rows, num_ctas=num_ctas,
                           num_prefill_ctas=num_prefill_ctas, prefill_min_rows=prefill_min_rows,
                           cascade=cascade, max_dequant_bytes=max_dequant_bytes)
        check_module_fits(variant_or_module, self.shape, cascade)
        self.cascade = cascade

        import cupy

        _require_gpu(cupy)
        self.device = cupy.cuda.Device(device).id if device is None else int(device)
        self.module = module_for(variant_or_module, self.shape, arch=arch, device=self.device,
                                 cascade=cascade)
        # The IR mask trims each work unit's KV range at plan time (plan_trim.trim). A module
        # loaded from disk (load_compiled) carries no IR: its plans cover the whole KV range
        # and the kernels skip the EMPTY tiles themselves.
        variant = (variant_or_module if isinstance(variant_or_module, ir.Variant)
                   else getattr(self.module, "variant", None))
        self._mask = variant.mask if variant is not None else None
        # A cascade's grouped requests run their own positions in the cascade kernel's list
        # too (one launch), where its tiles keep their classes and terms: the mask and the
        # logits must not read the request (unknown for a module without its IR).
        from attnlang.codegen.lower import reads_request

        self._own_in_cascade = variant is not None and not (
            reads_request(variant.mask) or reads_request(variant.logits))
        s = self.shape
        # The kernels, their launch configs and grids (the tensor-core decode kernel keeps the
        # decode steps of GQA groups up to 8: prefill_min_rows).
        self._kernels = load_kernels(self.module, s, self.device, num_ctas=num_ctas,
                                     num_prefill_ctas=num_prefill_ctas,
                                     prefill_min_rows=prefill_min_rows, cascade=cascade)
        self.num_ctas = self._kernels.num_ctas
        self.num_prefill_ctas = self._kernels.num_prefill_ctas
        self.prefill_min_rows = self._kernels.prefill_min_rows
        self._tilings = self._kernels.tilings

        worst = (cascades.worst_case_cascade_bounds if cascade else worst_case_mixed_bounds)(
            max_batch_size=max_batch_size, max_total_q=max_total_q,
            num_kv_heads=s.num_kv_heads, group_size=s.group_size, **self._tilings)
        self.bounds = PlanBounds(
            max_batch_size=max_batch_size, max_total_q=max_total_q,
            max_work_items=max_work_items or worst.max_work_items,
            max_partial_rows=max_partial_rows or worst.max_partial_rows,
            max_merge_rows=max_merge_rows or worst.max_merge_rows,
        )
        self.max_kv_indices = int(max_kv_indices)
        # The kernels a CUDA graph must hold: those some batch within the bounds can reach.
        # A request has qo_len * group fused rows, from group up to max_qo_len * group.
        self.max_qo_len = max_total_q if max_qo_len is None else int(max_qo_len)
        reachable = graph_kernels(s.group_size, self.prefill_min_rows, self.max_qo_len,
                                  cascade=cascade)
        # An fp8 cache's prefill may read a converted copy of its pages (dequantize.py):
        # where a request within the bounds reads its keys often enough for a plan to take
        # it, and the variant is at hand to compile the copy's prefill kernel from.
        self._no_copy = why_no_copy(s, max_bytes=max_dequant_bytes,
                                    has_variant=variant is not None,
                                    prefill_reachable=reachable["prefill"],
                                    max_qo_len=self.max_qo_len,
                                    rows_per_tile=self._tilings["prefill"].rows_per_tile)
        self._dequantizer = None
        if self._no_copy is None:
            self._dequantizer = Dequantizer(
                variant, self.module.params, s, arch=self.module.arch, device=self.device,
                capacity=capacity_pages(s, max_dequant_bytes),
                prefill_smem=self._kernels.configs["prefill"].smem_bytes,
                prefill_ctas=self.num_prefill_ctas)
            reachable = graph_kernels(s.group_size, self.prefill_min_rows, self.max_qo_len,
                                      cascade=cascade, dequantize=True)
        self.max_dequant_bytes = int(max_dequant_bytes)
        # Per-pair masks (bool[q, kv]): one fixed buffer each, rewritten by every plan(), so
        # run()'s pointer to it never moves (CUDA graphs).
        self.max_pair_mask_bytes = int(max_pair_mask_bytes)
        self._dev = allocate_workspace(
            workspace_layout(self.num_ctas, self.bounds, self.max_kv_indices,
                             self.num_prefill_ctas, cascade=cascade,
                             dequant_pages=self._dequantizer.capacity
                             if self._dequantizer is not None else 0),
            self.bounds, max_total_q=max_total_q, num_qo_heads=s.num_qo_heads,
            head_dim_vo=s.head_dim_vo, pair_names=[p.name for p in self.module.params
                                                   if p.is_pair],
            max_pair_mask_bytes=self.max_pair_mask_bytes, device=self.device,
            tma_templates=partial(tensor_maps.map_templates, s.head_dim, s.head_dim_vo,
                                  s.num_kv_heads, s.kv_dtype)
            if tensor_maps.uses_tma(s.head_dim, s.head_dim_vo, s.dtype, s.kv_dtype,
                                    s.page_size, self.module.arch, s.ragged) else None,
            tma_ctas=self.num_prefill_ctas)
        self._pair_host: dict[str, np.ndarray] = {}  # the last plan's packed masks
        with cupy.cuda.Device(self.device):
            # After the last plan's copy (guards the pinned buffer; run() waits on it) and
            # after the last run's launches (plan() waits on it before rewriting the
            # workspace, whichever streams the two use).
            self._copy_done = cupy.cuda.Event(disable_timing=True)
            self._run_done = cupy.cuda.Event(disable_timing=True)
        self._copied = self._ran = self._ran_on_copy_stream = False
        self._copy_stream: int | None = None  # the stream of the last plan's copy
        # CuPy's raw driver and runtime bindings, looked up once (run() is on the hot path).
        from cupy_backends.cuda.api import driver, runtime

        self._driver, self._runtime = driver, runtime
        self._launches = pack_launches(self._kernels, self._dev.pointers, s,
                                       len(self.module.params),
                                       merge_grid(self._kernels, self.bounds.max_merge_rows),
                                       self._dequantizer)
        self._capture_launches = tuple(one for kind, one in self._launches.items()
                                       if reachable[kind])
        # plan() picks the launches its plan needs (a kernel with no work is not launched).
        self._plan_launches: tuple = ()
        # run()'s validated calls of the current plan, by call_signature; _waited: streams
        # already ordered after the current plan's copy.
        self._checked: dict[tuple, CheckedCall] = {}
        self._waited: set[int] = set()
        # run()'s C path (hostpath.c): a FastRun per validated call signature of the current
        # plan (a few: a model's layers share one), tried before the Python path.
        self._hostpath = hostpath.load()
        self._fast_runs: dict[tuple, Any] = {}
        self._kv_scales = KvScales(self.shape, self.device)  # an fp8 cache's scales
        self._plan: BatchPlan | None = None
        self._inputs: PlanInputs | None = None
        self._dequant: DequantPlan | None = None

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

    @property
    def last_dequant(self) -> DequantPlan | None:
        """The pages the last plan's prefill reads through the converted copy of an fp8
        cache (`dequantize.DequantPlan`), or None where it reads the fp8 pages."""
        return self._dequant

    def __repr__(self) -> str:
        s = self.shape
        return (f"BatchAttention({self.module.name}, heads {s.num_qo_heads}/{s.num_kv_heads}, "
                f"d{s.head_dim} {s.dtype}, "
                f"{'ragged' if s.ragged else f'page_size {s.page_size}'}, {self.num_ctas} + "
                f"{self.num_prefill_ctas} CTAs, "
                f"{self.module.arch}, device {self.device})")

    # -- plan

    def plan(self, qo_indptr: Any, kv_indptr: Any, kv_indices: Any = None,
             kv_last_page_len: Any = None, *, kv_chunk_size: int | None = None,
             params: Mapping[str, Any] | None = None, cascade: Any = None,
             dequantize: bool | None = None) -> BatchPlan:
        """Schedule a batch and upload its plan and page table (one copy, current stream).

        qo_indptr [batch+1]: request b owns queries qo_indptr[b]:qo_indptr[b+1] of q.
        kv_indptr [batch+1]: it owns pages kv_indices[kv_indptr[b]:kv_indptr[b+1]].
        kv_last_page_len [batch]: valid tokens in its last page (1..page_size; 0 if none).
        With kv_layout="ragged": plan(qo_indptr, kv_indptr) alone, request b's keys being
        rows kv_indptr[b]:kv_indptr[b+1] of k and v.
        Host int arrays (device arrays are copied to the host once). kv_chunk_size: force
        the KV split bound (tests); None = automatic. params: the variant's per-pair masks
        (`bool[q, kv]`), each a list of one [qo_len, kv_len] bool array per request or one
        flat array of them all (`pairmask.normalize`): plan() packs them into bits with a
        block summary the kernels skip tiles by. On error the previous plan stays.

        cascade (a BatchAttention built with cascade=True): requests whose page lists begin
        with the same pages (a shared prompt) read those pages once, in the cascade kernel,
        for all their queries; their rows then merge exactly (README, "Shared-prefix
        cascades"). None (default) or "auto": find the shared runs of consecutive requests
        in kv_indices and use those worth it (`cascade.CASCADE_MIN_KV` positions or more
        beyond their parent level); False: none; or the levels themselves, a list of
        (first_request, end_request, shared_kv): requests [first, end) share their first
        shared_kv positions (checked against the page table; nested groups share more).

        dequantize (an fp8 cache): None (default) lets the plan convert the pages its prefill
        reads into a bf16/fp16 copy once, before the prefill kernel of such a cache reads
        them, where each key is read often enough (`dequantize.MIN_READS_PER_KEY`) and the
        pages fit max_dequant_bytes; True: whenever a prefill reads keys (CapacityError if
        they do not fit); False: the prefill kernel converts every tile it reads.
        `last_dequant` says what the plan chose.
        Returns the BatchPlan (its .decode, .prefill and .cascade work lists).
        """
        import cupy

        inputs = validate_batch(self.shape, qo_indptr, kv_indptr, kv_indices,
                                kv_last_page_len)
        longest = int(inputs.qo_lens.max(initial=0))
        if longest > self.max_qo_len:
            raise CapacityError("max_qo_len", longest, self.max_qo_len,
                                "queries in one request")
        if inputs.kv_indices.shape[0] > self.max_kv_indices:
            raise CapacityError("max_kv_indices", inputs.kv_indices.shape[0],
                                self.max_kv_indices, "rows of k and v (kv_indptr[-1])"
                                if self.shape.ragged else "page-table entries (kv_indices)")
        packed_pairs, pair_blocks = pairmask.plan_masks(
            self.module.params, params, inputs.qo_lens, inputs.kv_lens,
            max_bytes=self.max_pair_mask_bytes, variant_name=self.module.name)
        common = dict(num_kv_heads=self.shape.num_kv_heads, group_size=self.shape.group_size,
                      **self._tilings, prefill_min_rows=self.prefill_min_rows,
                      kv_chunk_size=kv_chunk_size, bounds=self.bounds, mask=self._mask,
                      head_dim=self.shape.head_dim, pairs=pair_blocks or None)
        groups = cascades.choose_groups(cascade, inputs, self.shape.page_size,
                                        enabled=self.cascade)
        if groups is None:
            plan = plan_mixed(inputs.qo_lens, inputs.kv_lens, **common)
        else:
            plan = cascades.plan_cascade(inputs.qo_lens, inputs.kv_lens, groups, **common,
                                         own_in_cascade=self._own_in_cascade)
        dequant = plan_copy(plan, inputs, self.shape, max_bytes=self.max_dequant_bytes,
                            capacity=self._dequantizer.capacity if self._dequantizer else 0,
                            no_copy=self._no_copy, force=dequantize)
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            if self._copied:
                self._copy_done.synchronize()  # the last copy has finished reading _host
            n = fill_workspace(self._dev.layout, self._dev.host, plan, inputs, dequant)
            # Earlier runs must have read the workspace before the copy rewrites it: those on
            # other streams recorded _run_done; those on the last copy's stream are ordered
            # before this copy when it is the same stream, else (a rare switch; that stream
            # may even be gone) the device is synchronised.
            self._absorb_fast_flags()
            if self._ran:
                stream.wait_event(self._run_done)
            if self._ran_on_copy_stream and stream.ptr != self._copy_stream:
                cupy.cuda.runtime.deviceSynchronize()
            cupy.cuda.runtime.memcpyAsync(self._dev.ints.data.ptr, self._dev.host.ctypes.data,
                                          4 * n, cupy.cuda.runtime.memcpyHostToDevice,
                                          stream.ptr)
            for name, packed in packed_pairs.items():
                cupy.cuda.runtime.memcpyAsync(self._dev.pair_buffers[name].data.ptr,
                                              packed.ctypes.data, packed.nbytes,
                                              cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
            self._pair_host = packed_pairs  # alive until the next plan's synchronize
            self._copy_done.record(stream)
        self._copy_stream = stream.ptr
        self._ran = self._ran_on_copy_stream = False
        # A kernel whose work list is empty has nothing to do.
        prefill_items = plan.prefill.num_work_items
        needed = {"decode": plan.decode.num_work_items, "merge": plan.merge_count,
                  "prefill": 0 if dequant is not None else prefill_items,
                  DEQUANTIZE: int(dequant is not None),
                  PREFILL_DEQUANTIZED: prefill_items if dequant is not None else 0,
                  "cascade": plan.cascade.num_work_items if plan.cascade is not None else 0}
        self._plan_launches = tuple(one for kind, one in self._launches.items()
                                    if needed[kind] > 0)
        self._copied = True
        self._plan, self._inputs, self._dequant = plan, inputs, dequant
        self._checked.clear()  # validation depends on the plan (total_q, pages, batch size)
        self._waited.clear()
        self._fast_runs.clear()
        return plan

    # -- run

    def run(self, q: Any, kv_cache: Any, params: Mapping[str, Any] | None = None, *,
            out: Any = None, lse: Any = None, return_lse: bool = False,
            sm_scale: float | None = None, k_scale: Any = None, v_scale: Any = None):
        """Attention of the planned batch. Validates everything before launching.

        q [total_q, num_qo_heads, head_dim]; kv_cache = (k_cache, v_cache), each
        [num_pages, page_size, num_kv_heads, head_dim] (v_cache: head_dim_vo; kv_layout
        "ragged": [total_kv, num_kv_heads, head_dim]); params: the
        variant's run-time params by name; out (optional) like q (head_dim_vo wide); lse
        (optional) float32 [total_q, num_qo_heads]; sm_scale default 1/sqrt(head_dim);
        k_scale, v_scale (an fp8 cache's, required there and refused elsewhere): a float or
        a float32 device array [num_kv_heads], the factor of each KV head's values (one
        element: every head's, copied per call into a buffer the kernels read). Inputs
        are CuPy arrays or CUDA torch tensors (bf16 CuPy data without ml_dtypes: uint16
        bits); outputs come back in the same type, on the caller's current stream (torch's for
        torch inputs).

        Returns out, or (out, lse) with return_lse=True; lse is the natural-log
        log-sum-exp of each row (-inf for a fully masked row), None for softmax-off
        variants. For CUDA-graph capture pass out= and lse= (fixed buffers), and device
        tensor params.

        Host cost: a call whose inputs differ from an earlier call of the same plan only in
        their addresses (another layer's cache, a new q) reuses that call's validation
        (`call_signature`): it reads pointers, checks their alignment and launches, in C
        (`runtime/hostpath.c`) where it can be built, else in Python; device-array params (an
        fp8 cache's scales, tables) are read again per call there too.
        """
        if k_scale is not None or v_scale is not None or self.shape.kv_dtype == KV_FP8:
            params = self._kv_scales.merge(params, k_scale, v_scale, q)
        if lse is None and not return_lse:
            for fast in self._fast_runs.values():
                out_obj = fast(q, kv_cache, params, out, sm_scale)
                if out_obj is not None:  # None: not its signature, or a case for Python
                    return out_obj
        if self._plan is None or self._inputs is None:
            raise RuntimeError("call plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len) "
                               "before run()")
        described = describe_call(q, kv_cache, params, out, lse, sm_scale)
        checked = None
        if described is not None:
            key, pointers, tensor_ptrs = described
            checked = self._checked.get(key)
        if checked is None:
            checked = self._check_call(q, kv_cache, params, out, lse, sm_scale)
            if described is None:
                pointers = tuple(i.ptr if i is not None else 0 for i in checked.arrays)
                tensor_ptrs = {spec.name: v.ptr for spec, v in checked.param_values
                               if isinstance(v, TensorInfo)}
            else:
                if len(self._checked) >= _CHECKED_CALLS:
                    self._checked.clear()
                self._checked[key] = checked
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr = pointers
        if (q_ptr | k_ptr | v_ptr | out_ptr) & 15:
            raise ValueError(misaligned(q=q_ptr, k_cache=k_ptr, v_cache=v_ptr, out=out_ptr))
        values = checked.param_values
        if checked.tensor_params:
            values = list(values)
            for i, name in checked.tensor_params:
                values[i] = (values[i][0], np.uint64(tensor_ptrs[name]))
        runtime, device = self._runtime, self.device
        previous = runtime.getDevice()
        if previous != device:
            runtime.setDevice(device)
        try:
            stream = current_stream_ptr(checked.torch_io, device)
            capturing = runtime.streamIsCapturing(stream)
            uploaded = []
            if checked.host_params:
                values, uploaded = self._upload_host_params(values, checked.host_params,
                                                            stream, capturing)
            out_obj = out
            if out is None:
                out_obj = empty_out(q, checked, self.shape.head_dim_vo)
                out_ptr = data_ptr(out_obj)
            lse_obj = lse
            if lse is None:
                lse_ptr = self._dev.lse_scratch.data.ptr
                if return_lse and self.module.softmax:
                    lse_obj = empty_lse(q, checked, (self._inputs.total_q,
                                                      self.shape.num_qo_heads))
                    lse_ptr = data_ptr(lse_obj)
            if not capturing and stream != self._copy_stream and stream not in self._waited:
                # plan() copied on another stream: order this one after the copy (once per
                # plan and stream; later launches on it are ordered anyway).
                runtime.streamWaitEvent(stream, self._copy_done.ptr, 0)
                self._waited.add(stream)
            call = (q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, checked.sm_scale, values)
            # The plan's launches; under capture every kernel a later plan() may use (fixed
            # grids, fixed workspace).
            for one in self._capture_launches if capturing else self._plan_launches:
                one.args.update(*call)
                launch(self._driver, one, stream)
            del uploaded
            if not capturing:
                # plan() must not rewrite the workspace before these launches have read it:
                # on plan()'s own stream that is stream order; elsewhere plan() waits on this.
                if stream == self._copy_stream:
                    self._ran_on_copy_stream = True
                else:
                    runtime.eventRecord(self._run_done.ptr, stream)
                    self._ran = True
                if described is not None and lse is None and not return_lse:
                    self._use_fast_run(key, (q, *kv_cache, out), params, sm_scale, checked)
        finally:
            if previous != device:
                runtime.setDevice(previous)
        if return_lse:
            return out_obj, (lse_obj if self.module.softmax else None)
        return out_obj

    def _use_fast_run(self, key: tuple, arrays: tuple, params, sm_scale,
                      checked: CheckedCall) -> None:
        """After a Python-path launch: make a FastRun for this signature (from the launch just
        packed) when the C path is built and takes such calls (no lse, no host-array params,
        torch or CuPy arrays), so later calls with it skip Python."""
        if (self._hostpath is None or checked.host_params or key in self._fast_runs
                or len(self._fast_runs) >= _FAST_RUNS):
            return
        fast = hostpath.fast_run(
            self._hostpath, arrays=arrays, params=params, tensor_params=checked.tensor_params,
            sm_scale=sm_scale, launches=self._plan_launches, device=self.device,
            waited=self._waited, copy_stream=self._copy_stream, run_done=self._run_done.ptr,
            head_dim_vo=self.shape.head_dim_vo)
        if fast is not None:
            self._fast_runs[key] = fast

    def _absorb_fast_flags(self) -> None:
        """Take over the FastRuns' record of where they launched (plan() reads it)."""
        for fast in self._fast_runs.values():
            self._ran = self._ran or bool(fast.ran)
            self._ran_on_copy_stream = self._ran_on_copy_stream or bool(fast.ran_on_copy_stream)
            fast.ran = fast.ran_on_copy_stream = 0

    def _upload_host_params(self, values, host_params, stream: int, capturing: bool):
        """Copy host tensor params (unmemoised calls only) to the device on `stream`. The
        uploads stay referenced until the launches are enqueued; CuPy's pool is
        stream-ordered, so their memory is reused only by later work of this stream."""
        if capturing:
            name = values[host_params[0]][0].name
            raise ValueError(f"param {name!r} is a host array; while a CUDA graph is being "
                             "captured pass a device array (its copy cannot be captured)")
        values, uploaded = list(values), []
        with external_stream(stream, self.device):
            for i in host_params:
                spec, host = values[i]
                array, info = to_device_param(host, host.dtype.name, self.device)
                uploaded.append(array)
                values[i] = (spec, info)
        return values, uploaded

    # -- internals

    def _check_call(self, q, kv_cache, params, out, lse, sm_scale) -> CheckedCall:
        """Validate one run() call in full (validate_run_inputs) and keep what later calls
        with the same signature reuse."""
        args = validate_run_inputs(self.shape, self.module.params, self._inputs, q, kv_cache,
                                   params, out=out, lse=lse, sm_scale=sm_scale,
                                   variant_name=self.module.name,
                                   dim_sizes=self.module.param_dims,
                                   plan_params=self._dev.pair_values)
        if args.device != self.device:
            raise ValueError(f"q is on device {args.device} but this BatchAttention "
                             f"lives on device {self.device}")
        tensors = tuple((i, spec.name) for i, (spec, v) in enumerate(args.params)
                        if isinstance(v, TensorInfo))
        host = tuple(i for i, (_, v) in enumerate(args.params) if isinstance(v, np.ndarray))
        return CheckedCall(torch_io=args.q.kind == "torch", param_values=args.params,
                            tensor_params=tensors, host_params=host, sm_scale=args.sm_scale,
                            arrays=(args.q, args.k_cache, args.v_cache, args.out, args.lse))


def _require_gpu(cupy) -> None:
    """A clear error where CUDA has no device to offer (CUDA's own reads "CUDA driver version
    is insufficient for CUDA runtime version" on a machine without a GPU driver)."""
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise RuntimeError(
            f"no CUDA GPU found ({e}): BatchAttention runs kernels and needs one. Without a "
            "GPU, attnlang.compile(...) / `attnlang compile` still build the kernels, and "
            "attnlang.reference computes the same attention in NumPy") from None
    if count == 0:
        raise RuntimeError("no CUDA GPU found: BatchAttention runs kernels and needs one")


# Validated call signatures kept per plan: a model's layers usually share one or two.
_CHECKED_CALLS = 64
# FastRuns per plan, each tried in turn before the Python path (a miss returns early).
_FAST_RUNS = 4

