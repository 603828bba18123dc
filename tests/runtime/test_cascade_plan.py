"""Shared-prefix cascades on the CPU: finding the levels in a page table, checking given ones,
and the plan (`attnlang.runtime.cascade`).

The plan's contract is checked by coverage: every (token, head) row of the batch must see
each of its request's KV positions exactly once across the items whose partial states its
merge row lists (cascade items through their group's rows, the rest through their own), and
a row that is not merged must come from one unsplit item covering all of them.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from attnlang.runtime.cascade import (
    _groups,
    adjacent_shared,
    choose_groups,
    explicit_groups,
    find_groups,
    plan_cascade,
    worst_case_cascade_bounds,
)
from attnlang.runtime.plan_mixed import Tiling
from attnlang.runtime.planner import CapacityError, PlanBounds, PlanError

DECODE, PREFILL = Tiling(4, 16, 32), Tiling(64, 8, 64)


def table(page_lists, kv_lens, page_size):
    indptr = np.concatenate(([0], np.cumsum([len(p) for p in page_lists]))).astype(np.int32)
    return indptr, np.concatenate(page_lists).astype(np.int32), np.asarray(kv_lens)


def groups_of(g):
    return [tuple(int(x) for x in row) for row in zip(g.first, g.end, g.kv_from, g.kv_to,
                                                      strict=True)]


def test_adjacent_shared_counts_leading_equal_pages():
    pages = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 2, 9], [1, 2, 9, 12], [5]]
    indptr, idx, kv = table(pages, [64, 60, 40, 50, 3], 16)
    # 3 pages; 2 pages; 3 pages but the shorter request ends at 40; nothing.
    assert adjacent_shared(indptr, idx, kv, 16).tolist() == [48, 32, 40, 0]
    assert adjacent_shared(indptr[:2], idx[:4], kv[:1], 16).tolist() == []


def test_find_groups_nests_levels_and_skips_small_ones():
    lcp = np.array([1000, 1000, 300, 300, 0, 500, 0])  # requests 0..4 / 0..2 / 5..6
    assert groups_of(find_groups(lcp, min_shared_kv=256)) == [
        (0, 5, 0, 300), (0, 3, 300, 1000), (5, 7, 0, 500)]
    # A level too small to pay is left out; the one inside it starts from its parent's end.
    assert groups_of(find_groups(lcp, min_shared_kv=400)) == [(0, 3, 0, 1000), (5, 7, 0, 500)]
    assert find_groups(np.zeros(5, dtype=np.int64)).count == 0
    assert find_groups(np.zeros(0, dtype=np.int64)).count == 0


def test_explicit_groups_are_checked_against_the_page_table():
    lcp = np.array([1000, 1000, 300, 300, 0, 500, 0])
    qo, kv = np.ones(8, np.int64), np.full(8, 2000)
    g = explicit_groups([(0, 5, 256), (0, 3, 900)], lcp, qo, kv)
    assert groups_of(g) == [(0, 5, 0, 256), (0, 3, 256, 900)]
    for bad, match in [([(0, 5, 400)], "share 300 KV positions"),
                       ([(4, 6, 16)], "share 0 KV positions"),
                       ([(0, 1, 16)], "2 or more"),
                       ([(0, 9, 16)], "2 or more"),
                       ([(0, 3, 100), (2, 5, 50)], "overlap without nesting"),
                       ([(0, 5, 300), (0, 3, 200)], "no more than the group holding it"),
                       ([(0, 5)], "must be \\(first_request, end_request, shared_kv\\)")]:
        with pytest.raises(PlanError, match=match):
            explicit_groups(bad, lcp, qo, kv)


def coverage(plan, qo, kv, num_kv_heads, group_size, window=None):
    """For every (token, head): the KV positions its states cover (list of ranges), and
    whether it is merged. Items are read back through their lists' fields. With a sliding
    window (the plan trimmed by its mask) the ranges must be disjoint and hold every visible
    position; without, they must be exactly [0, kv_len)."""
    num_heads = num_kv_heads * group_size
    qo_start = np.concatenate(([0], np.cumsum(qo)))
    token_req = np.repeat(np.arange(len(qo)), qo)
    slot_range = {}  # partial slot -> (token, head, kv range)
    direct = {}  # (token, head) -> [kv ranges of unsplit items]
    lists = [(plan.decode, DECODE, False), (plan.prefill, PREFILL, False)]
    if plan.cascade is not None:
        lists.append((plan.cascade, PREFILL, True))
    for sub, tiling, cascade in lists:
        for i in range(sub.num_work_items):
            b, kvh, row0 = (int(sub.work_request[i]), int(sub.work_kv_head[i]),
                            int(sub.work_row_start[i]))
            kv0, kv1, part = (int(sub.work_kv_start[i]), int(sub.work_kv_end[i]),
                              int(sub.work_partial[i]))
            q_end = (int(plan.cascade_item[3 * i]) if cascade else qo_start[b + 1])
            fused = (q_end - qo_start[b]) * group_size
            rows = min(tiling.rows_per_tile, fused - row0)
            assert rows > 0
            if cascade:  # the q_pos range the kernel classes the item's tiles by
                toks = qo_start[b] + (row0 + np.arange(rows)) // group_size
                rq = token_req[toks]
                q_pos = kv[rq] - qo[rq] + toks - qo_start[rq]
                assert plan.cascade_item[3 * i + 1] == q_pos.min()
                assert plan.cascade_item[3 * i + 2] == q_pos.max()
            for r in range(rows):
                f = row0 + r
                key = (qo_start[b] + f // group_size, kvh * group_size + f % group_size)
                if part < 0:
                    direct.setdefault(key, []).append((kv0, kv1))
                else:
                    assert part + r not in slot_range, "a partial slot written twice"
                    slot_range[part + r] = (key, (kv0, kv1))
    seen = {}
    for m in range(plan.merge_count):
        key = (int(plan.merge_token[m]), int(plan.merge_head[m]))
        assert int(plan.merge_request[m]) == token_req[key[0]]
        ranges = []
        for s in plan.merge_slots[plan.merge_indptr[m]:plan.merge_indptr[m + 1]]:
            got_key, r = slot_range.pop(int(s))
            assert got_key == key
            ranges.append(r)
        seen[key] = ranges
    assert not slot_range, "partial states no merge row reads"
    for t in range(int(qo.sum())):
        for h in range(num_heads):
            key = (t, h)
            assert (key in seen) != (key in direct), key
            ranges = [r for r in sorted(seen.get(key) or direct[key]) if r[0] < r[1]]
            for (_, b0), (a1, _) in pairwise(ranges):
                assert b0 <= a1, (key, ranges)  # no position seen twice
            b = token_req[t]
            q_pos = int(kv[b] - qo[b] + t - qo_start[b])
            lo, hi = (0, int(kv[b])) if window is None else (max(0, q_pos - window + 1), q_pos + 1)
            at = lo
            for a, e in ranges:  # every position of [lo, hi) in a range
                if a <= at < e:
                    at = e
            assert at >= hi, (key, ranges, lo, hi)
            if window is None:
                assert ranges[0][0] == 0 and ranges[-1][1] == hi and all(
                    b0 == a1 for (_, b0), (a1, _) in pairwise(ranges)), (key, ranges)
    return seen


@pytest.mark.parametrize("own", [False, True], ids=["own-apart", "own-in-cascade"])
@pytest.mark.parametrize("seed", range(12))
def test_cascade_plan_covers_every_position_once(seed, own):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(4, 12))
    qo = rng.choice([1, 1, 1, 3, 17, 90], batch)
    kv = qo + rng.integers(0, 900, batch)
    first = int(rng.integers(0, batch - 2))
    end = int(rng.integers(first + 2, batch + 1))
    share = int(kv[first:end].min() * rng.uniform(0.3, 1.0))
    rows = [(first, end, 0, share)]
    if end - first >= 3 and share > 40:
        rows.append((first, first + 2, share, share + int(kv[first:first + 2].min() - share)))
    groups = _groups([r for r in rows if r[3] > r[2]])
    plan = plan_cascade(qo, kv, groups, num_kv_heads=2, group_size=4, decode=DECODE,
                        prefill=PREFILL, kv_chunk_size=int(rng.choice([97, 1000])),
                        own_in_cascade=own)
    seen = coverage(plan, qo, kv, 2, 4)
    if own and groups.count:  # a grouped request's prefill items run in the cascade list
        grouped = np.zeros(batch, bool)
        grouped[groups.first[0]:groups.end[0]] = True
        assert not grouped[plan.prefill.work_request].any()
    grouped_tokens = range(int(qo[:first].sum()), int(qo[:end].sum()))
    if groups.count:  # (a group sharing nothing is no level)
        assert all((t, h) in seen for t in grouped_tokens for h in range(8))


def test_cascade_plan_is_deterministic_and_bounded():
    qo, kv = np.ones(16, np.int64), np.full(16, 3000)
    groups = find_groups(np.full(15, 2048))
    a = plan_cascade(qo, kv, groups, num_kv_heads=8, group_size=4, decode=DECODE,
                     prefill=PREFILL)
    b = plan_cascade(qo, kv, groups, num_kv_heads=8, group_size=4, decode=DECODE,
                     prefill=PREFILL)
    assert a.same_as(b) and a.cascade is not None
    # One group of 16 one-query requests: 64 fused rows per KV head, the prefix in chunks.
    assert set(a.cascade.work_request.tolist()) == {0}
    assert (a.cascade.work_kv_end <= 2048).all()
    assert (a.decode.work_kv_start >= 2048).all() or a.decode.num_work_items == 0
    coverage(a, qo, kv, 8, 4)
    with pytest.raises(CapacityError, match="max_partial_rows"):
        plan_cascade(qo, kv, groups, num_kv_heads=8, group_size=4, decode=DECODE,
                     prefill=PREFILL, bounds=PlanBounds(max_partial_rows=64))


def test_no_groups_is_the_mixed_plan():
    from attnlang.runtime.plan_mixed import plan_mixed

    qo, kv = np.array([1, 5, 1]), np.array([300, 400, 20])
    plain = plan_mixed(qo, kv, num_kv_heads=2, group_size=4, decode=DECODE, prefill=PREFILL)
    assert plan_cascade(qo, kv, _groups([]), num_kv_heads=2, group_size=4, decode=DECODE,
                        prefill=PREFILL).same_as(plain)


@pytest.mark.parametrize("seed", range(6))
def test_cascade_plan_with_a_trimming_mask(seed):
    # A sliding window trims each request's own units (plan_trim) after kv_from cut them at
    # the shared level's end: every visible position is still seen exactly once.
    import attnlang

    v = attnlang.parse("variant w\nmask = causal and q_pos - kv_pos < 300\n")
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(4, 10))
    qo = rng.choice([1, 1, 5, 40], batch)
    kv = qo + rng.integers(200, 1500, batch)
    share = int(kv.min() * rng.uniform(0.3, 1.0))
    groups = _groups([(0, batch, 0, share)])
    plan = plan_cascade(qo, kv, groups, num_kv_heads=2, group_size=4, decode=DECODE,
                        prefill=PREFILL, kv_chunk_size=int(rng.choice([97, 1000])), mask=v.mask,
                        head_dim=128, own_in_cascade=bool(seed % 2))
    coverage(plan, qo, kv, 2, 4, window=300)


def test_plan_argument():
    # plan()'s `cascade`: None follows the BatchAttention (auto with the kernel, else none),
    # False is none, levels are checked, and asking without the kernel says how to get it.
    from attnlang.runtime.validate import validate_plan_inputs

    pages = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 2, 3, 12], [5]]  # 128-token pages
    indptr, idx, _ = table(pages, [512] * 3 + [128], 128)
    inputs = validate_plan_inputs(np.arange(5), indptr, idx, np.full(4, 128), page_size=128)
    assert groups_of(choose_groups(None, inputs, 128, enabled=True)) == [(0, 3, 0, 384)]
    assert choose_groups(None, inputs, 128, enabled=False) is None
    assert choose_groups(False, inputs, 128, enabled=True) is None
    assert groups_of(choose_groups([(0, 2, 40)], inputs, 128, enabled=True)) == [(0, 2, 0, 40)]
    assert choose_groups([], inputs, 128, enabled=True) is None
    with pytest.raises(ValueError, match="cascade=True"):
        choose_groups("auto", inputs, 128, enabled=False)
    with pytest.raises(ValueError, match="'auto'"):
        choose_groups("yes", inputs, 128, enabled=True)
    with pytest.raises(PlanError, match="share 384 KV positions"):
        choose_groups([(0, 3, 500)], inputs, 128, enabled=True)


@pytest.mark.parametrize("qo_len", [1, 64, 512], ids=["decode", "chunks", "prompts"])
def test_default_capacities_hold_a_full_level(qo_len):
    # BatchAttention(cascade=True)'s default capacities: one group filling max_total_q (every
    # row merges and writes two more partial states) plans within them, at the H100's shapes.
    decode, prefill = Tiling(4, 528, 32), Tiling(128, 132, 128)
    max_total_q, n = 1024, 1024 // qo_len
    bounds = worst_case_cascade_bounds(max_batch_size=n, max_total_q=max_total_q,
                                       num_kv_heads=8, group_size=4, decode=decode,
                                       prefill=prefill)
    qo, kv = np.full(n, qo_len), np.full(n, 16384 + 700)
    plan = plan_cascade(qo, kv, _groups([(0, n, 0, 16384)]), num_kv_heads=8, group_size=4,
                        decode=decode, prefill=prefill, bounds=bounds, own_in_cascade=True)
    assert plan.cascade is not None and plan.merge_count == max_total_q * 32
