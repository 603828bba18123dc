"""Shared-prefix cascades through BatchAttention(cascade=True), against the NumPy reference.

Batches whose page lists begin with the same pages (nested: a group inside a group shares
more), planned as cascades: the shared levels in the cascade kernel (wgmma with its producer
on the H100 at head dims 128 and 256, without one at 64, mma.sync elsewhere), each request's
own positions in the decode or prefill kernel, every row merged. Variants that read
positions everywhere (rope on q and k, ALiBi, windows, T5's tables, per-pair masks, batch
tables, softmax off, an output hook), decode steps and chunked prompts, dtypes, head dims,
page sizes, GQA groups, an fp8 cache; CUDA-graph replay across plans with and without a
cascade; the errors.

Tolerance: the output dtype's (LANGUAGE.md section 7), as the other GPU tests.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnlang
from attnlang.reference import attention_paged
from attnlang.runtime.planner import PlanError
from tests.runtime.test_gpu_attention import (
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
from tests.runtime.test_gpu_fp8 import quantize

pytestmark = pytest.mark.gpu


def share_pages(batch, shared: tuple[tuple[int, int, int], ...]):
    """Requests [first, end) of each (first, end, pages) begin with the first request's first
    `pages` page ids (a shared prompt: the same cache memory)."""
    idx, ptr = batch.kv_indices.copy(), batch.kv_indptr
    for first, end, pages in shared:
        assert (np.diff(ptr)[first:end] >= pages).all(), "a request shorter than its prefix"
        for b in range(first + 1, end):
            idx[ptr[b]:ptr[b] + pages] = idx[ptr[first]:ptr[first] + pages]
    batch.kv_indices = idx
    return batch


def run_cascade(cp, variant_id, qo, kv, shared, *, num_qo_heads=8, num_kv_heads=2,
                head_dim=128, dtype="bfloat16", page_size=16, seed=0, error_log=None,
                where="", kv_dtype=None, head_dim_vo=None, cascade=None, attn=None):
    """Plan the batch as a cascade (levels found in the page table unless `cascade` names
    them), run it, compare with the reference; returns (attn, plan). variant_id: a zoo id or
    a parsed variant."""
    rng = np.random.default_rng(seed)
    variant = (attnlang.load(VARIANT_PATHS[variant_id]) if isinstance(variant_id, str)
               else variant_id)
    qo, kv = np.asarray(qo), np.asarray(kv)
    batch = share_pages(make_batch(rng, qo, kv, num_qo_heads, num_kv_heads, head_dim,
                                   page_size, dtype, head_dim_vo), shared)
    k_seen, v_seen = batch.k_cache, batch.v_cache
    if kv_dtype == "fp8":
        (k_bits, k_seen, k_scale), (v_bits, v_seen, v_scale) = quantize(rng, batch,
                                                                        num_kv_heads)
    params = make_params(variant, rng, qo, kv, num_qo_heads, num_kv_heads, head_dim,
                         head_dim_vo)
    ref_o, ref_lse = attention_paged(variant, batch.q, k_seen, v_seen, *batch.table,
                                     params=params)
    if attn is None:
        attn = attnlang.BatchAttention(
            variant, num_qo_heads, num_kv_heads, head_dim, dtype=dtype, page_size=page_size,
            head_dim_vo=head_dim_vo, kv_dtype=kv_dtype, cascade=True,
            max_batch_size=max(4, len(qo)), max_total_q=int(qo.sum()),
            max_kv_indices=max(1 << 12, len(batch.kv_indices)))
    plan_params, params = split_params(variant, params)
    if cascade is None:  # the levels the test built, whatever their size
        cascade = [(f, e, min(p * page_size, *kv[f:e])) for f, e, p in shared]
    plan = attn.plan(*batch.table, params=plan_params, cascade=cascade)
    assert plan.cascade is not None and plan.cascade.num_work_items > 0
    q = to_device(cp, batch.q, dtype)
    if kv_dtype == "fp8":
        kc, vc = cp.asarray(k_bits), cp.asarray(v_bits)
        scales = dict(k_scale=cp.asarray(k_scale), v_scale=cp.asarray(v_scale))
    else:
        kc, vc = to_device(cp, batch.k_cache, dtype), to_device(cp, batch.v_cache, dtype)
        scales = {}
    out = poisoned(cp, batch.q.shape[:2] + (vc.shape[3],), dtype)
    got, lse = attn.run(q, (kc, vc), params, out=out, return_lse=True, **scales)
    got_host = from_device(cp, got, dtype)
    assert not np.isnan(got_host).any(), "rows left unwritten (still NaN)"
    err = rel_l2(got_host, ref_o)
    if error_log is not None:
        error_log(dtype, err, where)
    assert err <= TOLERANCE[dtype], f"relative L2 error {err:.2e}"
    if variant.softmax:
        check_lse(cp.asnumpy(lse), ref_lse, dtype)
    return attn, plan


# Decode steps of 12 requests: 0..7 share 40 pages, 0..3 of them 24 more; one alone.
_DECODE = ((1,) * 12, (1100, 1400, 1500, 1700, 900, 1000, 700, 800, 1300, 60, 650, 2),
           ((0, 8, 40), (0, 4, 64)))
# Chunked prompts and decode steps mixed: 0..4 share 30 pages; the group's prompts are
# prefill requests of their own.
_MIXED = ((1, 37, 1, 120, 5, 9), (700, 800, 480, 1000, 900, 300), ((0, 5, 30),))

# (variant, dtype, head_dim, page_size, group, shape)
_CASES = [
    ("causal", "bfloat16", 128, 16, 4, "decode"),
    ("causal", "float16", 128, 16, 1, "mixed"),
    ("gptj_rope", "bfloat16", 128, 16, 4, "mixed"),
    ("alibi", "float16", 64, 16, 8, "decode"),
    ("sliding_window", "bfloat16", 256, 16, 4, "mixed"),
    ("softcap", "bfloat16", 128, 1, 4, "decode"),
    ("t5_bias", "bfloat16", 128, 16, 4, "mixed"),
    ("spec_tree", "bfloat16", 128, 16, 4, "mixed"),
    ("longformer", "float16", 128, 64, 4, "decode"),
    ("gelu_attention", "bfloat16", 128, 16, 4, "decode"),
    ("qk_norm", "bfloat16", 64, 16, 1, "mixed"),
    ("streaming_llm", "float16", 128, 16, 8, "mixed"),
    ("kitchen_sink", "bfloat16", 128, 16, 4, "mixed"),
]


def _shape(mode: str, page_size: int):
    qo, kv, shared = _DECODE if mode == "decode" else _MIXED
    # Page counts are in 16-token pages: keep the shared token counts at other sizes.
    return qo, kv, tuple((f, e, p * 16 // page_size) for f, e, p in shared)


@pytest.mark.parametrize("case", _CASES, ids=["-".join(map(str, c)) for c in _CASES])
def test_cascade_matches_reference(cp, case, error_log):
    variant_id, dtype, head_dim, page_size, group, mode = case
    if variant_id not in VARIANT_PATHS:
        pytest.skip(f"{variant_id} is not in the zoo")
    qo, kv, shared = _shape(mode, page_size)
    run_cascade(cp, variant_id, qo, kv, shared, num_qo_heads=2 * group, num_kv_heads=2,
                head_dim=head_dim, dtype=dtype, page_size=page_size, seed=len(case),
                error_log=error_log, where=f"cascade {'-'.join(map(str, case))}")


def test_cascade_default_capacities_hold_a_full_batch(cp, error_log):
    # Every row of a grouped request merges: max_total_q prompt tokens in one group must fit
    # the default workspace (max_total_q x heads merge rows).
    qo, kv = (64, 64, 64, 64), (900, 800, 950, 700)
    run_cascade(cp, "causal", qo, kv, ((0, 4, 40),), error_log=error_log,
                where="cascade full batch")


def test_cascade_fp8_cache(cp, error_log):
    qo, kv, shared = _shape("decode", 16)
    run_cascade(cp, "gptj_rope", qo, kv, shared, kv_dtype="fp8", error_log=error_log,
                where="cascade fp8 gptj_rope")


def test_cascade_found_automatically(cp, error_log):
    """plan()'s default on a cascade BatchAttention finds the shared runs in the page table
    (those past CASCADE_MIN_KV positions), nested levels included."""
    qo, kv, shared = _shape("decode", 16)
    _, plan = run_cascade(cp, "causal", qo, kv, shared, cascade="auto", error_log=error_log,
                          where="cascade auto")
    g = plan.cascade_groups
    assert [(int(f), int(e), int(a), int(b)) for f, e, a, b in
            zip(g.first, g.end, g.kv_from, g.kv_to, strict=True)] == [
        (0, 8, 0, 640), (0, 4, 640, 1024)]


def test_cascade_graph_replays_new_plans(cp):
    """A graph captured after a cascade plan replays later plans with other levels, and
    without any (the cascade kernel then has no items)."""
    rng = np.random.default_rng(7)
    variant = attnlang.load(VARIANT_PATHS["gptj_rope"])
    qo, kv = np.ones(10, dtype=np.int64), np.array([900, 1000, 950, 1200, 700, 800, 30, 500,
                                                    640, 650])
    batch = make_batch(rng, qo, kv, 8, 2, 128, 16, "bfloat16")
    attn = attnlang.BatchAttention(variant, 8, 2, 128, page_size=16, cascade=True,
                                   max_batch_size=16, max_total_q=16)
    q = to_device(cp, batch.q, "bfloat16")
    kc, vc = to_device(cp, batch.k_cache, "bfloat16"), to_device(cp, batch.v_cache, "bfloat16")
    out = poisoned(cp, batch.q.shape[:2] + (128,), "bfloat16")
    lse = cp.empty(batch.q.shape[:2], dtype=cp.float32)
    tables = []
    for shared in (((0, 6, 40),), ((7, 10, 30), (0, 4, 40), (0, 2, 50)), ()):
        t = share_pages(make_batch(np.random.default_rng(7), qo, kv, 8, 2, 128, 16,
                                   "bfloat16"), shared)
        tables.append((t, shared))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        first, shared = tables[0]
        attn.plan(*first.table, cascade=[(f, e, p * 16) for f, e, p in shared])
        attn.run(q, (kc, vc), out=out, lse=lse)  # first call: loads, validation
        stream.synchronize()
        stream.begin_capture()
        attn.run(q, (kc, vc), out=out, lse=lse)
        graph = stream.end_capture()
        for t, shared in tables:
            plan = attn.plan(*t.table, cascade=[(f, e, p * 16) for f, e, p in shared] or False)
            assert (plan.cascade is not None) == bool(shared)
            out.fill(0x7FC0)
            graph.launch(stream)
            stream.synchronize()
            ref_o, _ = attention_paged(variant, t.q, t.k_cache, t.v_cache, *t.table)
            got = from_device(cp, out, "bfloat16")
            assert not np.isnan(got).any(), f"{shared}: rows left unwritten"
            err = rel_l2(got, ref_o)
            assert err <= TOLERANCE["bfloat16"], f"{shared}: relative L2 error {err:.2e}"


def test_cascade_errors(cp):
    variant = attnlang.load(VARIANT_PATHS["causal"])
    rng = np.random.default_rng(3)
    qo, kv = np.ones(4, dtype=np.int64), np.array([300, 320, 340, 20])
    batch = share_pages(make_batch(rng, qo, kv, 8, 2, 128, 16, "bfloat16"), ((0, 3, 10),))
    plain = attnlang.BatchAttention(variant, 8, 2, 128, page_size=16, max_batch_size=8)
    with pytest.raises(ValueError, match="cascade=True"):
        plain.plan(*batch.table, cascade=True)
    assert plain.plan(*batch.table).cascade is None  # no cascade kernel: none by default
    attn = attnlang.BatchAttention(variant, 8, 2, 128, page_size=16, max_batch_size=8,
                                   cascade=True)
    with pytest.raises(PlanError, match="share 160 KV positions"):
        attn.plan(*batch.table, cascade=[(0, 3, 200)])  # more than the pages they share
    with pytest.raises(PlanError, match="share 0 KV positions"):
        attn.plan(*batch.table, cascade=[(2, 4, 16)])
    with pytest.raises(ValueError, match="'auto'"):
        attn.plan(*batch.table, cascade="yes")
    assert attn.plan(*batch.table, cascade=False).cascade is None
