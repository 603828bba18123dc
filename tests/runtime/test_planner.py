"""The CPU planner (attnlang/runtime/planner.py): coverage, determinism, splitting, balance,
capacities and edge cases. No GPU needed."""

import numpy as np
import pytest

from attnlang.runtime import plan_assign
from attnlang.runtime.planner import (
    KV_COST,
    MIN_KV_CHUNK,
    ROW_COST,
    CapacityError,
    PlanBounds,
    PlanError,
    chunk_bound,
    plan_batch,
    worst_case_bounds,
)

GEOMETRY = dict(num_kv_heads=2, group_size=4, rows_per_tile=4, num_ctas=16)


def check_plan(plan, qo, kv):
    """Every (request, kv_head, fused row, kv position) is covered exactly once; the work
    arrays agree with INTERNALS.md; the merge arrays list each split row's partial slots in
    KV order, each slot exactly once, and no other rows."""
    qo, kv = np.asarray(qo), np.asarray(kv)
    g, r, hkv = plan.group_size, plan.rows_per_tile, plan.num_kv_heads
    for a in (*plan.work_arrays().values(), *plan.merge_arrays().values()):
        assert a.dtype == np.int32 and a.flags.c_contiguous and not a.flags.writeable
    assert plan.work_indptr.shape == (plan.num_ctas + 1,)
    assert plan.work_indptr[0] == 0 and plan.work_indptr[-1] == plan.num_work_items
    assert (np.diff(plan.work_indptr) >= 0).all()

    covered = {b: np.zeros((hkv, qo[b] * g, kv[b]), dtype=np.int32) for b in range(len(qo))}
    slot_owner = {}  # partial slot -> (request, kv_head, fused row, kv_start, kv_end)
    for w in range(plan.num_work_items):
        b, h = plan.work_request[w], plan.work_kv_head[w]
        row0, kv0, kv1 = plan.work_row_start[w], plan.work_kv_start[w], plan.work_kv_end[w]
        rows = min(r, qo[b] * g - row0)
        assert rows > 0 and row0 % r == 0
        assert 0 <= kv0 <= kv1 <= kv[b]
        covered[b][h, row0:row0 + rows, kv0:kv1] += 1
        if plan.work_partial[w] == -1:
            assert (kv0, kv1) == (0, kv[b]), "an output-writing item sees the whole KV"
        else:
            assert kv1 > kv0, "partial items are never empty"
            for i in range(rows):
                slot = int(plan.work_partial[w]) + i
                assert slot not in slot_owner
                slot_owner[slot] = (b, h, row0 + i, kv0, kv1)
    for b, c in covered.items():
        assert (c == 1).all(), f"request {b}: coverage counts {np.unique(c)}"
    assert sorted(slot_owner) == list(range(plan.num_partial_rows))

    # Merge rows: (token, head) of split requests, slots in KV order covering [0, kv_len).
    assert plan.merge_indptr.shape == (plan.merge_count + 1,)
    assert plan.merge_slots.shape == (plan.num_partial_rows,)
    assert sorted(plan.merge_slots.tolist()) == list(range(plan.num_partial_rows))
    qo_start = np.concatenate(([0], np.cumsum(qo)))
    seen = set()
    for m in range(plan.merge_count):
        b, t, head = plan.merge_request[m], plan.merge_token[m], plan.merge_head[m]
        i = t - qo_start[b]
        assert 0 <= i < qo[b]
        fused = i * g + head % g
        pos = 0
        slots = plan.merge_slots[plan.merge_indptr[m]:plan.merge_indptr[m + 1]]
        assert len(slots) >= 2
        for s in slots:
            sb, sh, srow, kv0, kv1 = slot_owner[int(s)]
            assert (sb, sh, srow) == (b, head // g, fused)
            assert kv0 == pos
            pos = kv1
        assert pos == kv[b]
        seen.add((int(t), int(head)))
    # Exactly the rows written in parts (all of a split request's, or a levelled list's cut
    # units').
    expected = {(int(qo_start[b] + row // g), int(h * g + row % g))
                for b, h, row, _, _ in slot_owner.values()}
    assert seen == expected


# -- coverage over many shapes


@pytest.mark.parametrize("seed", range(12))
def test_random_batches_are_covered_exactly_once(seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 7))
    kv = rng.integers(0, 900, batch)
    qo = np.minimum(rng.integers(0, 40, batch), kv)
    qo[rng.random(batch) < 0.3] = 1
    qo = np.minimum(qo, kv)
    geom = dict(num_kv_heads=int(rng.integers(1, 4)), group_size=int(rng.choice([1, 2, 4, 8])),
                rows_per_tile=int(rng.choice([1, 2, 4, 8, 16])),
                num_ctas=int(rng.integers(1, 40)))
    chunk = [None, int(rng.integers(1, 300))][seed % 2]
    plan = plan_batch(qo, kv, **geom, min_kv_chunk=int(rng.choice([16, 64, 256])),
                      kv_align=int(rng.choice([1, 8, 16])), kv_chunk_size=chunk)
    check_plan(plan, qo, kv)


def test_decode_batch_fills_ctas_by_splitting_long_requests():
    plan = plan_batch([1], [32768], num_kv_heads=8, group_size=4, rows_per_tile=4,
                      num_ctas=256, kv_align=32)
    check_plan(plan, [1], [32768])
    assert plan.kv_chunk_size == chunk_bound(8 * 32768, 256, kv_align=32)  # 1024
    assert plan.num_work_items == 256 and plan.merge_count == 32
    assert np.diff(plan.work_indptr).min() >= 1, "every CTA gets work"


def test_chunks_fit_one_round_when_the_even_share_leaves_a_few_over():
    # The even share of 8 x 32768 over 132 CTAs (2016) cuts each head into 17 chunks: 136
    # chunks, so 4 CTAs would run two (3856 positions). 16 chunks of 2048 fit one round.
    plan = plan_batch([1], [32768], num_kv_heads=8, group_size=4, rows_per_tile=4,
                      num_ctas=132, kv_align=32)
    check_plan(plan, [1], [32768])
    assert chunk_bound(8 * 32768, 132, kv_align=32) == 2016
    assert plan.kv_chunk_size == 2048 and plan.num_work_items == 128
    assert np.diff(plan.work_indptr).max() == 1
    # Not when a second round is cheap: a skewed batch keeps the even share.
    kv = [4000] + [100] * 130
    plan = plan_batch([1] * 131, kv, num_kv_heads=1, group_size=1, rows_per_tile=1,
                      num_ctas=132, kv_align=1)
    check_plan(plan, [1] * 131, kv)
    assert plan.kv_chunk_size == chunk_bound(sum(kv), 132, kv_align=1)


# -- determinism


def test_same_inputs_give_identical_arrays():
    rng = np.random.default_rng(1)
    kv = rng.integers(1, 5000, 64)
    qo = np.minimum(rng.integers(1, 20, 64), kv)
    a = plan_batch(qo, kv, **GEOMETRY)
    b = plan_batch(qo.tolist(), kv.tolist(), **GEOMETRY)
    c = plan_batch(qo.astype(np.int32), kv.astype(np.int16), **GEOMETRY)
    assert a.same_as(b) and a.same_as(c)
    for name, arr in a.work_arrays().items():
        assert np.array_equal(arr, b.work_arrays()[name])


def test_equal_cost_fast_path_matches_the_heap(monkeypatch):
    rng = np.random.default_rng(2)
    for trial in range(200):
        m = int(rng.integers(1, 30))
        n = int(rng.integers(0, 400))
        values = rng.choice([1, 2, 3, 50, 51, 400], n) if trial % 2 else rng.integers(1, 9, n)
        costs = np.ascontiguousarray(np.sort(values)[::-1]).astype(np.int64)
        monkeypatch.setattr(plan_assign, "RUN_MIN", int(rng.integers(2, 8)))
        fast = plan_assign.assign(costs, m)
        slow = (plan_assign.assign_heap(np.zeros(m, np.int64), costs) if n > m
                else np.arange(n))
        assert np.array_equal(fast, slow)


def test_ties_go_to_the_lowest_cta():
    plan = plan_batch([1] * 6, [100] * 6, num_kv_heads=1, group_size=1, rows_per_tile=1,
                      num_ctas=4)
    # Equal items: round robin from CTA 0, in creation order.
    assert plan.work_indptr.tolist() == [0, 2, 4, 5, 6]
    assert plan.work_request.tolist() == [0, 4, 1, 5, 2, 3]


# -- splitting


def test_short_requests_are_never_split():
    kv = [10, 200, MIN_KV_CHUNK, 3]
    plan = plan_batch([1, 1, 1, 1], kv, num_kv_heads=8, group_size=1, rows_per_tile=1,
                      num_ctas=1000)
    assert plan.kv_chunk_size == MIN_KV_CHUNK
    assert (plan.work_partial == -1).all() and plan.merge_count == 0
    check_plan(plan, [1, 1, 1, 1], kv)


def test_only_requests_longer_than_the_bound_split_and_all_their_units_alike():
    qo, kv = [1, 3, 1, 2], [5000, 300, 20000, 256]
    plan = plan_batch(qo, kv, num_kv_heads=4, group_size=2, rows_per_tile=2, num_ctas=64,
                      kv_align=16)
    check_plan(plan, qo, kv)
    bound = plan.kv_chunk_size
    assert bound % 16 == 0 and bound >= MIN_KV_CHUNK
    for b, length in enumerate(kv):
        items = np.flatnonzero(plan.work_request == b)
        split = (plan.work_partial[items] >= 0)
        assert split.all() == (length > bound) and split.any() == (length > bound)
        ranges = {(int(plan.work_kv_start[w]), int(plan.work_kv_end[w])) for w in items}
        lengths = [e - s for s, e in sorted(ranges)]  # in KV order
        assert max(lengths) <= max(bound, length if length <= bound else 0)
        if length > bound:
            # Equal aligned chunks, the last may be shorter; identical for every unit.
            assert len(set(lengths[:-1])) == 1 and lengths[0] % 16 == 0
            assert lengths[-1] <= lengths[0]
            per_unit = {}
            for w in items:
                key = (int(plan.work_kv_head[w]), int(plan.work_row_start[w]))
                per_unit.setdefault(key, set()).add((int(plan.work_kv_start[w]),
                                                     int(plan.work_kv_end[w])))
            assert len({frozenset(v) for v in per_unit.values()}) == 1


def test_chunk_override_forces_splits():
    plan = plan_batch([2, 1], [100, 7], num_kv_heads=1, group_size=2, rows_per_tile=4,
                      num_ctas=3, kv_chunk_size=30)
    check_plan(plan, [2, 1], [100, 7])
    assert plan.kv_chunk_size == 30
    first = plan.work_request == 0
    assert sorted((plan.work_kv_end - plan.work_kv_start)[first].tolist()) == [25] * 4
    assert plan.merge_count == 2 * 2 and plan.num_partial_rows == 4 * 4


# -- load balance


def _lower_bound(plan):
    costs = ROW_COST * np.minimum(
        np.asarray(plan.qo_lens)[plan.work_request] * plan.group_size - plan.work_row_start,
        plan.rows_per_tile) + KV_COST * (plan.work_kv_end - plan.work_kv_start)
    return max(costs.sum() / plan.num_ctas, costs.max()), costs.max()


@pytest.mark.parametrize("seed", range(4))
def test_skewed_batch_is_balanced(seed):
    rng = np.random.default_rng(seed)
    # One very long request among many short ones, plus a few medium ones.
    kv = np.concatenate(([65536], rng.integers(64, 1024, 60), rng.integers(4000, 9000, 3)))
    qo = np.ones_like(kv)
    plan = plan_batch(qo, kv, num_kv_heads=8, group_size=4, rows_per_tile=4, num_ctas=132,
                      kv_align=32)
    check_plan(plan, qo, kv)
    loads = plan.cta_costs()
    lower, biggest = _lower_bound(plan)
    assert loads.max() <= lower + biggest  # list scheduling's guarantee
    assert loads.max() <= 1.35 * lower  # LPT on chunks no longer than the mean load
    unsplit = plan_batch(qo, kv, num_kv_heads=8, group_size=4, rows_per_tile=4, num_ctas=132,
                         kv_chunk_size=1 << 30)
    assert unsplit.cta_costs().max() > 3 * loads.max()


def test_prefill_batch_is_balanced():
    qo = np.array([300, 17, 1, 128, 64])
    kv = np.array([2000, 17, 1500, 128, 900])
    plan = plan_batch(qo, kv, num_kv_heads=2, group_size=8, rows_per_tile=8, num_ctas=132,
                      kv_align=16)
    check_plan(plan, qo, kv)
    lower, _ = _lower_bound(plan)
    assert plan.cta_costs().max() <= 1.35 * lower


# -- capacities


def test_worst_case_bounds_hold_for_random_batches():
    geom = dict(num_kv_heads=4, group_size=4, rows_per_tile=4, num_ctas=37)
    bounds = worst_case_bounds(max_batch_size=32, max_total_q=256, **geom)
    rng = np.random.default_rng(5)
    for _ in range(200):
        batch = int(rng.integers(1, 33))
        kv = rng.integers(0, 20000, batch) * (rng.random(batch) < 0.8)
        share = rng.dirichlet(np.ones(batch)) * int(rng.integers(batch, 257))
        qo = np.minimum(np.floor(share).astype(int), kv)
        plan = plan_batch(qo, kv, **geom, min_kv_chunk=int(rng.choice([1, 64, 256])),
                          kv_align=int(rng.choice([1, 16])), bounds=bounds)
        assert plan.num_work_items <= bounds.max_work_items


@pytest.mark.parametrize("bound,value", [
    ("max_batch_size", 2), ("max_total_q", 5), ("max_work_items", 10),
    ("max_partial_rows", 3), ("max_merge_rows", 1),
])
def test_capacity_errors_name_the_bound(bound, value):
    qo, kv = [4, 1, 1], [5000, 4000, 30]
    with pytest.raises(CapacityError, match=bound) as e:
        plan_batch(qo, kv, num_kv_heads=2, group_size=2, rows_per_tile=2, num_ctas=8,
                   kv_chunk_size=500, bounds=PlanBounds(**{bound: value}))
    assert e.value.bound == bound and e.value.capacity == value and e.value.needed > value
    assert "BatchAttention" in str(e.value) and f"{bound}={e.value.needed}" in str(e.value)
    assert isinstance(e.value, ValueError)


# -- edge cases and input checks


def test_empty_requests_produce_no_work():
    qo, kv = [0, 1, 0, 0], [0, 10, 700, 5]
    plan = plan_batch(qo, kv, **GEOMETRY)
    check_plan(plan, qo, kv)
    assert set(plan.work_request.tolist()) == {1}
    assert plan.total_q == 1 and plan.batch_size == 4


def test_empty_batch():
    for qo, kv in (([], []), ([0, 0], [0, 0])):
        plan = plan_batch(qo, kv, **GEOMETRY)
        assert plan.num_work_items == 0 and plan.merge_count == 0
        assert plan.work_indptr.tolist() == [0] * (GEOMETRY["num_ctas"] + 1)
        assert plan.merge_indptr.tolist() == [0] and plan.num_partial_rows == 0


def test_zero_kv_unit_writes_the_output():
    # Not reachable through validation (qo_len <= kv_len) but the planner keeps the rule:
    # a unit with no KV is one unsplit item over the empty range, writing o = 0, lse = -inf.
    n_chunks = np.maximum(-(-np.array([0]) // 64), 1)
    assert n_chunks.tolist() == [1]
    plan = plan_batch([0, 2], [0, 2], **GEOMETRY)
    check_plan(plan, [0, 2], [0, 2])


@pytest.mark.parametrize("qo,kv,match", [
    ([1, -1], [3, 3], "qo_lens must be >= 0"),
    ([1, 1], [3, -2], "kv_lens must be >= 0"),
    ([5], [3], "qo_len must be\n?.*<= kv_len|only 3 KV positions"),
    ([1, 1], [3], "one entry per request"),
    ([[1]], [[1]], "1-D"),
    ([1.5], [3], "integers"),
])
def test_bad_lengths(qo, kv, match):
    with pytest.raises(PlanError, match=match):
        plan_batch(qo, kv, **GEOMETRY)


@pytest.mark.parametrize("arg", ["num_kv_heads", "group_size", "rows_per_tile", "num_ctas",
                                 "kv_chunk_size", "kv_align", "min_kv_chunk"])
def test_bad_geometry(arg):
    kwargs = dict(GEOMETRY, **{arg: 0})
    with pytest.raises(PlanError, match=arg):
        plan_batch([1], [1], **kwargs)


# -- the plan, executed by a NumPy emulation of the kernels' contract


def _emulate_kernels(plan, qo, kv, q, k, v, sm_scale):
    """Run a plan as docs/INTERNALS.md specifies the decode and merge kernels (causal
    softmax attention; partial o normalised, partial lse in log2 units)."""
    g, r = plan.group_size, plan.rows_per_tile
    qo_start = np.concatenate(([0], np.cumsum(qo)))
    kv_start = np.concatenate(([0], np.cumsum(kv)))
    out = np.full(q.shape, np.nan)
    lse = np.full(q.shape[:2], np.nan)
    part_o = np.full((plan.num_partial_rows, q.shape[2]), np.nan)
    part_lse = np.full(plan.num_partial_rows, np.nan)
    for w in range(plan.num_work_items):
        b, h = plan.work_request[w], plan.work_kv_head[w]
        row0, kv0, kv1 = plan.work_row_start[w], plan.work_kv_start[w], plan.work_kv_end[w]
        for row in range(row0, min(row0 + r, qo[b] * g)):
            i, member = divmod(row, g)
            token, head = qo_start[b] + i, h * g + member
            keys = np.arange(kv0, kv1)
            s = k[kv_start[b] + keys, h] @ q[token, head] * sm_scale
            s = np.where(keys <= kv[b] - qo[b] + i, s, -np.inf)  # causal
            if np.isneginf(s).all():
                o, lse_nat = np.zeros(q.shape[2]), -np.inf
            else:
                p = np.exp(s - s.max())
                o, lse_nat = p @ v[kv_start[b] + keys, h] / p.sum(), s.max() + np.log(p.sum())
            if plan.work_partial[w] < 0:
                out[token, head], lse[token, head] = o, lse_nat
            else:
                slot = plan.work_partial[w] + row - row0
                part_o[slot], part_lse[slot] = o, lse_nat / np.log(2)
    for m in range(plan.merge_count):
        slots = plan.merge_slots[plan.merge_indptr[m]:plan.merge_indptr[m + 1]]
        l2 = part_lse[slots]
        top = l2.max()
        token, head = plan.merge_token[m], plan.merge_head[m]
        if np.isneginf(top):
            out[token, head], lse[token, head] = 0.0, -np.inf
            continue
        weight = 2.0 ** (l2 - top)
        out[token, head] = weight @ part_o[slots] / weight.sum()
        lse[token, head] = (top + np.log2(weight.sum())) * np.log(2)
    return out, lse


def _causal_attention(qo, kv, q, k, v, g, sm_scale):
    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:2])
    qs, ks = np.concatenate(([0], np.cumsum(qo))), np.concatenate(([0], np.cumsum(kv)))
    for b in range(len(qo)):
        for i in range(qo[b]):
            for head in range(q.shape[1]):
                s = k[ks[b]:ks[b + 1], head // g] @ q[qs[b] + i, head] * sm_scale
                s[np.arange(kv[b]) > kv[b] - qo[b] + i] = -np.inf
                p = np.exp(s - s.max())
                out[qs[b] + i, head] = p @ v[ks[b]:ks[b + 1], head // g] / p.sum()
                lse[qs[b] + i, head] = s.max() + np.log(p.sum())
    return out, lse


def check_executed(plan, qo, kv, seed, d=8):
    """The plan run as specified (`_emulate_kernels`, causal softmax attention) on random
    inputs equals causal attention computed directly."""
    rng = np.random.default_rng(seed)
    hkv, g = plan.num_kv_heads, plan.group_size
    q = rng.standard_normal((qo.sum(), hkv * g, d))
    k = rng.standard_normal((kv.sum(), hkv, d))
    v = rng.standard_normal((kv.sum(), hkv, d))
    got, got_lse = _emulate_kernels(plan, qo, kv, q, k, v, 0.3)
    ref, ref_lse = _causal_attention(qo, kv, q, k, v, g, 0.3)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got_lse, ref_lse, rtol=1e-10)


@pytest.mark.parametrize("chunk", [None, 7, 50])
def test_plan_executed_as_specified_reproduces_attention(chunk):
    qo, kv = np.array([1, 5, 0, 3, 1]), np.array([300, 40, 9, 3, 1])
    plan = plan_batch(qo, kv, num_kv_heads=2, group_size=3, rows_per_tile=4, num_ctas=5,
                      min_kv_chunk=16, kv_chunk_size=chunk)
    assert (plan.merge_count > 0) == (chunk is not None or plan.kv_chunk_size < 300)
    check_executed(plan, qo, kv, seed=9)
