"""The planner's fast paths give the plans of the straightforward algorithm, bit for bit.

`reference_plan` below is planner.py's algorithm written as plain loops (units, chunk bound,
equal chunks, stable longest-first order, a (load, cta) heap, partial rows in creation order,
merge rows ordered (request, token, head)). The planner computes the same with vectorised
steps and shortcuts (one tile per request, nothing split, all costs equal, rounds of one item
per CTA, memoized units); random batches that hit each of them must match it exactly.
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest

import attnlang as al
from attnlang.runtime import plan_assign, plan_trim, plan_units, planner
from attnlang.runtime.plan_mixed import Tiling, plan_mixed
from attnlang.runtime.planner import plan_batch


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def one_round_bound(spans, bound, num_ctas, kv_align):
    """planner._one_round_bound as a scan: the smallest multiple of kv_align from `bound` up to
    the second round's cost (the num_ctas-th and next longest chunks) that makes at most
    num_ctas chunks; `bound` if none or if it already does."""
    def pieces(b):
        return sum(max(_ceil(s, b), 1) for s in spans)

    if len(spans) > num_ctas or pieces(bound) <= num_ctas:
        return bound
    chunks = sorted((_ceil(s, max(_ceil(s, bound), 1)) for s in spans
                     for _ in range(max(_ceil(s, bound), 1))), reverse=True)
    second_round = chunks[num_ctas - 1] + chunks[num_ctas]
    for b in range(bound, second_round + 1, kv_align):
        if pieces(b) <= num_ctas:
            return b
    return bound


def reference_plan(qo, kv, *, num_kv_heads, group_size, rows_per_tile, num_ctas,
                   min_kv_chunk=planner.MIN_KV_CHUNK, kv_align=1, kv_chunk_size=None):
    """plan_batch without a mask, as loops. Returns (work arrays, merge arrays, bound)."""
    units = []  # (request, kv_head, row_start, rows, span)
    for b, (q, k) in enumerate(zip(qo, kv, strict=True)):
        fused = q * group_size
        for h in range(num_kv_heads):
            for t in range(_ceil(fused, rows_per_tile)):
                row0 = t * rows_per_tile
                units.append((b, h, row0, min(fused - row0, rows_per_tile), k))
    total = sum(u[4] for u in units)
    if kv_chunk_size is None:
        bound = _ceil(max(min_kv_chunk, _ceil(total, num_ctas), 1), kv_align) * kv_align
        bound = one_round_bound([u[4] for u in units], bound, num_ctas, kv_align)
        align = kv_align
    else:
        bound, align = kv_chunk_size, 1
    items, unit_items, next_slot = [], [], 0
    for b, h, row0, rows, span in units:
        n = max(_ceil(span, bound), 1)
        chunk = _ceil(_ceil(span, n), align) * align
        n = _ceil(span, max(chunk, 1)) if span > 0 else 1
        unit_items.append([])
        for c in range(n):
            slot = -1
            if n > 1:
                slot, next_slot = next_slot, next_slot + rows
            unit_items[-1].append(len(items))
            kv0 = c * chunk
            items.append((b, h, row0, kv0, min(kv0 + chunk, span), slot,
                          planner.ROW_COST * rows + planner.KV_COST * (min(kv0 + chunk, span)
                                                                         - kv0)))
    order = sorted(range(len(items)), key=lambda i: -items[i][6])  # stable: ties by creation
    heap = [(0, c) for c in range(num_ctas)]
    per_cta = [[] for _ in range(num_ctas)]
    for i in order:
        load, c = heapq.heappop(heap)
        per_cta[c].append(i)
        heapq.heappush(heap, (load + items[i][6], c))
    flat = [i for cta in per_cta for i in cta]
    work = {"work_indptr": np.cumsum([0] + [len(c) for c in per_cta])}
    for k, name in enumerate(("work_request", "work_kv_head", "work_row_start",
                              "work_kv_start", "work_kv_end", "work_partial")):
        work[name] = np.array([items[i][k] for i in flat], dtype=np.int64)
    # Merge rows: (request, token, head) of split units, slots in KV order.
    first_unit = np.cumsum([0] + [num_kv_heads * _ceil(q * group_size, rows_per_tile)
                                  for q in qo])
    qo_start = np.cumsum([0] + list(qo))
    indptr, slots, token, head, request = [0], [], [], [], []
    for b, q in enumerate(qo):
        tiles = _ceil(q * group_size, rows_per_tile)
        for i in range(q):
            for hq in range(num_kv_heads * group_size):
                fused = i * group_size + hq % group_size
                u = first_unit[b] + hq // group_size * tiles + fused // rows_per_tile
                if len(unit_items[u]) > 1:
                    slots += [items[w][5] + fused - units[u][2] for w in unit_items[u]]
                    indptr.append(len(slots))
                    token.append(qo_start[b] + i)
                    head.append(hq)
                    request.append(b)
    merge = {"merge_indptr": indptr, "merge_slots": slots, "merge_token": token,
             "merge_head": head, "merge_request": request}
    return work, merge, bound


def _random_batch(rng, kind: str):
    batch = int(rng.integers(1, 40))
    if kind == "uniform_decode":  # one tile per request, all costs equal
        return [1] * batch, [int(rng.integers(1, 3000))] * batch
    kv = rng.integers(1, 4000, batch)
    if kind == "decode":
        qo = np.minimum(rng.integers(0, 3, batch), kv)
    else:
        qo = np.minimum(rng.integers(0, 200, batch), kv)
    return qo.tolist(), kv.tolist()


@pytest.mark.parametrize("kind", ["uniform_decode", "decode", "ragged"])
def test_plan_batch_matches_the_reference_loops(kind):
    rng = np.random.default_rng({"uniform_decode": 1, "decode": 2, "ragged": 3}[kind])
    for _ in range(40):
        qo, kv = _random_batch(rng, kind)
        if not any(qo):
            continue
        geo = dict(num_kv_heads=int(rng.choice([1, 2, 8])), group_size=int(rng.choice([1, 4])),
                   rows_per_tile=int(rng.choice([1, 4, 16])),
                   num_ctas=int(rng.choice([1, 5, 64, 528])),
                   kv_align=int(rng.choice([1, 32])))
        if rng.random() < 0.3:
            geo["kv_chunk_size"] = int(rng.integers(1, 2000))
        plan = plan_batch(qo, kv, **geo)
        work, merge, bound = reference_plan(qo, kv, **geo)
        assert plan.kv_chunk_size == bound
        for name, want in {**work, **merge}.items():
            got = getattr(plan, name)
            assert got.dtype == np.int32 and got.flags.c_contiguous and not got.flags.writeable
            assert got.tolist() == np.asarray(want, dtype=np.int64).tolist(), name
        assert plan.merge_count == len(merge["merge_token"])


def _heap_assign(costs, m):
    """The straightforward heap: item i (costs sorted descending) -> least (load, cta)."""
    heap = [(0, c) for c in range(m)]
    out = []
    for c in costs:
        load, cta = heapq.heappop(heap)
        out.append(cta)
        heapq.heappush(heap, (load + c, cta))
    return out


@pytest.mark.parametrize("shape", ["equal", "few_values", "lognormal", "tail"])
def test_assign_matches_the_heap(shape):
    rng = np.random.default_rng(["equal", "few_values", "lognormal", "tail"].index(shape))
    for _ in range(60):
        m = int(rng.choice([1, 3, 17, 132, 528]))
        n = int(rng.integers(0, 4 * m + 300))
        if shape == "equal":
            values = np.full(n, int(rng.integers(1, 5000)))
        elif shape == "few_values":
            values = rng.choice([2, 3, 70, 71, 2000], n)
        elif shape == "lognormal":  # skewed batches: rounds, then the heap
            values = np.round(rng.lognormal(6, 1.5, n)).astype(np.int64) + 2
        else:  # long equal tail after distinct heads: an equal run on uneven loads
            values = np.concatenate((rng.integers(100, 10000, n // 3), np.full(n - n // 3, 40)))
        costs = np.ascontiguousarray(np.sort(values)[::-1]).astype(np.int64)
        assert plan_assign.assign(costs, m).tolist() == _heap_assign(costs.tolist(), m)


def test_assign_round_places_what_the_heap_places():
    rng = np.random.default_rng(7)
    for _ in range(200):
        m = int(rng.integers(1, 40))
        loads = rng.integers(0, 100, m).astype(np.int64)
        costs = np.sort(rng.integers(1, 60, int(rng.integers(1, m + 1))))[::-1].astype(np.int64)
        out = np.empty(costs.shape[0], dtype=np.int64)
        expect_loads = loads.copy()
        heap = [(int(v), c) for c, v in enumerate(loads)]
        heapq.heapify(heap)
        b = plan_assign.assign_round(loads, costs, out)
        assert 1 <= b <= costs.shape[0]
        for i in range(b):
            load, cta = heapq.heappop(heap)
            assert out[i] == cta
            expect_loads[cta] += costs[i]
            heapq.heappush(heap, (load + int(costs[i]), cta))
        assert loads.tolist() == expect_loads.tolist()


def test_units_fast_path_and_memo_match_the_general_formulas():
    rng = np.random.default_rng(11)
    for _ in range(100):
        qo = rng.integers(0, 3, int(rng.integers(1, 30))).astype(np.int64)
        group, rows, heads = int(rng.choice([1, 2, 4])), int(rng.choice([4, 8])), 8
        units = plan_units.work_units(qo, group, rows, heads)
        assert plan_units.work_units(qo.copy(), group, rows, heads) is units  # memoized
        expect = [(b, h, t * rows, min(q * group - t * rows, rows))
                  for b, q in enumerate(qo.tolist()) for h in range(heads)
                  for t in range(_ceil(q * group, rows))]
        got = list(zip(units.req.tolist(), units.kvh.tolist(), units.row0.tolist(),
                       units.rows.tolist(), strict=True))
        assert got == expect
        # cls numbers (request, row tile) in order: equal for the units of one pair.
        pairs = sorted({(b, r0) for b, _, r0, _ in expect})
        assert units.cls.tolist() == [pairs.index((b, r0)) for b, _, r0, _ in expect]


def test_masked_fast_paths_match_unmemoized_plans():
    """Trimmed plans (causal, a window): the same with the memos cleared between calls,
    and the no-split path agrees with a forced split-free bound."""
    causal = al.parse("variant c\nmask = causal").mask
    window = al.parse("variant w\nmask = causal and q_pos - kv_pos < 300").mask
    tilings = dict(decode=Tiling(4, 528, 32), prefill=Tiling(128, 132, 64))
    rng = np.random.default_rng(5)
    for mask in (causal, window):
        for _ in range(20):
            kv = rng.integers(1, 5000, int(rng.integers(1, 200)))
            qo = np.where(rng.random(kv.shape[0]) < 0.8, 1, np.minimum(kv, 40))
            a = plan_mixed(qo, kv, num_kv_heads=8, group_size=4, **tilings, mask=mask,
                           head_dim=128)
            plan_units._UNITS.clear()
            plan_trim._READS_HEAD.clear()
            b = plan_mixed(qo, kv, num_kv_heads=8, group_size=4, **tilings, mask=mask,
                           head_dim=128)
            assert a.same_as(b)
