"""The planner's levelling step (attnlang/runtime/plan_balance.py, plan_batch's compute_bound and
plan_mixed's prefill list): levelled plans still cover every (row, key) exactly once and merge
their cut rows in KV order, finish sooner than longest-first assignment by the cost model,
cut at most num_ctas - 1 units at kernel tile boundaries, stay within the capacities, and
leave alone what they should (narrow decode units, balanced lists, forced chunk sizes). No
GPU."""

import numpy as np
import pytest

import attnlang as al
from attnlang.runtime import plan_balance, plan_trim
from attnlang.runtime.plan_mixed import Tiling, plan_mixed
from attnlang.runtime.planner import (
    LEVEL_MIN_ROWS,
    MERGE_LAUNCH_COST,
    PlanBounds,
    plan_batch,
)
from tests.codegen.test_mask_tiles import VARIANTS
from tests.runtime.test_plan_trim import (
    GROUP,
    HEAD_DIM,
    MASKED,
    NUM_KV_HEADS,
    _params,
    _visible,
    check_trimmed,
)
from tests.runtime.test_planner import check_executed, check_plan

# 16 units of 128 fused rows per (request, KV head); 2 x 2 x 16 = 64 units on 6 CTAs is
# 10.67 units a CTA: longest-first gives some CTAs 11, 3% over the mean.
WIDE = dict(num_kv_heads=2, group_size=4, rows_per_tile=128, num_ctas=6, kv_align=64)


def _makespan(plan) -> int:
    return int(plan.cta_costs().max())


def _items(plan, c):
    w = range(plan.work_indptr[c], plan.work_indptr[c + 1])
    return [tuple(int(a[i]) for a in (plan.work_request, plan.work_kv_head,
                                      plan.work_row_start, plan.work_kv_start, plan.work_kv_end,
                                      plan.work_partial)) for i in w]


def _same_items(a, b) -> bool:
    """The same items on the same CTAs (in any order within a CTA)."""
    return (np.array_equal(a.work_indptr, b.work_indptr) and a.merge_count == b.merge_count
            and all(sorted(_items(a, c)) == sorted(_items(b, c)) for c in range(a.num_ctas)))


def _cut_units(plan) -> int:
    keys = {(int(b), int(h), int(r)) for b, h, r, p in zip(
        plan.work_request, plan.work_kv_head, plan.work_row_start, plan.work_partial,
        strict=True) if p >= 0}
    return len(keys)


@pytest.mark.parametrize("kv", [4096, 8000])
def test_equal_units_are_levelled(kv):
    qo, kvs = [512, 512], [kv, kv]
    plain = plan_batch(qo, kvs, **WIDE)
    levelled = plan_batch(qo, kvs, **WIDE, compute_bound=True)
    check_plan(levelled, qo, kvs)
    assert plain.merge_count == 0 and levelled.merge_count > 0
    mean = plain.cta_costs().sum() / WIDE["num_ctas"]
    assert _makespan(plain) > 1.03 * mean
    # Levelled: the mean plus each CTA's second fixed cost and a tile of rounding.
    assert _makespan(levelled) <= mean + 2 * 2 * 128 + 64
    assert _cut_units(levelled) <= WIDE["num_ctas"] - 1
    starts = levelled.work_kv_start[levelled.work_kv_start > 0]
    ends = levelled.work_kv_end[levelled.work_kv_end < kv]
    assert (starts % 64 == 0).all() and (ends % 64 == 0).all(), "cuts off the kernel's tiles"
    again = plan_batch(qo, kvs, **WIDE, compute_bound=True)
    assert again.same_as(levelled)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches_levelled_cover_exactly_once(seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 5))
    kv = rng.integers(300, 3000, batch)
    qo = np.minimum(rng.integers(128, 600, batch) // 128 * 128 + 128, kv)
    geom = dict(num_kv_heads=int(rng.integers(1, 4)), group_size=int(rng.choice([1, 2, 4])),
                rows_per_tile=128, num_ctas=int(rng.integers(2, 12)),
                kv_align=int(rng.choice([16, 64, 128])))
    plain = plan_batch(qo, kv, **geom)
    levelled = plan_batch(qo, kv, **geom, compute_bound=True)
    check_plan(levelled, qo, kv)
    if levelled.merge_count:  # taken only where the model says it is sooner, merge and all
        assert _makespan(levelled) + MERGE_LAUNCH_COST < _makespan(plain)
        assert _cut_units(levelled) <= geom["num_ctas"] - 1
    else:
        assert _same_items(levelled, plain)


def test_levelled_plan_executed_as_specified_reproduces_attention():
    qo, kv = np.array([256, 256]), np.array([2048, 1900])
    plan = plan_batch(qo, kv, num_kv_heads=2, group_size=4, rows_per_tile=128, num_ctas=5,
                      kv_align=64, compute_bound=True)
    assert plan.merge_count > 0, "the batch should be levelled"
    check_executed(plan, qo, kv, seed=3)


MASKS = {"causal": "mask = causal",
         "window": "const window: int = 2000\nmask = causal and q_pos - kv_pos < window",
         "full": ""}


@pytest.mark.parametrize("name", list(MASKS))
def test_masked_units_levelled_by_their_visible_tiles(name):
    """With a mask the costs and cuts follow the trimmed spans' visible tiles; every visible
    pair stays covered once (plan_mixed's prefill list levels by itself)."""
    v = al.parse(f"variant {name}\n{MASKS[name]}")
    qo, kv = np.array([256, 256]), np.array([4000, 3900])  # chunked prefill: equal-ish units
    plan = plan_mixed(qo, kv, num_kv_heads=2, group_size=4, decode=Tiling(4, 7, 32),
                      prefill=Tiling(128, 7, 64), mask=v.mask, head_dim=64)
    if v.mask is None:
        visible = [np.ones((2, q * 4, k), bool) for q, k in zip(qo, kv, strict=True)]
    else:
        visible = [_visible(v, b, int(qo[b]), int(kv[b]), {}) for b in range(2)]
    check_trimmed(plan, qo, kv, visible)
    assert plan.prefill.merge_count > 0, "the batch should be levelled"


def test_capacities_decline_levelling_rather_than_fail():
    qo, kv = [512, 512], [8000, 8000]
    plain = plan_batch(qo, kv, **WIDE)
    for bounds in (PlanBounds(max_partial_rows=100), PlanBounds(max_merge_rows=100),
                   PlanBounds(max_work_items=plain.num_work_items)):
        assert _same_items(plan_batch(qo, kv, **WIDE, compute_bound=True, bounds=bounds), plain)


def test_what_is_not_levelled():
    # Narrow units (decode batches in the prefill kernel: 4 fused rows each) stream KV from
    # HBM: never cut.
    qo, kv = [1] * 40, [4096] * 40
    narrow = dict(WIDE, rows_per_tile=4)
    assert 4 < LEVEL_MIN_ROWS
    assert _same_items(plan_batch(qo, kv, **narrow, compute_bound=True),
                       plan_batch(qo, kv, **narrow))
    # A forced chunk size is used as given.
    qo, kv = [512, 512], [8000, 8000]
    forced = plan_batch(qo, kv, **WIDE, kv_chunk_size=1 << 20)
    assert _same_items(plan_batch(qo, kv, **WIDE, kv_chunk_size=1 << 20, compute_bound=True),
                       forced)
    # Balanced already (a multiple of the CTAs): nothing to gain.
    even = dict(WIDE, num_ctas=8)
    assert plan_batch(qo, kv, **even, compute_bound=True).merge_count == 0
    # Too short for the merge to pay (its launch outweighs a 3% tail of short units).
    qo, kv = [512, 512], [512, 512]
    assert plan_batch(qo, kv, **WIDE, compute_bound=True).merge_count == 0


def test_level_tail_never_cuts_more_than_it_gains():
    """Direct: the cost model's makespan of the levelled items, merge included, beats
    longest-first by GAIN of the mean, or level_tail declines."""
    from attnlang.runtime.plan_assign import longest_first

    rng = np.random.default_rng(0)
    for _ in range(30):
        n, m = int(rng.integers(10, 300)), int(rng.integers(2, 40))
        span1 = rng.integers(1, 40, n) * 64
        fixed = np.full(n, 256)
        cost = fixed + span1
        units = plan_balance.Units(cost=cost, fixed=fixed, partial=np.full(n, 2.0),
                                   span0=np.zeros(n, np.int64), span1=span1,
                                   visible=lambda u, a, b: b - a,
                                   kv_at=lambda u, a, x: a + -(-x // 64) * 64)
        lpt = longest_first(cost, m)
        out = plan_balance.level_tail(units, lpt, m, 100.0)
        plain = np.bincount(lpt[1], weights=cost[lpt[0]], minlength=m).max()
        if out is None:
            continue
        pieces = np.bincount(out.unit, minlength=n)
        assert (pieces >= 1).all() and (pieces > 1).sum() <= m - 1
        for x in range(n):  # each unit's pieces tile its span in KV order
            mine = np.flatnonzero(out.unit == x)
            assert out.kv0[mine[0]] == 0 and out.kv1[mine[-1]] == span1[x]
            assert (out.kv0[mine[1:]] == out.kv1[mine[:-1]]).all()
        load = np.bincount(out.cta, weights=fixed[out.unit] + out.kv1 - out.kv0, minlength=m)
        merge = 100.0 + 2.0 * (pieces[out.unit] > 1).sum()
        assert load.max() + merge <= plain - plan_balance.GAIN * cost.sum() / m + 1e-6
        ranks = np.sort(out.rank)
        assert (ranks == np.arange(out.unit.shape[0])).all()


def test_trim_kv_at_inverts_visible_between():
    from attnlang.runtime.plan_units import work_units

    v = al.parse(f"variant w\n{MASKS['window']}")

    qo, kv = np.array([300, 50]), np.array([3000, 2000])
    u = work_units(qo, 4, 128, 2)
    trim = plan_trim.trim(v.mask, qo, kv, u, 4, 2, 64, 64)
    rng = np.random.default_rng(1)
    for x in range(u.req.shape[0]):
        a0, a1 = int(trim.span0[x]), int(trim.span1[x])
        total = int(trim.visible_between(np.array([x]), np.array([a0]), np.array([a1]))[0])
        for amount in rng.integers(1, max(total, 1) + 1, 5):
            at = int(trim.kv_at(np.array([x]), np.array([a0]), np.array([amount]))[0])
            assert at % trim.tile == 0 or at >= a1
            got = trim.visible_between(np.array([x]), np.array([a0]), np.array([at]))[0]
            assert got >= min(amount, total)
            before = trim.visible_between(np.array([x]), np.array([a0]),
                                          np.array([at - trim.tile]))[0]
            assert at - trim.tile <= a0 or before < amount


def test_many_groups_run_group_by_group():
    """With at least num_ctas / 3 (request, KV head) groups each CTA runs its items in
    creation order, so the CTAs walk the groups together (K/V shared in L2); with fewer,
    longest first (a round of similar items, several per group)."""
    qo, kv = [256] * 8, [1024 + 128 * i for i in range(8)]  # 16 groups (8 x 2 KV heads)
    for num_ctas, by_group in ((6, True), (48, True), (64, False)):  # 6: levelled too
        geom = dict(WIDE, num_ctas=num_ctas)
        plan = plan_batch(qo, kv, **geom, compute_bound=True)
        check_plan(plan, qo, kv)
        plain = plan_batch(qo, kv, **geom)
        for c in range(num_ctas):
            mine = _items(plan, c)
            assert sorted(mine) == sorted(_items(plain, c)) or plan.merge_count
            if by_group:
                assert mine == sorted(mine), f"CTA {c} not in creation order"
            else:
                assert mine == _items(plain, c), f"CTA {c} not longest first"


def test_levelled_masked_plans_cover_every_visible_pair():
    """Every masked variant of the mask-analysis tests, on random chunked-prefill batches
    whose units cost nearly the same, so that plan_mixed's prefill list is levelled where the
    mask leaves the units long enough (windows of 128 keys leave them too short for the
    merge to pay): each visible pair covered once, each row written once (directly or by one
    merge in KV order)."""
    levelled = set()
    for name in MASKED:
        v = VARIANTS[name]
        for seed in range(4):
            rng = np.random.default_rng(seed)
            n = int(rng.integers(2, 4))
            qo = rng.integers(2, 5, n) * 32  # 2-4 units of 128 fused rows per KV head
            kv = qo + rng.integers(2500, 4000, n)
            params = _params(v, rng, n)
            visible = [_visible(v, b, int(qo[b]), int(kv[b]), params) for b in range(n)]
            plan = plan_mixed(qo, kv, num_kv_heads=NUM_KV_HEADS, group_size=GROUP,
                              decode=Tiling(4, 5, 32),
                              prefill=Tiling(128, int(rng.integers(3, 6)), 64),
                              mask=v.mask, head_dim=HEAD_DIM)
            check_trimmed(plan, qo, kv, visible)
            if plan.prefill.merge_count:
                levelled.add(name)
    assert len(levelled) >= 3 * len(MASKED) // 4, sorted(set(MASKED) - levelled)
