"""An fp8 cache's prefill through a converted copy (runtime/dequantize.py): which pages a plan
converts, the workspace it writes, the two kernels' arguments, the conversion kernel's source.
No GPU needed (NVRTC compiles here); tests/runtime/test_gpu_fp8.py runs them."""

import numpy as np
import pytest

import attnlang
from attnlang import ir
from attnlang.codegen.render import render_dequantize
from attnlang.runtime import attention as A
from attnlang.runtime import dequantize as D
from attnlang.runtime.compiler import compile_source
from attnlang.runtime.launches import graph_kernels
from attnlang.runtime.paged import indptr_from_lengths
from attnlang.runtime.plan_mixed import Tiling, plan_mixed
from attnlang.runtime.workspace import DEQUANTIZE, PREFILL_DEQUANTIZED
from tests.runtime.test_validation import _entry_signature, _launch_inputs
from tests.variant_files import VARIANT_FILES, VARIANT_IDS

VARIANT_PATHS = dict(zip(VARIANT_IDS, VARIANT_FILES, strict=True))
GEOMETRY = dict(num_kv_heads=2, group_size=4, decode=Tiling(4, 16, 32),
                prefill=Tiling(128, 8, 128), prefill_min_rows=8)


def batch(qo, kv, page_size=16, seed=0):
    """PlanInputs over shuffled pages, and its plan_mixed plan."""
    counts = [-(-n // page_size) for n in kv]
    last = [n - (c - 1) * page_size if c else 0 for n, c in zip(kv, counts, strict=True)]
    pages = np.random.default_rng(seed).permutation(sum(counts) + 7)[:sum(counts)]
    inputs = A.validate_plan_inputs(indptr_from_lengths(qo), indptr_from_lengths(counts),
                                    pages, last, page_size=page_size)
    return inputs, plan_mixed(inputs.qo_lens, inputs.kv_lens, **GEOMETRY)


def test_a_long_prompt_converts_its_pages_once():
    # a decode step, a 2048-query prompt (8192 fused rows: 64 tiles) and another decode step
    inputs, plan = batch([1, 2048, 1], [300, 2048, 50])
    chosen = D.choose_pages(plan, inputs, page_size=16, capacity=1000)
    assert chosen is not None and chosen.reads_per_key >= D.MIN_READS_PER_KEY
    first, end = inputs.kv_indptr[1], inputs.kv_indptr[2]
    # the prompt's pages, in its order, become slots 0..n-1 of the table it reads
    assert np.array_equal(chosen.pages, inputs.kv_indices[first:end])
    assert np.array_equal(chosen.kv_indices[first:end], np.arange(end - first))
    # the decode steps keep their pages; the caller's table is untouched
    assert np.array_equal(chosen.kv_indices[:first], inputs.kv_indices[:first])
    assert np.array_equal(chosen.kv_indices[end:], inputs.kv_indices[end:])
    assert not np.array_equal(inputs.kv_indices[first:end], np.arange(end - first))


def test_what_decides_against_a_copy():
    inputs, plan = batch([1, 2048], [300, 2048])
    pages = inputs.kv_indptr[2] - inputs.kv_indptr[1]
    assert D.choose_pages(plan, inputs, page_size=16, capacity=pages) is not None
    assert D.choose_pages(plan, inputs, page_size=16, capacity=pages - 1) is None  # too big
    assert D.choose_pages(plan, inputs, page_size=16, capacity=pages, force=False) is None
    assert D.choose_pages(plan, inputs, page_size=16, capacity=0, force=True) is None
    # a short chunk reads each key once per 128 fused rows: converting first does not pay,
    # unless forced
    inputs, plan = batch([40], [4096])
    assert D.choose_pages(plan, inputs, page_size=16, capacity=1000) is None
    forced = D.choose_pages(plan, inputs, page_size=16, capacity=1000, force=True)
    assert forced is not None and forced.reads_per_key == pytest.approx(2.0)
    # decode steps alone: no prefill, nothing to convert
    inputs, plan = batch([1, 1], [300, 50])
    assert plan.prefill.num_work_items == 0
    assert D.choose_pages(plan, inputs, page_size=16, capacity=1000, force=True) is None


def test_pages_of_one_token():
    # the ragged layout's pages: every token a page, the table the identity
    inputs, plan = batch([600], [700], page_size=1)
    chosen = D.choose_pages(plan, inputs, page_size=1, capacity=1 << 20, force=True)
    assert np.array_equal(chosen.pages, inputs.kv_indices)
    assert np.array_equal(chosen.kv_indices, np.arange(700))


def test_split_chunks_convert_every_page_they_read():
    # KV split into chunks of 256 (several items per head): the union of their ranges
    inputs, plan = batch([700, 1], [1000, 64])
    plan = plan_mixed(inputs.qo_lens, inputs.kv_lens, **GEOMETRY, kv_chunk_size=256)
    assert plan.merge_count > 0
    chosen = D.choose_pages(plan, inputs, page_size=16, capacity=1000, force=True)
    assert np.array_equal(chosen.pages, inputs.kv_indices[:inputs.kv_indptr[1]])


def test_workspace_image_of_a_copy():
    from attnlang.runtime.plan_mixed import worst_case_mixed_bounds

    bounds = worst_case_mixed_bounds(max_batch_size=4, max_total_q=4096, num_kv_heads=2,
                                     group_size=4, decode=GEOMETRY["decode"],
                                     prefill=GEOMETRY["prefill"])
    layout = A.workspace_layout(16, bounds, 1024, 8, dequant_pages=200)
    assert layout.capacity["dequant_pages"] == 201
    assert layout.capacity["dequant_work_indptr"] == 9
    assert A.workspace_layout(16, bounds, 1024, 8).capacity["dequant_pages"] == 0
    inputs, plan = batch([1, 2048], [300, 2048])
    chosen = D.choose_pages(plan, inputs, page_size=16, capacity=200)
    off = layout.offsets
    host = np.full(layout.total, -7, dtype=np.int32)
    n = A.fill_workspace(layout, host, plan, inputs, chosen)
    index = plan.prefill.work_indptr
    assert n == off["kv_indices"] + inputs.kv_indices.size
    assert host[off["dequant_pages"]] == chosen.pages.size
    assert np.array_equal(host[off["dequant_pages"] + 1:][:chosen.pages.size], chosen.pages)
    # the prefill list runs in the converted prefill; the fp8 prefill kernel finds none
    assert np.array_equal(host[off["dequant_work_indptr"]:][:index.size], index)
    assert not host[off["prefill_work_indptr"]:][:index.size].any()
    assert np.array_equal(host[off["kv_indices"]:][:inputs.kv_indices.size], chosen.kv_indices)
    # without a copy: the other way round, and the caller's page table
    A.fill_workspace(layout, host, plan, inputs)
    assert host[off["dequant_pages"]] == 0
    assert not host[off["dequant_work_indptr"]:][:index.size].any()
    assert np.array_equal(host[off["prefill_work_indptr"]:][:index.size], index)
    assert np.array_equal(host[off["kv_indices"]:][:inputs.kv_indices.size],
                          inputs.kv_indices)
    with pytest.raises(ValueError, match="no room"):
        A.fill_workspace(A.workspace_layout(16, bounds, 1024, 8), host, plan, inputs, chosen)


@pytest.mark.parametrize("variant_id", ["causal", "alibi", "kitchen_sink"])
def test_kernel_args_of_the_copy(variant_id):
    variant = ir.with_kv_scales(attnlang.load(VARIANT_PATHS[variant_id]))
    values, ws = _launch_inputs(variant, np.int32(1), np.float32(1))
    ws.update(dequant_k=91, dequant_v=92, dequant_tma_maps=93)
    common = dict(num_heads=8, num_kv_heads=2, page_size=16, sm_scale=0.125, params=values)
    # the conversion: the rendered entry's arguments, one for one
    decls = _entry_signature(render_dequantize(variant.params, "bfloat16", 128), DEQUANTIZE)
    args = A.kernel_args(DEQUANTIZE, q=1, k_cache=2, v_cache=3, out=4, lse=5, ws=ws, **common)
    assert len(args) == len(decls)
    named = dict(zip([d.split()[-1] for d in decls], args, strict=True))
    assert (named["k_cache"], named["v_cache"], named["dequant_pages"]) == (
        2, 3, ws["dequant_pages"])
    assert (named["k_out"], named["v_out"]) == (91, 92)
    assert named["param_k_scale"] == values[-2][1].ptr
    # the prefill over the copy: the prefill kernel's, its cache, maps and list index moved
    got = A.kernel_args(PREFILL_DEQUANTIZED, q=1, k_cache=2, v_cache=3, out=4, lse=5, ws=ws,
                        **common)
    want = A.kernel_args("prefill", q=1, k_cache=91, v_cache=92, out=4, lse=5,
                         ws={**ws, "tma_maps": 93,
                             "prefill_work_indptr": ws["dequant_work_indptr"]}, **common)
    assert got == want
    # run()'s update leaves the copy's pointers in place
    packed = A.PackedArgs(PREFILL_DEQUANTIZED, ws, num_heads=8, num_kv_heads=2, page_size=16,
                          num_params=len(values))
    packed.update(11, 12, 13, 14, 15, 0.125, values)
    assert packed.values() == A.kernel_args(PREFILL_DEQUANTIZED, q=11, k_cache=0, v_cache=0,
                                            out=14, lse=15, ws=ws, **common)
    assert packed.snapshot()[0] == (0, -1, -1, 3)


@pytest.mark.parametrize("dtype, head_dim, head_dim_vo, arch",
                         [("bfloat16", 128, None, "sm_90a"), ("float16", 256, None, "sm_80"),
                          ("bfloat16", 192, 128, "sm_90a")])
def test_conversion_kernel_compiles_without_spills(dtype, head_dim, head_dim_vo, arch):
    params = ir.with_kv_scales(attnlang.load(VARIANT_PATHS["softcap"])).params
    cubin = compile_source(render_dequantize(params, dtype, head_dim, head_dim_vo), arch,
                           name="dequantize.cu", label="dequantize")
    (info,) = cubin.functions
    assert info.name == DEQUANTIZE and info.spill_stores == 0 and info.registers <= 64


def test_render_refuses_params_without_the_scales():
    with pytest.raises(ValueError, match="must end with k_scale, v_scale"):
        render_dequantize(attnlang.load(VARIANT_PATHS["softcap"]).params, "bfloat16", 128)


def test_a_copy_where_a_request_may_read_a_key_often_enough():
    # one read per tile of 128 fused rows: GQA 4 needs 737 queries for 24 tiles
    def reachable(max_qo_len, group):
        return D.reachable(max_qo_len, group_size=group, rows_per_tile=128)

    assert not reachable(1, 4) and not reachable(736, 4)
    assert reachable(737, 4) and reachable(2945, 1)
    assert D.MIN_READS_PER_KEY == 24  # the figure the lines above were written for


def test_graphs_hold_the_copy_where_a_prefill_is_reachable():
    assert graph_kernels(4, 8, 1, cascade=False, dequantize=True)[DEQUANTIZE] is False
    both = graph_kernels(4, 8, 512, cascade=False, dequantize=True)
    assert both[DEQUANTIZE] and both[PREFILL_DEQUANTIZED] and both["prefill"]
    assert not graph_kernels(4, 8, 512, cascade=False)[PREFILL_DEQUANTIZED]


@pytest.mark.parametrize("value, error", [(-1, ValueError), (True, TypeError),
                                          (1.5, TypeError)])
def test_max_dequant_bytes_is_checked(value, error):
    from attnlang.runtime.validate import check_construction

    with pytest.raises(error, match="max_dequant_bytes"):
        check_construction(max_batch_size=1, max_total_q=1, max_kv_indices=1,
                           max_pair_mask_bytes=1, max_work_items=None, max_partial_rows=None,
                           max_merge_rows=None, num_ctas=None, num_prefill_ctas=None,
                           prefill_min_rows=None, cascade=False, max_dequant_bytes=value)


def test_page_bytes_and_capacity():
    shape = A.validate_shape(32, 8, 128, "bfloat16", 16, kv_dtype="fp8")
    assert D.page_bytes(shape) == 16 * 8 * 256 * 2
    assert D.capacity_pages(shape, 256 << 20) == 4096
    assert D.capacity_pages(shape, D.page_bytes(shape) - 1) == 0


def test_why_a_batch_attention_has_no_copy():
    fp8 = A.validate_shape(32, 8, 128, "bfloat16", 16, kv_dtype="fp8")
    ok = dict(max_bytes=256 << 20, has_variant=True, prefill_reachable=True, max_qo_len=8192,
              rows_per_tile=128)
    assert D.why_no_copy(fp8, **ok) is None
    assert D.why_no_copy(A.validate_shape(32, 8, 128, "bfloat16", 16), **ok) == (
        "its cache is not fp8")
    assert "holds no page" in D.why_no_copy(fp8, **{**ok, "max_bytes": 1000})
    assert "load_compiled" in D.why_no_copy(fp8, **{**ok, "has_variant": False})
    for bounds in ({"max_qo_len": 1}, {"prefill_reachable": False}):
        assert "reads a key 24 times" in D.why_no_copy(fp8, **{**ok, **bounds})


def test_plan_copy_refuses_what_it_cannot_do():
    from attnlang.runtime.planner import CapacityError

    shape = A.validate_shape(8, 2, 128, "bfloat16", 16, kv_dtype="fp8")
    inputs, plan = batch([1, 2048], [300, 2048])
    common = dict(max_bytes=1 << 20, capacity=1000, no_copy=None)
    assert D.plan_copy(plan, inputs, shape, **common) is not None
    assert D.plan_copy(plan, inputs, shape, **common, force=False) is None
    with pytest.raises(ValueError, match="has no converted copy: its cache is not fp8"):
        D.plan_copy(plan, inputs, shape, **{**common, "no_copy": "its cache is not fp8"},
                    force=True)
    assert D.plan_copy(plan, inputs, shape, **{**common, "no_copy": "x"}) is None
    with pytest.raises(CapacityError, match="max_dequant_bytes"):
        D.plan_copy(plan, inputs, shape, **{**common, "capacity": 10}, force=True)
    assert D.plan_copy(plan, inputs, shape, **{**common, "capacity": 10}) is None  # per tile
    with pytest.raises(TypeError, match="dequantize must be None, True or False"):
        D.plan_copy(plan, inputs, shape, **common, force="yes")
