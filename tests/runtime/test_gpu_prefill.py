"""The prefill kernel (tensor cores) through BatchAttention, against the NumPy reference.

Requests with more than PREFILL_MIN_ROWS fused rows (qo_len * group) run in the prefill
kernel; the plan asserts they did. Every variant of the zoo in both dtypes over long ragged
queries (two requests, qo_len 200..700 over up to 1500 keys), head_dim 64/128/256, page sizes
1/16/64 and GQA 1/4/8 (each (dtype, head_dim, page_size, group) triple once, so every pair of
values meets), half of them with forced KV splits (partial states + merge). Then the places
tile skipping can go wrong: lengths that are not multiples of the tiles, windows and sinks
straddling tiles, chunked prefill (qo_len < kv_len), rows that see no key, negative and zero
sm_scale, a mixed decode + prefill plan, CUDA-graph replay across plans, determinism.

Tolerance (LANGUAGE.md section 7): relative L2 error <= 1e-2 (bf16), <= 2e-3 (fp16); the
largest error per dtype is recorded (tests/conftest.py, error_log).
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

import attnlang
from attnlang.reference import attention, attention_paged
from attnlang.runtime.arrays import round_to_dtype
from attnlang.runtime.paged import indptr_from_lengths
from attnlang.runtime.planner import PREFILL_MIN_ROWS
from tests.runtime.test_gpu_attention import (
    SHORT,
    TOLERANCE,
    VARIANT_PATHS,
    check_lse,
    from_device,
    make_batch,
    make_params,
    poisoned,
    rel_l2,
    split_params,
    to_device,
)
from tests.variant_files import VARIANT_IDS

pytestmark = pytest.mark.gpu


def run_and_check(cp, variant, qo, kv, *, num_qo_heads, num_kv_heads, head_dim, dtype,
                  page_size, seed, error_log, where, kv_chunk_size=None, sm_scale=None,
                  expect_prefill=True, expect_decode=None, head_dim_vo=None, **kwargs):
    """Build a batch, plan it, run it, compare out and lse with the reference. Returns the
    plan and the device output (for further checks)."""
    rng = np.random.default_rng(seed)
    qo, kv = np.asarray(qo), np.asarray(kv)
    batch = make_batch(rng, qo, kv, num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                       head_dim_vo)
    params = make_params(variant, rng, qo, kv, num_qo_heads, num_kv_heads, head_dim,
                         head_dim_vo)
    ref_o, ref_lse = attention_paged(variant, batch.q, batch.k_cache, batch.v_cache,
                                     *batch.table, params=params, sm_scale=sm_scale)
    kwargs.setdefault("max_batch_size", max(4, len(qo)))
    kwargs.setdefault("max_total_q", max(16, int(qo.sum())))
    kwargs.setdefault("max_kv_indices", max(1 << 12, int(batch.kv_indices.shape[0])))
    if kv_chunk_size is not None:
        kwargs.setdefault("max_work_items", 1 << 16)
        kwargs.setdefault("max_partial_rows", 1 << 18)
        kwargs.setdefault("max_merge_rows", 1 << 17)
    attn = attnlang.BatchAttention(variant, num_qo_heads, num_kv_heads, head_dim, dtype=dtype,
                                   page_size=page_size, head_dim_vo=head_dim_vo, **kwargs)
    plan_params, params = split_params(variant, params)
    plan = attn.plan(*batch.table, kv_chunk_size=kv_chunk_size, params=plan_params)
    assert (plan.prefill.num_work_items > 0) == expect_prefill, "prefill kernel dispatch"
    if expect_decode is not None:
        assert (plan.decode.num_work_items > 0) == expect_decode, "decode kernel dispatch"
    q = to_device(cp, batch.q, dtype)
    kc = to_device(cp, batch.k_cache, dtype)
    vc = to_device(cp, batch.v_cache, dtype)
    out = poisoned(cp, q.shape[:2] + vc.shape[3:], dtype)
    got, lse = attn.run(q, (kc, vc), params, out=out, return_lse=True, sm_scale=sm_scale)
    got_host = from_device(cp, got, dtype)
    assert not np.isnan(got_host).any(), "rows left unwritten (still NaN)"
    err = rel_l2(got_host, ref_o)
    error_log(dtype, err, where)
    assert err <= TOLERANCE[dtype], f"relative L2 error {err:.2e}"
    if variant.softmax:
        check_lse(cp.asnumpy(lse), ref_lse, dtype)
    return plan, got, ref_o


# ---------------------------------------------------------------------------- the zoo

_COMBOS = list(itertools.product((64, 128, 256), (1, 16, 64), (1, 4, 8)))  # head_dim, page, group
# Case n (every variant in both dtypes: dtype = n % 2) takes combo n mod 27: with >= 27 cases
# every (head_dim, page, group) triple occurs, and every (dtype, axis value) pair.
_ZOO = [(variant, dtype, *_COMBOS[n % len(_COMBOS)], "forced" if n % 4 >= 2 else "auto",
         2000 + n)
        for n, (variant, dtype) in enumerate(itertools.product(VARIANT_IDS,
                                                               ("bfloat16", "float16")))]
assert len(_ZOO) < len(_COMBOS) or {c[2:5] for c in _ZOO} == set(_COMBOS)
assert {(c[1], axis, c[2 + axis]) for c in _ZOO for axis in range(3)} == {
    (d, axis, value) for d in ("bfloat16", "float16") for axis in range(3)
    for value in {combo[axis] for combo in _COMBOS}}


@pytest.mark.parametrize(
    "variant_id, dtype, head_dim, page_size, group, split, seed", _ZOO,
    ids=[f"{v}-{SHORT[d]}-d{hd}-p{p}-g{g}-{s}" for v, d, hd, p, g, s, _ in _ZOO])
def test_zoo_in_prefill(cp, error_log, variant_id, dtype, head_dim, page_size, group, split,
                        seed):
    variant = attnlang.load(VARIANT_PATHS[variant_id])
    rng = np.random.default_rng(seed)
    qo = np.array([rng.integers(200, 701), rng.integers(200, 701)])
    kv = qo + np.array([rng.integers(0, 801), rng.integers(0, 301)])
    num_kv_heads = 2
    run_and_check(cp, variant, qo, kv, num_qo_heads=num_kv_heads * group,
                  num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                  page_size=page_size, seed=seed, error_log=error_log,
                  where=f"prefill {variant_id} {SHORT[dtype]} d{head_dim} p{page_size} g{group}",
                  kv_chunk_size=320 if split == "forced" else None)


# ---------------------------------------------------------------------------- tile skipping

WINDOW_SOURCES = {
    # A window that straddles 64-key tiles, alone and with attention sinks (streaming LLM),
    # and a bounded prefix: tile classes 0, 1 and 2 all occur, in every position.
    "window100": ("variant w100\nconst window: int = 100\n"
                  "mask = causal and q_pos - kv_pos < window\n"),
    "sinks": ("variant sinks\nconst window: int = 77\n"
              "mask = causal and (kv_pos < 5 or q_pos - kv_pos < window)\n"),
    "band": "variant band\nmask = kv_pos >= q_pos - 130 and kv_pos <= q_pos - 40\n",
    "future": "variant future\nmask = kv_pos > q_pos\n",  # the last query of a prompt sees nothing
    "never": "variant never\nmask = kv_pos < 0\n",  # every row fully masked: o = 0, lse = -inf
    "prefix": "variant pre\nconst c: int = 70\nmask = kv_pos < c or causal\n",
}

# (qo_lens, kv_lens): pure prompts with lengths around tile multiples, chunked prefill
# (queries behind a longer KV), and an empty request.
SKIP_LENGTHS = [
    ((17, 63, 64, 65), (17, 63, 64, 65)),
    ((129, 200), (129, 1001)),
    ((300, 0, 250), (1300, 7, 250)),
]


@pytest.mark.parametrize("name", list(WINDOW_SOURCES) + ["causal", "sliding_window"])
@pytest.mark.parametrize("lengths", range(len(SKIP_LENGTHS)))
@pytest.mark.parametrize("dtype, head_dim, group, page_size", [
    ("bfloat16", 128, 1, 16), ("float16", 64, 4, 1), ("bfloat16", 256, 8, 64)])
def test_tile_skipping_boundaries(cp, error_log, name, lengths, dtype, head_dim, group,
                                  page_size):
    if name in WINDOW_SOURCES:
        variant = attnlang.parse(WINDOW_SOURCES[name], filename=f"{name}.attn")
    else:
        variant = attnlang.load(VARIANT_PATHS[name])
    qo, kv = SKIP_LENGTHS[lengths]
    run_and_check(cp, variant, qo, kv, num_qo_heads=2 * group, num_kv_heads=2,
                  head_dim=head_dim, dtype=dtype, page_size=page_size,
                  seed=zlib.crc32(name.encode()) % 1000 + lengths, error_log=error_log,
                  where=f"skip {name} {qo}/{kv} {SHORT[dtype]} d{head_dim} g{group}",
                  expect_prefill=True)


# ---------------------------------------------------------------------------- mma.sync on Hopper

# On an H100 BatchAttention compiles for sm_90a, where the prefill kernel at head_dim 64 and
# 128 takes the wgmma path; compiled for plain sm_90 the same template takes the mma.sync path
# every other GPU runs. These cases keep that path covered on the Hopper test machine: the
# zoo (both dtypes, both head dims, paged and GQA) and the tile-skipping sources.
_SYNC = [(v, ("bfloat16", "float16")[n % 2], (128, 64)[n % 2], (16, 1)[n % 2], (4, 1)[n % 2],
          3000 + n) for n, v in enumerate(VARIANT_IDS + list(WINDOW_SOURCES))]


@pytest.mark.parametrize("name, dtype, head_dim, page_size, group, seed", _SYNC,
                         ids=[f"{v}-{SHORT[d]}-d{hd}" for v, d, hd, _, _, _ in _SYNC])
def test_mma_sync_path_on_hopper(cp, error_log, name, dtype, head_dim, page_size, group, seed):
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the other GPUs run the mma.sync path in every test")
    variant = (attnlang.parse(WINDOW_SOURCES[name], filename=f"{name}.attn")
               if name in WINDOW_SOURCES else attnlang.load(VARIANT_PATHS[name]))
    plan, _, _ = run_and_check(
        cp, variant, (65, 333), (65, 900), num_qo_heads=2 * group, num_kv_heads=2,
        head_dim=head_dim, dtype=dtype, page_size=page_size, seed=seed, error_log=error_log,
        where=f"mma.sync {name} {SHORT[dtype]} d{head_dim}", arch="sm_90",
        kv_chunk_size=300 if seed % 3 == 0 else None)


@pytest.mark.parametrize("chunk", [64, 100, 333])
def test_tile_skipping_with_split_kv(cp, error_log, chunk):
    """KV chunks that start mid-tile and items whose chunk is fully masked."""
    variant = attnlang.parse(WINDOW_SOURCES["sinks"], filename="sinks.attn")
    run_and_check(cp, variant, (260, 90), (900, 400), num_qo_heads=8, num_kv_heads=2,
                  head_dim=128, dtype="bfloat16", page_size=16, seed=chunk,
                  error_log=error_log, where=f"split sinks chunk {chunk}", kv_chunk_size=chunk)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [3, 6])
def test_groups_that_divide_no_pass(cp, error_log, group, head_dim):
    """A thread's epilogue passes step their (query, head) from the pass before (PassRows), and
    a CTA reads its next item's fields under the epilogue: groups of 3 and 6 heads, which divide
    neither a pass's rows nor an item's, on a grid of 5 CTAs with several items each."""
    variant = attnlang.load(VARIANT_PATHS["causal"])
    plan, _, _ = run_and_check(
        cp, variant, (300, 77, 130), (700, 77, 900), num_qo_heads=2 * group, num_kv_heads=2,
        head_dim=head_dim, dtype="bfloat16", page_size=16, seed=100 * group + head_dim,
        error_log=error_log, where=f"group {group} d{head_dim}", num_prefill_ctas=5)
    assert plan.prefill.num_work_items > 2 * 5


@pytest.mark.parametrize("sm_scale", [-0.2, 0.0, 0.3])
@pytest.mark.parametrize("variant_id", ["causal", "softcap", "flash_sigmoid", "t5_bias"])
def test_sm_scale_sign_and_zero(cp, error_log, sm_scale, variant_id):
    """The kernel folds |sm_scale| log2(e) into the exp2 and the sign into Q. T5's uniform
    tiles add the bias to the softmax's row offset (kUniformAdditive) only where sm_scale >= 0:
    a negative one takes the general path."""
    variant = attnlang.load(VARIANT_PATHS[variant_id])
    run_and_check(cp, variant, (150, 70), (400, 70), num_qo_heads=4, num_kv_heads=2,
                  head_dim=64, dtype="float16", page_size=16, seed=5, error_log=error_log,
                  where=f"sm_scale {sm_scale} {variant_id}", sm_scale=sm_scale)


@pytest.mark.parametrize("group, min_rows", [(1, PREFILL_MIN_ROWS), (4, 16)])
def test_threshold_dispatch(cp, error_log, group, min_rows):
    """qo_len * group == prefill_min_rows stays in decode; one more query goes to prefill."""
    variant = attnlang.load(VARIANT_PATHS["causal"])
    at = min_rows // group
    plan, _, _ = run_and_check(
        cp, variant, (at, at + 1), (300, 300), num_qo_heads=2 * group, num_kv_heads=2,
        prefill_min_rows=min_rows,
        head_dim=128, dtype="bfloat16", page_size=16, seed=9, error_log=error_log,
        where="threshold", expect_decode=True)
    assert set(plan.decode.work_request.tolist()) == {0}
    assert set(plan.prefill.work_request.tolist()) == {1}


@pytest.mark.parametrize("split", [None, 200])
def test_mixed_decode_and_prefill_batch(cp, error_log, split):
    """Decode requests (qo_len 1, and a few speculative tokens) and prefill requests in one
    plan: both kernels run, both may split, one merge serves them."""
    variant = attnlang.load(VARIANT_PATHS["gemma2_local"])
    qo = (1, 300, 3, 1, 90, 1)
    kv = (1700, 800, 40, 1, 90, 640)
    plan, _, _ = run_and_check(
        cp, variant, qo, kv, num_qo_heads=16, num_kv_heads=2, head_dim=128,
        dtype="bfloat16", page_size=16, seed=13, error_log=error_log,
        where=f"mixed split={split}", kv_chunk_size=split, expect_decode=True,
        prefill_min_rows=16)
    # qo_len * group > 16 fused rows go to prefill: 300*8, 3*8 (speculative tokens), 90*8
    assert set(plan.prefill.work_request.tolist()) == {1, 2, 4}
    if split is not None:
        assert plan.decode.num_split_requests > 0 and plan.prefill.num_split_requests > 0


@pytest.mark.parametrize("variant_id, dtype, head_dim, page_size", [
    ("causal", "bfloat16", 128, 16), ("t5_bias", "float16", 128, 64),
    ("sliding_window", "bfloat16", 64, 1), ("spec_tree", "float16", 128, 16)])
def test_levelled_prefill_list(cp, error_log, variant_id, dtype, head_dim, page_size):
    """The planner levels the prefill list (plan_balance): on 5 CTAs, 56 units of chunked
    prefill leave longest-first 2-10% uneven, so the last units are cut where each CTA's
    share ends (pieces starting and ending inside a unit's span, merged after)."""
    variant = attnlang.load(VARIANT_PATHS[variant_id])
    plan, _, _ = run_and_check(
        cp, variant, (512, 384), (3000, 2800), num_qo_heads=8, num_kv_heads=2,
        head_dim=head_dim, dtype=dtype, page_size=page_size, seed=29, error_log=error_log,
        where=f"levelled {variant_id}", num_prefill_ctas=5)
    assert plan.prefill.merge_count > 0, "the prefill list should be levelled"


# ---------------------------------------------------------------------------- runtime


def test_cuda_graph_replay_across_plans(cp):
    """Capture a decode-only plan; re-plan a mixed batch; the replay runs the prefill kernel
    too (every kernel is captured) and matches a plain run bit for bit."""
    from attnlang.runtime.paged import indptr_from_lengths

    variant = attnlang.load(VARIANT_PATHS["softcap"])
    dtype, hq, hkv, d, ps = "bfloat16", 8, 2, 128, 16
    rng = np.random.default_rng(31)
    kv = np.array([50, 700, 300])
    pool = make_batch(rng, np.zeros(3, int), kv, hq, hkv, d, ps, dtype)
    pages = [pool.kv_indices[pool.kv_indptr[i]:pool.kv_indptr[i + 1]] for i in range(3)]

    def table(requests, qo):
        page_lists = [pages[i] for i in requests]
        return (indptr_from_lengths(qo), indptr_from_lengths([len(p) for p in page_lists]),
                np.concatenate(page_lists), pool.kv_last_page_len[requests])

    qo_b = [1, 400, 300]
    table_a, table_b = table([0], [1]), table([0, 1, 2], qo_b)
    total_b = sum(qo_b)
    # Single-token decode in the decode kernel (by default a group of 4 decodes on tensor
    # cores, and the decode kernel would never be captured).
    attn = attnlang.BatchAttention(variant, hq, hkv, d, dtype, ps, max_batch_size=4,
                                   max_total_q=total_b, prefill_min_rows=16)
    kc, vc = to_device(cp, pool.k_cache, dtype), to_device(cp, pool.v_cache, dtype)
    q_buf = to_device(cp, np.asarray(rng.standard_normal((total_b, hq, d)), np.float32), dtype)
    out_buf = poisoned(cp, (total_b, hq, d), dtype)
    lse_buf = cp.zeros((total_b, hq), dtype=np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        assert attn.plan(*table_a).prefill.num_work_items == 0
        attn.run(q_buf[:1], (kc, vc), out=out_buf[:1], lse=lse_buf[:1])
        stream.synchronize()
        stream.begin_capture()
        attn.run(q_buf[:1], (kc, vc), out=out_buf[:1], lse=lse_buf[:1])
        graph = stream.end_capture()

        plan_b = attn.plan(*table_b)
        assert plan_b.prefill.num_work_items > 0 and plan_b.decode.num_work_items > 0
        out_buf.fill(0x7FC0)  # bf16 NaN bits
        graph.launch(stream)
        stream.synchronize()
        replayed = cp.asnumpy(out_buf).copy()
        replayed_lse = cp.asnumpy(lse_buf).copy()
        plain, plain_lse = attn.run(q_buf, (kc, vc), return_lse=True)
        stream.synchronize()
    assert not np.isnan(from_device(cp, cp.asarray(replayed), dtype)).any()
    assert np.array_equal(replayed.view(np.uint16), cp.asnumpy(plain).view(np.uint16))
    assert np.array_equal(replayed_lse, cp.asnumpy(plain_lse))


def test_prefill_is_deterministic(cp):
    variant = attnlang.load(VARIANT_PATHS["alibi"])
    rng = np.random.default_rng(17)
    qo, kv = np.array([400, 130]), np.array([1200, 130])
    batch = make_batch(rng, qo, kv, 8, 2, 128, 16, "bfloat16")
    params = make_params(variant, rng, qo, kv, 8, 2, 128)
    q, kc, vc = (to_device(cp, x, "bfloat16") for x in (batch.q, batch.k_cache, batch.v_cache))
    attn = attnlang.BatchAttention(variant, 8, 2, 128, "bf16", 16, max_batch_size=4,
                                   max_total_q=1024, max_work_items=1 << 14,
                                   max_partial_rows=1 << 16, max_merge_rows=1 << 15)
    first = attn.plan(*batch.table, kv_chunk_size=256)
    assert first.prefill.num_split_requests > 0
    out1, lse1 = attn.run(q, (kc, vc), params, return_lse=True)
    assert attn.plan(*batch.table, kv_chunk_size=256).same_as(first)
    out2, lse2 = attn.run(q, (kc, vc), params, return_lse=True)
    assert cp.array_equal(out1, out2) and cp.array_equal(lse1, lse2)


# ---------------------------------------------------------------------------- MLA head dims

# Queries and keys of 192, values and outputs of 128: MLA itself, and variants with a hook in
# every vector stage (dim tables and rope on the 192, value / output hooks on the 128), in the
# decode kernel (one query per request), the prefill kernel and split through the merge.
_MLA = [(v, d, mode, split) for n, (v, d) in enumerate(itertools.product(
            ("mla", "kitchen_sink", "qk_norm", "rope_norm_window", "t5_bias"),
            ("bfloat16", "float16")))
        for mode, split in (("decode", n % 2 == 0), ("prefill", n % 2 == 1))]


@pytest.mark.parametrize("variant_id, dtype, mode, split", _MLA,
                         ids=[f"{v}-{SHORT[d]}-{m}-{'split' if s else 'whole'}"
                              for v, d, m, s in _MLA])
def test_value_head_dim_128_with_192(cp, error_log, variant_id, dtype, mode, split):
    variant = attnlang.load(VARIANT_PATHS[variant_id])
    seed = zlib.crc32(f"{variant_id}{dtype}{mode}".encode())
    rng = np.random.default_rng(seed)
    if mode == "decode":
        kv = rng.integers(1, 1500, 5)
        qo = np.ones_like(kv)
    else:
        qo = np.array([rng.integers(150, 400), rng.integers(1, 40)])
        kv = qo + np.array([rng.integers(0, 600), rng.integers(0, 200)])
    run_and_check(cp, variant, qo, kv, num_qo_heads=8, num_kv_heads=2, head_dim=192,
                  head_dim_vo=128, dtype=dtype, page_size=16, seed=seed, error_log=error_log,
                  where=f"{mode} {variant_id} {SHORT[dtype]} d192/128",
                  kv_chunk_size=96 if split else None, expect_prefill=mode == "prefill",
                  prefill_min_rows=None if mode == "prefill" else 16)


def test_value_head_dim_through_the_c_path(cp):
    """Repeated run() calls of one signature take the C path (hostpath.c), which allocates
    out itself: 128 wide beside queries of 192, equal to the first call's."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    qo, kv = np.array([1, 1, 1]), np.array([300, 40, 900])
    batch = make_batch(rng, qo, kv, 8, 2, 192, 16, "bfloat16", head_dim_vo=128)
    attn = attnlang.BatchAttention(attnlang.load(VARIANT_PATHS["mla"]), 8, 2, 192,
                                   head_dim_vo=128, prefill_min_rows=16)
    attn.plan(*batch.table)
    q = torch.as_tensor(batch.q, device="cuda").to(torch.bfloat16)
    kc = torch.as_tensor(batch.k_cache, device="cuda").to(torch.bfloat16)
    vc = torch.as_tensor(batch.v_cache, device="cuda").to(torch.bfloat16)
    first = attn.run(q, (kc, vc))
    for _ in range(3):
        again = attn.run(q, (kc, vc))
        assert again.shape == (3, 8, 128) and torch.equal(again, first)
    assert attn._fast_runs or attn._hostpath is None, "the C path was not taken"


# ---------------------------------------------------------------------------- distance tables

# T5's bias and Sandwich's cosines are tabulated (attnlang.codegen.distance_terms,
# kernels_templates/distance_table.cuh) where a tile is not tile-uniform: per head for T5, so
# at 8 query heads per KV head its table does not fit the 736 floats of the mma.sync path and
# of the wgmma path at head dims 64 and 256 (8 x 80 distances), nor at 128 query heads per KV
# head the d128 wgmma path's 8,928 (128 x 129): those tiles compute the term per score (on
# the wgmma path in an instance of their own, TileTerms::per_score); at 2 it fits everywhere.
# Long prompts beside a decode step and a split request: every kind of tile.
@pytest.mark.parametrize("variant_id, group, head_dim", [
    ("t5_bias", 2, 128), ("t5_bias", 8, 128), ("sandwich", 8, 128), ("t5_bias", 8, 64),
    ("t5_bias", 8, 256), ("t5_bias", 2, 256)])
def test_distance_tables(cp, error_log, variant_id, group, head_dim):
    run_and_check(cp, attnlang.load(VARIANT_PATHS[variant_id]), [700, 1, 300], [900, 500, 300],
                  num_qo_heads=2 * group, num_kv_heads=2, head_dim=head_dim, dtype="bfloat16",
                  page_size=16, seed=zlib.crc32(f"{variant_id}{group}{head_dim}".encode()),
                  error_log=error_log, where=f"distance table {variant_id} g{group} d{head_dim}",
                  kv_chunk_size=256)


def test_distance_table_too_small_for_the_group(cp, error_log):
    run_and_check(cp, attnlang.load(VARIANT_PATHS["t5_bias"]), [300, 1, 40], [400, 200, 40],
                  num_qo_heads=128, num_kv_heads=1, head_dim=128, dtype="bfloat16",
                  page_size=16, seed=zlib.crc32(b"t5 g128"), error_log=error_log,
                  where="distance table t5_bias g128", kv_chunk_size=128)


# The table holds a run of tiles: T5's band (the last 2-3 tiles of a work item) fills it once,
# in items of 79 and 36 tiles (the uniform window's 32 apart); Sandwich's tiles, every one of
# them varying, fill the d128 wgmma path's 8,928 distances twice in the 79-tile item.
@pytest.mark.parametrize("variant_id, group", [("t5_bias", 4), ("sandwich", 1)])
def test_distance_table_runs(cp, error_log, variant_id, group):
    run_and_check(cp, attnlang.load(VARIANT_PATHS[variant_id]), [64, 200], [10000, 4500],
                  num_qo_heads=2 * group, num_kv_heads=2, head_dim=128, dtype="bfloat16",
                  page_size=16, seed=zlib.crc32(f"runs {variant_id}{group}".encode()),
                  error_log=error_log, where=f"distance table runs {variant_id} g{group}",
                  kv_chunk_size=16384)


# With a producer (Hopper) the table is filled for a work item's last varying tiles before
# its tile loop; a band of varying tiles before them (here 2048 keys behind the diagonal) is
# not in that table, fills it anew, and the last tiles then fill it again.
def test_distance_table_two_bands(cp, error_log):
    source = VARIANT_PATHS["t5_bias"].read_text().replace(
        "let distance = max(q_pos - kv_pos, 0)",
        "let distance = min(abs(q_pos - kv_pos), abs(q_pos - kv_pos - 2048))")
    assert "2048" in source
    run_and_check(cp, attnlang.parse(source), [64, 200], [5000, 3000], num_qo_heads=8,
                  num_kv_heads=2, head_dim=128, dtype="bfloat16", page_size=16,
                  seed=zlib.crc32(b"two bands"), error_log=error_log,
                  where="distance table two bands", kv_chunk_size=16384)


# ---------------------------------------------------------------------------- TMA tiles

# Pages of a multiple of 16 tokens (and one page per request: a contiguous cache) take the
# producer's TMA boxes for every tile inside its item, cp.async for the partial last one (and
# for items that start off a 16-key row: forced chunks of 100); the tails of the last pages
# hold the cache's poison (ragged_to_paged), which no output may see. Each case runs with
# TMA and without (ATTNLANG_PREFILL_TMA=0) on the same batch and seed. Key hooks rewrite a
# tile the copy engine wrote; T5's producer has 40 registers (232 for its computing threads).
_TMA = [("causal", "bfloat16", 128, 16, 4, None), ("causal", "float16", 128, 16, 1, 100),
        ("causal", "bfloat16", 128, 64, 4, None), ("softcap", "float16", 128, 128, 1, 320),
        ("alibi", "bfloat16", 256, 64, 8, None), ("kitchen_sink", "bfloat16", 128, 2048, 2, None),
        ("causal", "float16", 256, 2048, 1, 448), ("gptj_rope", "float16", 128, 64, 4, None),
        ("t5_bias", "bfloat16", 128, 64, 4, None)]


@pytest.mark.parametrize("variant_id, dtype, head_dim, page_size, group, chunk", _TMA,
                         ids=[f"{v}-{SHORT[d]}-d{hd}-p{p}-g{g}-{c or 'auto'}"
                              for v, d, hd, p, g, c in _TMA])
@pytest.mark.parametrize("tma", ["1", "0"])
def test_tma_tiles(cp, error_log, monkeypatch, tma, variant_id, dtype, head_dim, page_size,
                   group, chunk):
    monkeypatch.setenv("ATTNLANG_PREFILL_TMA", tma)
    variant = attnlang.load(VARIANT_PATHS[variant_id])
    qo, kv = np.array([700, 130, 1]), np.array([700 + 389, 130, 1900])
    run_and_check(cp, variant, qo, kv, num_qo_heads=2 * group, num_kv_heads=2,
                  head_dim=head_dim, dtype=dtype, page_size=page_size, seed=4200 + head_dim,
                  error_log=error_log, kv_chunk_size=chunk,
                  where=f"tma={tma} {variant_id} {SHORT[dtype]} d{head_dim} p{page_size} g{group}")


# kv_layout="ragged": k and v [total_kv, num_kv_heads, head_dim], request b's keys rows
# kv_indptr[b]:kv_indptr[b+1] (pages of one token to the kernels, the page table the identity,
# so the producer's TMA boxes start at any row): a prompt, a decode step (decode kernel), a
# short chunk, requests starting off 16-row boundaries; forced KV splits; head dims 128 (TMA
# tiles) and 64 (no producer) and 256.
_RAGGED = [("causal", "bfloat16", 128, 4, None), ("softcap", "float16", 128, 1, 300),
           ("alibi", "bfloat16", 64, 4, None), ("causal", "float16", 256, 2, 256),
           ("gptj_rope", "bfloat16", 128, 8, None)]


@pytest.mark.parametrize("variant_id, dtype, head_dim, group, chunk", _RAGGED,
                         ids=[f"{v}-{SHORT[d]}-d{h}-g{g}-{c or 'auto'}"
                              for v, d, h, g, c in _RAGGED])
def test_ragged_layout(cp, error_log, variant_id, dtype, head_dim, group, chunk):
    variant = attnlang.load(VARIANT_PATHS[variant_id])
    rng = np.random.default_rng(4300 + head_dim + group)
    qo, kv = np.array([700, 1, 130, 9]), np.array([1089, 1900, 130, 33])
    hq, hkv = 2 * group, 2
    q = round_to_dtype(rng.standard_normal((qo.sum(), hq, head_dim)).astype(np.float32), dtype)
    k = round_to_dtype(rng.standard_normal((kv.sum(), hkv, head_dim)).astype(np.float32), dtype)
    v = round_to_dtype(rng.standard_normal((kv.sum(), hkv, head_dim)).astype(np.float32), dtype)
    qo_indptr, kv_indptr = indptr_from_lengths(qo), indptr_from_lengths(kv)
    params = make_params(variant, rng, qo, kv, hq, hkv, head_dim)
    ref_o, ref_lse = attention(variant, q, k, v, qo_indptr, kv_indptr, params=params)
    extra = {} if chunk is None else dict(max_work_items=1 << 16, max_partial_rows=1 << 18,
                                          max_merge_rows=1 << 17)
    attn = attnlang.BatchAttention(variant, hq, hkv, head_dim, dtype=dtype, kv_layout="ragged",
                                   max_batch_size=4, max_total_q=int(qo.sum()),
                                   max_kv_indices=int(kv.sum()), **extra)
    plan = attn.plan(qo_indptr, kv_indptr, kv_chunk_size=chunk)
    assert plan.prefill.num_work_items > 0
    assert (plan.decode.num_work_items > 0) == (group <= PREFILL_MIN_ROWS)  # the decode step
    out = poisoned(cp, q.shape, dtype)
    got, lse = attn.run(to_device(cp, q, dtype), (to_device(cp, k, dtype), to_device(cp, v, dtype)),
                        params, out=out, return_lse=True)
    got_host = from_device(cp, got, dtype)
    assert not np.isnan(got_host).any(), "rows left unwritten (still NaN)"
    err = rel_l2(got_host, ref_o)
    error_log(dtype, err, f"ragged layout {variant_id} d{head_dim} g{group}")
    assert err <= TOLERANCE[dtype], f"relative L2 error {err:.2e}"
    check_lse(cp.asnumpy(lse), ref_lse, dtype)
