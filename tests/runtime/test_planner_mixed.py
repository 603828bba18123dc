"""plan_mixed: one batch, two attention kernels (decode and prefill work lists), one merge.
No GPU needed."""

import numpy as np
import pytest

from attnlang.runtime.plan_mixed import Tiling, plan_mixed, worst_case_mixed_bounds
from attnlang.runtime.planner import PREFILL_MIN_ROWS, CapacityError, PlanBounds, PlanError

DECODE, PREFILL = Tiling(4, 16, 32), Tiling(64, 8, 64)
# Up to 4 queries per request (16 fused rows at group 4) in the decode list, so batches mix
# both lists; the default threshold has its own test.
MIN_ROWS = 16
GEOMETRY = dict(num_kv_heads=2, group_size=4, decode=DECODE, prefill=PREFILL,
                prefill_min_rows=MIN_ROWS)


def written_slots(plan, qo, group):
    """partial row -> (request, kv_head, fused row, kv_start, kv_end), from both lists."""
    owner = {}
    for sub in (plan.decode, plan.prefill):
        for w in range(sub.num_work_items):
            if sub.work_partial[w] < 0:
                continue
            b, row0 = int(sub.work_request[w]), int(sub.work_row_start[w])
            rows = min(sub.rows_per_tile, qo[b] * group - row0)
            for i in range(rows):
                slot = int(sub.work_partial[w]) + i
                assert slot not in owner, "two items write one partial row"
                owner[slot] = (b, int(sub.work_kv_head[w]), row0 + i,
                               int(sub.work_kv_start[w]), int(sub.work_kv_end[w]))
    return owner


def check_mixed(plan, qo, kv, group=4, num_kv_heads=2):
    qo, kv = np.asarray(qo), np.asarray(kv)
    prefill = qo * group > MIN_ROWS
    covered = {b: np.zeros((num_kv_heads, qo[b] * group, kv[b]), int) for b in range(len(qo))}
    for sub, want in ((plan.decode, ~prefill), (plan.prefill, prefill)):
        assert set(sub.work_request.tolist()) <= set(np.flatnonzero(want & (qo > 0)).tolist())
        for w in range(sub.num_work_items):
            b, h, row0 = sub.work_request[w], sub.work_kv_head[w], sub.work_row_start[w]
            rows = min(sub.rows_per_tile, qo[b] * group - row0)
            covered[b][h, row0:row0 + rows, sub.work_kv_start[w]:sub.work_kv_end[w]] += 1
    for b, c in covered.items():
        assert (c == 1).all(), f"request {b} covered {np.unique(c)} times"
    owner = written_slots(plan, qo, group)
    assert sorted(owner) == list(range(plan.num_partial_rows))
    # Merge rows: batch token numbering, slots in KV order covering [0, kv_len).
    assert sorted(plan.merge_slots.tolist()) == list(range(plan.num_partial_rows))
    qo_start = np.concatenate(([0], np.cumsum(qo)))
    for m in range(plan.merge_count):
        b, t, head = plan.merge_request[m], plan.merge_token[m], plan.merge_head[m]
        i = t - qo_start[b]
        assert 0 <= i < qo[b], "merge token outside its request"
        pos = 0
        for s in plan.merge_slots[plan.merge_indptr[m]:plan.merge_indptr[m + 1]]:
            sb, sh, srow, kv0, kv1 = owner[int(s)]
            assert (sb, sh, srow) == (b, head // group, i * group + head % group)
            assert kv0 == pos
            pos = kv1
        assert pos == kv[b]


@pytest.mark.parametrize("seed", range(6))
def test_mixed_batches_are_covered_exactly_once(seed):
    rng = np.random.default_rng(seed)
    n = 7
    qo = np.where(rng.random(n) < 0.5, rng.integers(1, 5, n), rng.integers(5, 300, n))
    qo[rng.integers(n)] = 0
    kv = qo + rng.integers(0, 900, n)
    for chunk in (None, 100, 1 << 30):
        plan = plan_mixed(qo, kv, **GEOMETRY, kv_chunk_size=chunk)
        check_mixed(plan, qo, kv)


def test_decode_requests_before_prefill_requests_keep_their_tokens():
    # A decode request ahead of a split prefill request: the prefill list's merge tokens
    # must count the decode request's queries (plan_batch numbers them without).
    qo, kv = [3, 1, 70], [101, 50, 700]
    plan = plan_mixed(qo, kv, **GEOMETRY, kv_chunk_size=40)
    assert plan.decode.num_work_items and plan.prefill.num_work_items
    assert plan.merge_token.max() == sum(qo) - 1
    check_mixed(plan, qo, kv)


def test_default_threshold_sends_gqa_decode_to_tensor_cores():
    # More than PREFILL_MIN_ROWS = 3 fused rows: a group of 4 decodes in the prefill kernel,
    # MHA up to 3 queries per request (speculative tokens) in the decode kernel.
    assert PREFILL_MIN_ROWS == 3
    geometry = {k: v for k, v in GEOMETRY.items() if k != "prefill_min_rows"}
    plan = plan_mixed([1, 1], [100, 100], **geometry)
    assert plan.decode.num_work_items == 0 and plan.prefill.num_work_items > 0
    plan = plan_mixed([3, 4], [100, 100], **dict(geometry, group_size=1))
    assert set(plan.decode.work_request.tolist()) == {0}
    assert set(plan.prefill.work_request.tolist()) == {1}
    with pytest.raises(PlanError, match="prefill_min_rows"):
        plan_mixed([1], [10], **dict(GEOMETRY, prefill_min_rows=-1))


def test_threshold():
    at = MIN_ROWS // 4
    plan = plan_mixed([at, at + 1], [100, 100], **GEOMETRY)
    assert set(plan.decode.work_request.tolist()) == {0}
    assert set(plan.prefill.work_request.tolist()) == {1}
    assert plan.prefill.rows_per_tile == PREFILL.rows_per_tile
    assert plan.prefill.work_indptr.shape == (PREFILL.num_ctas + 1,)


def test_deterministic_and_same_as():
    qo, kv = [1, 200, 2, 90], [3000, 900, 40, 90]
    a = plan_mixed(qo, kv, **GEOMETRY)
    b = plan_mixed(qo, kv, **GEOMETRY)
    assert a.same_as(b) and not a.same_as(plan_mixed(qo, kv, **GEOMETRY, kv_chunk_size=64))


def test_bounds():
    qo, kv = [1, 300], [5000, 2000]
    bounds = worst_case_mixed_bounds(max_batch_size=2, max_total_q=301, num_kv_heads=2,
                                     group_size=4, decode=DECODE, prefill=PREFILL)
    plan = plan_mixed(qo, kv, **GEOMETRY, bounds=bounds)
    assert plan.num_partial_rows <= bounds.max_partial_rows
    assert plan.merge_count <= bounds.max_merge_rows
    with pytest.raises(CapacityError, match="max_partial_rows"):
        plan_mixed(qo, kv, **GEOMETRY, kv_chunk_size=100,
                   bounds=PlanBounds(max_partial_rows=10))
    with pytest.raises(CapacityError, match="max_total_q"):
        plan_mixed(qo, kv, **GEOMETRY, bounds=PlanBounds(max_total_q=300))
    with pytest.raises(PlanError, match="queries"):
        plan_mixed([5, 400], [5, 300], **GEOMETRY)
