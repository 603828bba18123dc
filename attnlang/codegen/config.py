"""The one place that knows each kernel template's thread layout and tile sizes.

`render` splices `template_shape(kind, head_dim, dtype)` into the template as literal
constants; the runtime calls `launch_config(kind, head_dim, group_size, dtype)` to plan
(rows per work item, KV tile) and to launch (block dims, dynamic shared memory). Both derive
from the same constants below, so a template and its launches cannot disagree.

decode (kernels_templates/decode.cu.j2), block (TX, R, TZ):

    x  TX = head_dim / VEC lanes hold one row (VEC = 16 bytes / sizeof(T) = 8 elements each)
    y  R  fused (query, group member) rows of one request and KV head (a work item)
    z  TZ groups of threads splitting each KV tile's keys; merged through shared memory

  KV tiles of `kv_tile` keys stream through a `stages`-deep cp.async pipeline in dynamic
  shared memory (K and V: stages * kv_tile * head_dim * sizeof(T) each). One compiled
  kernel serves every R and TZ (read from blockDim), so group size is a launch choice.

decode on tensor cores (kernels_templates/decode_mma.cu.j2; `decode_mma` says where): an fp8
cache at head_dim 64, 128 or 256, softmax on, no key or value hook. Block (TX, 128 / TX, 1):
4 warps; items of DECODE_MMA_ROWS fused rows (the mma's N); each warp streams its own
32-key tiles through its own ring, and the rows' layout serves the q and output stages.

merge (kernels_templates/merge.cu.j2), block (TX, ROWS, SZ): SZ TX-lane groups per merge
row splitting its partial states, grid-stride over rows; their states meet in shared memory.

prefill (kernels_templates/prefill_mma.cu.j2, prefill_wgmma.cu.j2), block (32 * WARPS
[+ PRODUCER_THREADS], 1, 1):
tensor cores, each warp owns 16 * ROW_BLOCKS fused rows, so a work item covers
R = 16 * ROW_BLOCKS * WARPS rows (128). KV tiles of `kv_tile` keys stream through a
`stages`-deep cp.async ring; shared memory = K and V stages, the [R][head_dim] Q tile and a
distance table (DISTANCE_TABLE_BYTES, less the producer's PIPELINE_BARRIER_BYTES). Two
instruction paths, chosen by the target arch:
  mma.sync m16n8k16 (`_PREFILL_SHAPE`, any sm_80+ target): per head_dim the most the
    registers hold without spills; O and S fragments take ROW_BLOCKS * (head_dim/2 +
    kv_tile/2) registers per lane.
  wgmma (`_PREFILL_WGMMA_SHAPE`, sm_90a, head_dim 64, 128, 256 and 192/128): two warpgroups
    of 64 rows; the accumulators take head_dim/2 + kv_tile/2 registers per lane and the
    operands come from shared memory, so one CTA per SM holds a deeper ring. A V stage is read
    one tile longer than its K (a tile's P V runs behind the next tile's S), so the K ring may
    be one stage shorter than the V ring (`key_stages`; head_dim 256 needs it to fit). At
    head_dim 128 and 256 a producer warpgroup (`producer_threads`) does the K/V copies, so a
    CTA is launched with `block_threads` = max_threads + 128 threads.
The arch therefore enters `template_shape` and `launch_config`; None means the mma.sync path
(what every sm_80+ target runs).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["KINDS", "DTYPES", "HEAD_DIMS", "HEAD_DIM_PAIRS", "TemplateShape", "LaunchConfig",
           "template_shape", "launch_config", "dtype_ctype", "uses_wgmma", "check_head_dims",
           "STATIC_SMEM_LIMIT", "DISTANCE_TABLE_BYTES", "fine_tiles", "decode_mma",
           "DECODE_MMA_ROWS"]

# "cascade": the prefill kernel for a shared-prefix level (its items span several requests'
# rows), compiled only where a BatchAttention plans cascades; its shape is prefill's.
KINDS = ("decode", "prefill", "merge", "cascade")
# dtype name -> (C type, bytes)
DTYPES = {"float16": ("half", 2), "bfloat16": ("__nv_bfloat16", 2)}
# A KV cache of float8 e4m3 (OCP e4m3fn) beside q and out of a DTYPES type: the kernels copy
# its bytes and dequantise them in shared memory, times run-time scales (ir.KV_SCALE_PARAMS).
KV_FP8 = "float8_e4m3fn"
HEAD_DIMS = (64, 128, 256)
# (query/key head dim, value/output head dim) pairs: every HEAD_DIMS value with itself, and
# MLA's shape without weight absorption (DeepSeek-V2/V3 prefill: 128 + 64 rope dims of q and
# k, 128 of v). A row of one vector stage is TX lanes of VEC elements for both vectors, TX =
# gcd / 8, so the q/k lanes and the v/o lanes line up.
HEAD_DIM_PAIRS = tuple((d, d) for d in HEAD_DIMS) + ((192, 128),)
# Dynamic shared memory above this needs cudaFuncAttributeMaxDynamicSharedMemorySize.
STATIC_SMEM_LIMIT = 48 * 1024
# The end of a prefill CTA's shared memory, after its Q tile: the table of a distance term
# over one KV tile (attnlang.codegen.distance_terms), 768 floats, e.g. 4 heads x 159
# distances, 168 apart (128 rows at 4 query heads per KV head, tiles of 128 keys). It is what 227 KB
# leave beside the wgmma path's 224 KB at head dim 128 (and 99 KB beside the mma.sync path's
# 96 KB on sm_86/89), so every variant's kernel reserves it: no CTA fewer per SM on any
# target. A larger table is not built: its tiles compute the term per score. (With a distance
# term the wgmma path at head dim 128 gives the table a K stage too: `_DISTANCE_KEY_STAGES`.)
DISTANCE_TABLE_BYTES = 3072
# The wgmma path's producer warpgroup (head dims 128 and 256: at 64 the kernel without one
# fits two CTAs per SM) and its pipeline barriers (one "full" and one "empty" mbarrier per
# stage, 8 bytes each) at the start of that region: the table keeps the rest.
PRODUCER_THREADS = 128
PIPELINE_BARRIER_BYTES = 128
_PRODUCER_HEAD_DIMS = (128, 256)

_VEC_BYTES = 16  # one 16-byte vector access per lane
_MAX_THREADS = 256  # __launch_bounds__ of the decode kernel: at most this many threads
# ... and at least this many such CTAs per SM: caps registers at 65536 / (256 * 2) = 128.
# Without it, ptxas aims at a lower register target of its own and spills on some variants.
_MIN_BLOCKS = 2
_MIN_THREADS = 128  # TZ grows until a CTA has at least this many threads
_MAX_ROWS = 16  # largest R: beyond it a group's rows are split over several work items
# cp.async pipeline depth of the decode kernel: two tiles (32 KB of K + V) in flight per CTA
# while it computes a third; 48 KB per CTA, 4 CTAs per SM in the H100's 228 KB.
_STAGES = 3
_TILE_BYTES = 16 * 1024  # K + V bytes of one pipeline stage
_CHUNK = 4  # keys per online-softmax update (amortises the o rescale)
_MERGE_THREADS = 128
# TX-lane groups splitting a merge row's partial states (merge.cu.j2): B1 L32768 splits each
# row 32 ways, and one group folding them in sequence waited on two loads per slot.
_MERGE_SLOT_GROUPS = 4
# prefill, per head_dim: (KV tile keys, pipeline stages, warps per CTA, 16-row blocks per
# warp, CTAs per SM for __launch_bounds__). 32 rows per warp make every K/V fragment read from
# shared memory feed two mmas (16 rows per warp were bound by shared-memory bandwidth, v2 in
# benchmarks/NOTES.md); at head_dim 256 O alone would not fit, so it keeps 16 rows per warp
# and 8 warps. Every shape is a 128-row work item.
_PREFILL_SHAPE = {
    64: (64, 3, 4, 2, 2),
    128: (64, 2, 4, 2, 2),
    256: (32, 2, 8, 1, 1),
    192: (32, 3, 4, 2, 2),  # with head_dim_vo 128: 108 KB, two CTAs per SM
}
# The wgmma path, same fields: 8 warps = two warpgroups of 64 rows, each issuing
# m64n{kv_tile}k16 for S and m64n{head_dim}k16 for O; one CTA per SM. The V of a tile stays
# in use while the next tile's S is computed (the warpgroup overlaps one tile's P V with the
# next one's softmax), so of `stages` stages two are read and the rest in flight. Head dim
# 128: tiles of 128 keys in three stages (224 KB) measured 1.00-1.10x of 64 keys in four
# (benchmarks/NOTES.md, wgmma prefill). Head dim 256: 2 K and 3 V stages of 64 keys (160 KB),
# the 64 KB Q tile and the distance table are exactly the 227 KB a CTA may have.
_PREFILL_WGMMA_SHAPE = {
    64: (64, 4, 8, 1, 1),
    128: (128, 3, 8, 1, 1),
    256: (64, 3, 8, 1, 1),
    192: (64, 4, 8, 1, 1),  # with head_dim_vo 128: 4 x 40 KB of K/V + a 48 KB Q tile
}
# The wgmma path for variants with a per-pair mask (`bool[q, kv]`, `fine_tiles`): its blocks
# are skipped per tile and per warpgroup, so a tile of 64 keys skips what a 128-key tile
# half-computes. A random layout of 64 x 64 blocks ran 1.8x faster at 64 keys in four stages,
# token trees 1.1x, while causal is 5% slower there (benchmarks/NOTES.md); other head dims
# already use 64-key tiles.
_PREFILL_WGMMA_FINE_SHAPE = {128: (64, 4, 8, 1, 1)}
# K stages on the wgmma path where fewer than the V stages above: the K of a tile is done one
# tile before its V, so one stage fewer holds the same pipeline (elsewhere K has as many).
_PREFILL_WGMMA_KEY_STAGES = {256: 2}
# ... and for a variant with a distance term (`distance_table`), where the stage K does without
# joins the distance table (32 KB more at head dim 128: the same shared memory in all). The
# table then holds a run of tiles' distances (kernels_templates/distance_table.cuh): sandwich
# prefill S4096 0.876 -> 0.617 ms; the shorter K ring alone left causal's time as it was
# (benchmarks/NOTES.md).
_DISTANCE_KEY_STAGES = {128: 2}
_WGMMA_ARCHS = ("sm_90a",)  # wgmma exists on sm_90a only (not sm_90, not sm_100)
# The decode kernel of an fp8 cache on tensor cores (decode_mma.cu.j2): 4 warps, each with
# its own ring of 3 stages of 32 keys (24 KB of e4m3 K and V at head dim 128), 100 KB per
# CTA with the Q tile (the warps' states go in their drained rings): two CTAs per SM, 128 KB
# of copies in flight per SM (head dim 64: 50 KB; 256: 200 KB, one CTA with as many bytes
# in flight). Work items of up to 8 fused rows (the mma's N), so decode steps of GQA groups
# up to 8 stay in the decode kernel.
DECODE_MMA_ROWS = 8
_DECODE_MMA_WARPS = 4
_DECODE_MMA_TILE = 128  # keys per CTA tile: 32 per warp
_DECODE_MMA_STAGES = 3
_DECODE_MMA_HEAD_DIMS = ((64, 64), (128, 128), (256, 256))


@dataclass(frozen=True)
class TemplateShape:
    """Compile-time constants of one kernel template instance (spliced as literals).

    Example: decode, head_dim 128, bf16 -> vec=8, tx=16, kv_tile=32, stages=3, chunk=4,
    max_threads=256, min_blocks=2. head_dim (192, 128) -> vec=24, vec_vo=16, tx=8.
    """

    kind: str
    dtype: str
    ctype: str  # C element type: half | __nv_bfloat16
    head_dim: int  # of queries and keys
    head_dim_vo: int  # of values and outputs
    vec: int  # elements per lane of a query or key row (multiples of 8: 16-byte chunks)
    vec_vo: int  # elements per lane of a value or output row
    tx: int  # lanes per row
    kv_tile: int  # keys per pipeline stage (decode), 0 for merge
    stages: int  # pipeline depth (decode; prefill: of V, see key_stages), 0 for merge
    chunk: int  # keys per softmax update (decode), 0 for merge
    max_threads: int  # __launch_bounds__: most threads per CTA
    min_blocks: int  # __launch_bounds__: CTAs of max_threads per SM (a register cap)
    row_blocks: int = 1  # prefill: 16-row mma blocks per warp
    wgmma: bool = False  # prefill: the wgmma path (sm_90a) instead of mma.sync
    sub_keys: int = 0  # prefill: keys per softmax step (S of a step is in registers)
    key_stages: int = 0  # prefill: K stages (`stages` or, on the wgmma path, one fewer)
    producer_threads: int = 0  # prefill: threads of a producer warpgroup beside max_threads
    table_bytes: int = DISTANCE_TABLE_BYTES  # prefill: the distance table's region, after Q
    decode_mma: bool = False  # decode: the tensor-core kernel of an fp8 cache (decode_mma.cu.j2)

    @property
    def block_threads(self) -> int:
        """Threads a CTA is launched with: the computing threads and any producer."""
        return self.max_threads + self.producer_threads

    @property
    def distance_table_floats(self) -> int:
        """Floats of the prefill distance table (what the pipeline barriers leave)."""
        barriers = PIPELINE_BARRIER_BYTES if self.producer_threads else 0
        return (self.table_bytes - barriers) // 4

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of a prefill CTA: its K and V stages, the Q tile, the table."""
        size = DTYPES[self.dtype][1]
        stages = self.kv_tile * (self.key_stages * self.head_dim + self.stages * self.head_dim_vo)
        rows = 16 * self.row_blocks * (self.max_threads // 32)
        return (stages + rows * self.head_dim) * size + self.table_bytes


@dataclass(frozen=True)
class LaunchConfig:
    """How to launch one kernel kind.

    block: (x, y, z) thread block. rows_per_tile: fused rows per work item R (decode; the
    planner cuts each request's rows into tiles of R) or merge rows per CTA pass (merge).
    smem_bytes: dynamic shared memory per CTA. kv_tile: keys per pipeline stage (decode; KV
    chunks that are multiples of it waste no tile slots), 0 for merge.

    Example: ``launch_config("decode", 128, 4)`` -> block (16, 4, 2), rows_per_tile 4,
    smem_bytes 49152, kv_tile 32.
    """

    block: tuple[int, int, int]
    rows_per_tile: int
    smem_bytes: int
    kv_tile: int

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def needs_smem_opt_in(self) -> bool:
        """True when smem_bytes exceeds 48 KiB: set the function's
        MAX_DYNAMIC_SHARED_SIZE_BYTES attribute before launching."""
        return self.smem_bytes > STATIC_SMEM_LIMIT


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_head_dims(head_dim: object, head_dim_vo: object = None) -> tuple[int, int]:
    """(head_dim, head_dim_vo) as ints if the kernels support the pair (HEAD_DIM_PAIRS;
    head_dim_vo None means head_dim), else ValueError naming what is supported.

    >>> check_head_dims(128)
    (128, 128)
    >>> check_head_dims(192, 128)
    (192, 128)
    """
    vo = head_dim if head_dim_vo is None else head_dim_vo
    if not (_is_int(head_dim) and _is_int(vo) and (int(head_dim), int(vo)) in HEAD_DIM_PAIRS):
        pairs = ", ".join(f"{q}/{v}" for q, v in HEAD_DIM_PAIRS if q != v)
        raise ValueError(f"unsupported head_dim {head_dim!r} with head_dim_vo {vo!r}: expected "
                         f"one of {', '.join(map(str, HEAD_DIMS))} for both, or {pairs} "
                         f"(query-key / value-output)")
    return int(head_dim), int(vo)


def _check(kind: str, dtype: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}: expected one of {', '.join(KINDS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {', '.join(DTYPES)}")


def dtype_ctype(dtype: str) -> str:
    """The C element type of a dtype name: "bfloat16" -> "__nv_bfloat16"."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype][0]


def fine_tiles(params) -> bool:
    """Does a variant with these ParamSpecs take `template_shape`'s fine tiles? Where it has a
    per-pair mask (`bool[q, kv]`). The one test render, the runtime and the CLI all apply, so
    a kernel and its launches agree."""
    return any(p.is_pair for p in params)


def decode_mma(head_dim: int, head_dim_vo: int | None, kv_dtype: str | None, *, softmax: bool,
               kv_hooks: bool, pair_masks: bool) -> bool:
    """Does the decode kernel of such a variant run on tensor cores (decode_mma.cu.j2)? For
    an fp8 cache at head_dim 64, 128 or 256 (one for queries and values) with the softmax on
    (P in [0, 1] fits f16), no key or value hook (the fragments are converted straight from
    the cache's bytes) and no per-pair mask.
    Every other variant and cache keeps decode.cu.j2. The renderer, the compiled module and
    its launches all ask here, so they agree.
    ``decode_mma(128, 128, "float8_e4m3fn", softmax=True, kv_hooks=False, pair_masks=False)``
    -> True."""
    dims = (head_dim, head_dim if head_dim_vo is None else head_dim_vo)
    return (kv_dtype == KV_FP8 and dims in _DECODE_MMA_HEAD_DIMS and softmax and not kv_hooks
            and not pair_masks)


def uses_wgmma(kind: str, head_dim: int, arch: str | None, head_dim_vo: int | None = None) -> bool:
    """True when `kind` at head_dim compiled for `arch` takes the wgmma path (prefill on
    sm_90a at head_dim 64, 128 and 192/128; the pair is checked by template_shape).
    ``uses_wgmma("prefill", 128, "sm_90a")`` -> True."""
    return (kind in ("prefill", "cascade") and arch in _WGMMA_ARCHS
            and head_dim in _PREFILL_WGMMA_SHAPE)


def template_shape(kind: str, head_dim: int, dtype: str, arch: str | None = None,
                   head_dim_vo: int | None = None, fine_tiles: bool = False,
                   distance_table: bool = False, decode_mma: bool = False) -> TemplateShape:
    """The compile-time constants of `kind` for (head_dim, head_dim_vo, dtype) on `arch`
    (None: the mma.sync path every sm_80+ target runs; head_dim_vo None: head_dim).
    fine_tiles: the variant has a per-pair mask (`_PREFILL_WGMMA_FINE_SHAPE`).
    distance_table: its logits have a distance term (`_DISTANCE_KEY_STAGES`); the shape's
    shared memory is the same either way, so a launch need not know. decode_mma: the decode
    kind's tensor-core kernel (the module-level `decode_mma` decides). Raises ValueError."""
    _check(kind, dtype)
    head_dim, head_dim_vo = check_head_dims(head_dim, head_dim_vo)
    ctype, size = DTYPES[dtype]
    chunk_elems = _VEC_BYTES // size
    if kind == "merge":  # rows of values only
        tx = head_dim_vo // chunk_elems
        return TemplateShape(kind, dtype, ctype, head_dim, head_dim_vo, chunk_elems, chunk_elems,
                             tx, 0, 0, 0, _MERGE_THREADS, 1)
    # Both vectors over the same TX lanes, whole 16-byte chunks per lane.
    tx = math.gcd(head_dim, head_dim_vo) // chunk_elems
    vec, vec_vo = head_dim // tx, head_dim_vo // tx
    if kind in ("prefill", "cascade"):
        wgmma = uses_wgmma(kind, head_dim, arch, head_dim_vo)
        table = _PREFILL_WGMMA_SHAPE if wgmma else _PREFILL_SHAPE
        if wgmma and fine_tiles:
            table = {**table, **_PREFILL_WGMMA_FINE_SHAPE}
        kv_tile, stages, warps, row_blocks, min_blocks = table[head_dim]
        # mma.sync: S of 32 keys for 32 rows beside O is what the registers hold, a tile is
        # consumed in steps; wgmma: a warp's 16 rows hold S of the whole tile.
        sub_keys = kv_tile if wgmma else min(kv_tile, 32)
        key_stages = _PREFILL_WGMMA_KEY_STAGES.get(head_dim, stages) if wgmma else stages
        table_bytes = DISTANCE_TABLE_BYTES
        if (wgmma and distance_table and not fine_tiles and head_dim == head_dim_vo
                and head_dim in _DISTANCE_KEY_STAGES):
            fewer = key_stages - _DISTANCE_KEY_STAGES[head_dim]
            key_stages -= fewer
            table_bytes += fewer * kv_tile * head_dim * size
        return TemplateShape(kind, dtype, ctype, head_dim, head_dim_vo, vec, vec_vo, tx, kv_tile,
                             stages, 0, 32 * warps, min_blocks, row_blocks, wgmma, sub_keys,
                             key_stages,
                             PRODUCER_THREADS if wgmma and head_dim in _PRODUCER_HEAD_DIMS else 0,
                             table_bytes)
    if decode_mma:
        if kind != "decode" or (head_dim, head_dim_vo) not in _DECODE_MMA_HEAD_DIMS:
            raise ValueError(f"no tensor-core {kind} kernel at head dims {head_dim}/{head_dim_vo}")
        return TemplateShape(kind, dtype, ctype, head_dim, head_dim_vo, vec, vec_vo, tx,
                             _DECODE_MMA_TILE, _DECODE_MMA_STAGES, 0, 32 * _DECODE_MMA_WARPS,
                             1 if head_dim == 256 else 2, decode_mma=True)
    # The layout relies on: a key per TX-group at least (R * TZ <= kv_tile) and a softmax
    # chunk per z-group at least (TZ <= kv_tile / chunk) for every block launch_config makes.
    kv_tile = max(_prev_pow2(_TILE_BYTES // ((head_dim + head_dim_vo) * size)),
                  _MAX_THREADS // tx, _CHUNK * _MIN_THREADS // tx)
    # Two head dims (MLA): 8 lanes per row hold 24 + 16 elements, and the 64-key stages
    # (120 KB) allow one CTA per SM anyway, so the registers are not capped at 128.
    min_blocks = _MIN_BLOCKS if head_dim == head_dim_vo else 1
    return TemplateShape(kind, dtype, ctype, head_dim, head_dim_vo, vec, vec_vo, tx, kv_tile,
                         _STAGES, _CHUNK, _MAX_THREADS, min_blocks)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def launch_config(kind: str, head_dim: int, group_size: int, dtype: str = "bfloat16",
                  arch: str | None = None, head_dim_vo: int | None = None,
                  fine_tiles: bool = False, decode_mma: bool = False) -> LaunchConfig:
    """Block, rows per work item, dynamic shared memory and KV tile of a launch.

    group_size: query heads per KV head. The decode kernel fuses a work item's rows over the
    group; R = group_size rounded up to a power of two (at most 16, and at most
    256 / TX), so a decode step's whole group shares each KV tile. Raises ValueError.

    >>> launch_config("decode", 128, 4)
    LaunchConfig(block=(16, 4, 2), rows_per_tile=4, smem_bytes=49152, kv_tile=32)
    >>> launch_config("merge", 128, 4)
    LaunchConfig(block=(16, 2, 4), rows_per_tile=2, smem_bytes=4160, kv_tile=0)
    >>> launch_config("prefill", 128, 4)
    LaunchConfig(block=(128, 1, 1), rows_per_tile=128, smem_bytes=101376, kv_tile=64)
    >>> launch_config("prefill", 128, 4, arch="sm_90a")
    LaunchConfig(block=(384, 1, 1), rows_per_tile=128, smem_bytes=232448, kv_tile=128)
    >>> launch_config("decode", 192, 1, head_dim_vo=128)
    LaunchConfig(block=(8, 1, 16), rows_per_tile=1, smem_bytes=122880, kv_tile=64)

    The prefill kernel's rows do not depend on group_size: its R fused rows cover R / group
    queries of every head of the group. arch: the target the kernel was compiled for (it
    picks the prefill path, see `template_shape`). head_dim_vo: the value / output head dim
    (None: head_dim). fine_tiles: the variant has a per-pair mask (see `template_shape`).
    decode_mma: the decode kernel is the tensor-core one (module-level `decode_mma`): R =
    DECODE_MMA_ROWS whatever the group, the block exactly its warps (TX-lane row groups for
    the q and output stages), kv_tile a CTA's tile of every warp's keys.

    >>> launch_config("decode", 128, 4, decode_mma=True)
    LaunchConfig(block=(16, 8, 1), rows_per_tile=8, smem_bytes=102400, kv_tile=128)
    """
    shape = template_shape(kind, head_dim, dtype, arch, head_dim_vo, fine_tiles,
                           decode_mma=decode_mma and kind == "decode")
    if not _is_int(group_size) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    group_size, head_dim, head_dim_vo = int(group_size), shape.head_dim, shape.head_dim_vo
    size = DTYPES[dtype][1]
    if kind == "merge":  # rows x slot groups of TX lanes, their states in shared memory
        groups = shape.max_threads // shape.tx
        slot_groups = min(_MERGE_SLOT_GROUPS, groups)
        return LaunchConfig((shape.tx, groups // slot_groups, slot_groups),
                            groups // slot_groups, groups * (head_dim_vo + 2) * 4, 0)
    if kind in ("prefill", "cascade"):
        rows = 16 * shape.row_blocks * (shape.max_threads // 32)
        return LaunchConfig((shape.block_threads, 1, 1), rows, shape.smem_bytes, shape.kv_tile)
    if shape.decode_mma:  # the warps' rings of e4m3 bytes (their states at an item's end), Q
        rings = shape.stages * shape.kv_tile * (head_dim + head_dim_vo)
        smem = rings + DECODE_MMA_ROWS * head_dim * 4
        return LaunchConfig((shape.tx, shape.max_threads // shape.tx, 1), DECODE_MMA_ROWS, smem,
                            shape.kv_tile)
    stages = shape.stages * shape.kv_tile * (head_dim + head_dim_vo) * size  # K and V stages
    rows = min(_next_pow2(group_size), _MAX_ROWS, shape.max_threads // shape.tx)
    tz = max(1, _MIN_THREADS // (shape.tx * rows))
    merge = rows * tz * (head_dim_vo + 2) * 4  # TZ partial states (o, m, d), aliases the pipeline
    return LaunchConfig((shape.tx, rows, tz), rows, max(stages, merge), shape.kv_tile)
