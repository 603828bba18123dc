"""The rendered prefill kernel (with decode and merge, as BatchAttention plans them) on the CPU.

Builds on tests/codegen/emulator.py (threads, barriers, shuffles, cp.async, half/bf16): this
module adds the prefill kernel's warp collectives (emulator_prefill_shim.h: ldmatrix, mma,
ballot), maps its inline PTX onto them, and plans with `plan_mixed.plan_mixed`, so a mixed batch
runs each request in the kernel the runtime would pick.

What this checks beyond the decode emulation: mma / ldmatrix fragment indexing, the
swizzled shared-memory layouts, Q in registers or shared memory, tile skipping (mask_tile,
the tile cursor, per-warp refinement), the online softmax on fragments, both epilogues, the
mixed plan's two work lists and their shared partial states. Not: timing, bank conflicts.

    r = run_case(attnlang.load("examples/causal.attn"), workdir, qo_lens=(40, 1),
                 kv_lens=(90, 33), kv_chunk_size=40)
    r.rel_err, r.decode_items, r.prefill_items
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnlang import ir, reference
from attnlang.codegen.config import DECODE_MMA_ROWS, launch_config
from attnlang.codegen.lower import lower
from attnlang.codegen.render import decode_mma, render
from attnlang.runtime import cascade as cascades
from attnlang.runtime.plan_mixed import Tiling, plan_mixed
from tests.codegen import emulator as base

SHIM = Path(__file__).with_name("emulator_prefill_shim.h")
available = base.available

_LDMATRIX = re.compile(r'asm volatile\("ldmatrix\.sync\.aligned\.m8n8\.x4(\.trans)?\.shared\.b16'
                       r'.*?\);', re.S)
_MMA = re.compile(r'asm volatile\(\s*"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)\.'
                  r'.*?\);', re.S)
_MOVMATRIX = re.compile(r'asm volatile\("movmatrix\.sync\.aligned\.m8n8\.trans\.b16.*?\);', re.S)
_SMEM_U32 = "return static_cast<unsigned>(__cvta_generic_to_shared(ptr));"
# prefill_tiles.cuh's cp.async to a shared-memory address (load_tile), before the base emulator's
# substitution of machine.cuh's generic-pointer one.
_CP_ASYNC_SHARED = re.compile(
    r'asm volatile\("cp\.async\.cg\.shared\.global \[%0\], \[%1\], 16, %2;'
    r'\\n"\s*::\s*"r"\(dst\), "l"\(src\), "r"\(valid \? 16 : 0\).*?\);', re.S)
_CP_ASYNC_SHARED_8 = re.compile(
    r'asm volatile\("cp\.async\.ca\.shared\.global \[%0\], \[%1\], 8, %2;'
    r'\\n"\s*::\s*"r"\(dst\), "l"\(src\), "r"\(valid \? 8 : 0\).*?\);', re.S)


def _emulated_source(src: str, kind: str) -> str:
    src, n_ld = _LDMATRIX.subn(
        lambda m: f"emu_ldmatrix(r, smem_addr, {'true' if m.group(1) else 'false'});", src)
    src, n_mma = _MMA.subn(
        lambda m: f"emu_mma<{'true' if m.group(1) == 'bf16' else 'false'}>(c, a, b0, b1);", src)
    assert n_ld == 2 and n_mma == 2, "machine.cuh's mma section changed; update the emulator"
    src = _MOVMATRIX.sub("y = emu_movmatrix_trans(x);", src)  # decode_mma.cu.j2's transpose
    assert _SMEM_U32 in src, "machine.cuh's smem_u32 changed; update the emulator"
    src, n_cp = _CP_ASYNC_SHARED.subn("emu_cp_async(emu_smem() + dst, src, valid);", src)
    src, n_cp8 = _CP_ASYNC_SHARED_8.subn("emu_cp_async(emu_smem() + dst, src, valid, 8);", src)
    assert n_cp == n_cp8 == (kind in ("prefill", "cascade")), (
        "prefill_tiles.cuh's cp_async_16_shared changed; update the emulator")
    src = src.replace(_SMEM_U32, "return (unsigned)((const unsigned char*)ptr - emu_smem());")
    src = src.replace("extern __shared__ __align__(1024) unsigned char smem[];",
                      "extern __shared__ __align__(16) unsigned char smem[];")
    out = base._emulated_source(src, kind)
    include = f'#include "{base.SHIM}"'
    return out.replace(include, f'{include}\n#include "{SHIM}"', 1)


def build(hooks, kind: str, dtype: str, head_dim: int, bin_dir: Path,
          head_dim_vo: int | None = None, kv_dtype: str | None = None) -> Path:
    """The emulator executable of one kernel (cached in bin_dir by source hash)."""
    src = _emulated_source(render(hooks, kind, dtype, head_dim, None, head_dim_vo, kv_dtype),
                           kind)
    return base.compile_cached(src, f"{hooks.variant}_{kind}_{dtype}_{head_dim}_{head_dim_vo}",
                               bin_dir, (base.SHIM, SHIM))


@dataclass(frozen=True)
class Result:
    rel_err: float  # ||out - ref|| / ||ref||
    lse_err: float | None  # max |lse - ref| over finite rows (None: softmax off)
    lse_finite_matches: bool  # lse is finite exactly where the reference's is, else -inf
    has_nan: bool
    decode_items: int
    prefill_items: int
    merge_rows: int
    cascade_items: int = 0


def run_case(v: ir.Variant, workdir: Path, *, dtype: str = "bfloat16", head_dim: int = 64,
             num_heads: int = 4, num_kv_heads: int = 2, qo_lens=(40, 1), kv_lens=(90, 33),
             page_size: int = 16, num_ctas: int = 3, kv_chunk_size: int | None = None,
             sm_scale: float | None = None, eager: bool = False, seed: int = 0,
             head_dim_vo: int | None = None, params: dict | None = None,
             kv_dtype: str | None = None, shared_pages: tuple = (),
             own_in_cascade: bool = False) -> Result:
    """Plan a random paged batch with plan_mixed, run decode / prefill / merge emulated (each
    only if it has work), compare with the reference. Outputs and partials start as NaN.
    params: run-time params to use instead of random ones (by name). kv_dtype: as in
    emulator.run_case (an fp8 cache). shared_pages: ((first, end, pages), ...): requests
    [first, end) begin with the same `pages` page ids (nested groups share more), and the
    batch is planned as a cascade (`cascade.plan_cascade`, levels found from the page table
    with no minimum), its shared levels run in the cascade kernel (with own_in_cascade the
    grouped requests' own tensor-core items too)."""
    rng = np.random.default_rng(seed)
    group = num_heads // num_kv_heads
    qo_lens, kv_lens = np.asarray(qo_lens), np.asarray(kv_lens)
    total_q = int(qo_lens.sum())
    pages = [-(-int(n) // page_size) for n in kv_lens]
    total_pages = sum(pages) + 3
    kv_indices = rng.permutation(total_pages)[:sum(pages)].astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    for first, end, n in shared_pages:  # the group's first request's pages, shared
        for b in range(first + 1, end):
            kv_indices[kv_indptr[b]:kv_indptr[b] + n] = kv_indices[kv_indptr[first]:
                                                                   kv_indptr[first] + n]
    last = np.array([int(n) - (p - 1) * page_size if p else 0
                     for n, p in zip(kv_lens, pages, strict=True)], np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    dv = head_dim if head_dim_vo is None else head_dim_vo
    q_bits, q = base._to_bits(rng.standard_normal((total_q, num_heads, head_dim)), dtype)
    cache_shape = (total_pages, page_size, num_kv_heads, head_dim)
    kv_scales = rng.uniform(0.004, 0.03, (2, num_kv_heads)).astype(np.float32)
    k_bits, k = base.kv_data(rng, cache_shape, dtype, kv_dtype, kv_scales[0])
    v_bits, vv = base.kv_data(rng, cache_shape[:3] + (dv,), dtype, kv_dtype, kv_scales[1])
    sizes = ir.extent_sizes(v, num_heads, num_kv_heads, len(qo_lens), head_dim, dv)
    params = base._params(v, rng, sizes, kv_lens, params, qo_lens)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    ref_o, ref_lse = reference.attention_paged(v, q, k, vv, qo_indptr, kv_indptr, kv_indices,
                                               last, params=params, sm_scale=scale)

    v, params = base.with_kv_scales(v, params, kv_dtype, kv_scales)
    hooks = lower(v)
    # The decode kernel on tensor cores (an fp8 cache) keeps decode steps of up to 8 rows, as
    # BatchAttention plans them.
    mma = decode_mma(hooks, head_dim, dv, kv_dtype)
    cfgs = {kind: launch_config(kind, head_dim, group, dtype, head_dim_vo=dv,
                                decode_mma=mma and kind == "decode")
            for kind in ("decode", "prefill")}
    min_rows = {"prefill_min_rows": DECODE_MMA_ROWS} if mma else {}
    tilings = {kind: Tiling(c.rows_per_tile, num_ctas, c.kv_tile) for kind, c in cfgs.items()}
    if shared_pages:
        lcp = cascades.adjacent_shared(kv_indptr, kv_indices, kv_lens, page_size)
        plan = cascades.plan_cascade(qo_lens, kv_lens, cascades.find_groups(lcp, min_shared_kv=1),
                                     num_kv_heads=num_kv_heads, group_size=group, **tilings,
                                     kv_chunk_size=kv_chunk_size, own_in_cascade=own_in_cascade,
                                     **min_rows)
    else:
        plan = plan_mixed(qo_lens, kv_lens, num_kv_heads=num_kv_heads, group_size=group,
                          **tilings, kv_chunk_size=kv_chunk_size, **min_rows)
    nan16 = np.uint16(0x7FFF if dtype == "float16" else 0x7FC0)
    partial_rows = max(1, plan.num_partial_rows)
    state = {
        "out": np.full((total_q, num_heads, dv), nan16, np.uint16),
        "lse": np.full((total_q, num_heads), np.nan, np.float32),
        "partial_o": np.full((partial_rows, dv), np.nan, np.float32),
        "partial_lse": np.full((partial_rows,), np.nan, np.float32),
    }
    scalars = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "page_size": page_size,
               "sm_scale": scale}
    tensor_params = base.kernel_param_values(hooks, v, params, scalars, qo_lens, kv_lens)
    bin_dir = workdir / "bin"
    lists = (("cascade", plan.cascade), ("decode", plan.decode), ("prefill", plan.prefill))
    for kind, sub in lists:
        if sub is None or sub.num_work_items == 0:
            continue
        extra = ({"cascade_item": plan.cascade_item, "token_request": plan.token_request}
                 if kind == "cascade" else {})
        arrays = {
            "q": q_bits, "k_cache": k_bits, "v_cache": v_bits, **state,
            "qo_indptr": qo_indptr, "kv_indptr": kv_indptr,
            "kv_indices": kv_indices if len(kv_indices) else np.zeros(1, np.int32),
            "kv_last_page_len": last,
            **{name: a.astype(np.int32) for name, a in sub.work_arrays().items()},
            **{name: a.astype(np.int32) for name, a in extra.items()},
            **tensor_params,
        }
        res = base._launch(build(hooks, kind, dtype, head_dim, bin_dir, dv, kv_dtype),
                           workdir / "run", arrays, scalars, num_ctas,
                           cfgs["prefill" if kind == "cascade" else kind], eager)
        state = {name: res[name] for name in state}
    if plan.merge_count:
        arrays = {
            "merge_count": np.array([plan.merge_count], np.int32), **state,
            "qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_last_page_len": last,
            **{name: a.astype(np.int32) for name, a in plan.merge_arrays().items()},
            **tensor_params,
        }
        res = base._launch(build(hooks, "merge", dtype, head_dim, bin_dir, dv), workdir / "run",
                           arrays, scalars, 2,
                           launch_config("merge", head_dim, group, dtype, head_dim_vo=dv),
                           eager)
        state.update(out=res["out"], lse=res["lse"])

    o, lse = base._from_bits(state["out"], dtype), state["lse"]
    has_nan = bool(np.isnan(o).any() or (ref_lse is not None and np.isnan(lse).any()))
    rel_err = float(np.linalg.norm(o - ref_o) / max(np.linalg.norm(ref_o), 1e-30))
    lse_err, finite_ok = None, True
    if ref_lse is not None:
        finite = np.isfinite(ref_lse)
        finite_ok = bool((np.isfinite(lse) == finite).all()
                         and (lse[~finite] == -np.inf).all())
        lse_err = float(np.abs(lse[finite] - ref_lse[finite]).max()) if finite.any() else 0.0
    return Result(rel_err, lse_err, finite_ok, has_nan, plan.decode.num_work_items,
                  plan.prefill.num_work_items, plan.merge_count,
                  plan.cascade.num_work_items if plan.cascade is not None else 0)
