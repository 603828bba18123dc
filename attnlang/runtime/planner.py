"""The CPU planner: a ragged batch's lengths -> a frozen work list for the attention kernels.

This is the load-balancing scheduler of FlashInfer (Ye et al. 2025, Algorithm 1), written for
attnlang's kernel contract (docs/INTERNALS.md, "Kernel kinds and arguments"):

1. Work units. Each request's query rows are fused with the GQA group (query i, group member
   g -> fused row ``i * group_size + g``) and cut into tiles of ``rows_per_tile`` fused rows.
   A unit is one (request, kv_head, row tile); it needs the request's whole KV sequence, or,
   given the variant's mask, only the span from its first to its last KV tile that the mask
   analysis (`mask_tiles.classify_tiles`) does not prove EMPTY for the unit's query
   positions; its KV cost is then the positions of its non-EMPTY tiles (`plan_trim.trim`).
2. KV chunk bound. From the total KV work of all units and the CTA count:
   ``bound = max(min_kv_chunk, ceil(total_kv / num_ctas))`` rounded up to ``kv_align``.
   A unit is split iff its KV span exceeds the bound; then it is cut into
   ``n = ceil(span / bound)`` chunks of equal length (at most the bound). Without a mask every
   unit of a request has the same span [0, kv_len). Short units are never split, so decode
   batches that already fill the GPU pay no merge. total_kv is the sum of the spans.
   When that cuts the units into a little more than num_ctas chunks, some CTAs would run two
   chunks while others idle; the bound is then raised to the smallest one that fits every
   chunk in one round, if that costs no more than the second round would (`_one_round_bound`).
3. Assignment (`plan_assign`). Chunks are sorted by cost (longest first; ties by creation
   order) and each goes to the CTA with the least accumulated cost (ties by CTA index).
   Everything is integer and ordered, so the same lengths always give bit-identical arrays:
   no atomics. With `compute_bound` (the prefill kernel's list), when nothing is split the last
   units are then cut where each CTA's share of them ends, if that finishes sooner, merge
   included (`plan_balance`), and with many (request, KV head) groups each CTA runs its
   items group by group, so that the CTAs share K/V in L2 (`plan_assign.by_group`).
4. Partial states. Unsplit chunks write the output directly (``work_partial == -1``); split
   ones write partial (o, lse) rows, and the merge arrays list, for every (token, head) of a
   split request, its partial rows in KV order.

The plan is pure data (`plan_types.Plan`, with the item cost and the workspace capacities it
is checked against): contiguous, read-only int32 NumPy arrays that the runtime copies into
a device workspace with one host-to-device copy. Nothing here touches a GPU.

Two kernels, one plan: `attnlang.runtime.plan_mixed` splits a batch between the decode and
prefill kernels, each list scheduled here.

Example::

    plan = plan_batch([1, 1], [4000, 10], num_kv_heads=8, group_size=4,
                      rows_per_tile=16, num_ctas=132)
    plan.num_work_items, plan.merge_count, plan.kv_chunk_size
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from attnlang.runtime import plan_assign, plan_balance, plan_trim, plan_units
from attnlang.runtime.plan_types import (
    KV_COST,
    ROW_COST,
    CapacityError,
    Plan,
    PlanBounds,
    PlanError,
)
from attnlang.runtime.plan_units import EMPTY_I32, NO_MERGE, ZERO_I32, frozen, zeros_i32

__all__ = [
    "ROW_COST", "KV_COST", "MIN_KV_CHUNK", "PREFILL_MIN_ROWS", "PlanError", "CapacityError",
    "PlanBounds", "Plan", "plan_batch", "lengths_from_indptr", "chunk_bound",
    "worst_case_bounds",
]

# Never split a request's KV below this many positions: a chunk this short costs about as
# much in setup and merging as it saves, and it keeps short requests whole.
MIN_KV_CHUNK = 256
# The merge kernel in the same units, where a plan's makespan is weighed against another's
# (`plan_balance`): it runs after the attention kernels on the whole GPU, so its time adds to
# the makespan. A KV position of a 128-row prefill item is ~17 ns of an SM's time (d128 at
# 500 TFLOP/s); the merge's launch is ~4 us (256 positions), and each partial row it reads
# (4 * head_dim + 4 bytes) with its share of the output row takes the whole GPU's HBM about
# 1/64 of a position (both scale alike with head_dim). benchmarks/NOTES.md, "Levelled
# prefill lists", has the measurements these are checked against.
MERGE_LAUNCH_COST = 256
MERGE_ROW_COST = 1 / 64
# Fewest fused rows per unit (on average) for levelling a list (`plan_balance`): items this
# wide keep their SM's tensor cores busy, so the slowest CTA is the kernel's time. Narrower
# ones (decode batches in the prefill kernel: one query of each head of a GQA group) stream
# KV from HBM, whose bandwidth the CTAs that finish first leave to the others.
LEVEL_MIN_ROWS = 64
# Requests with more fused rows (qo_len * group_size) than this run in the prefill kernel (tensor
# cores), the others in the decode kernel (CUDA cores). The decode kernel reads each K/V row
# from shared memory once per fused row and spends ~20 warp-instructions per key and row: at
# one row (MHA) it streams at the copy bandwidth, at 4 rows it is issue-bound and the
# tensor-core kernel, whose per-key cost hardly depends on the rows, is 10-17% faster
# (benchmarks/NOTES.md, "Decode on tensor cores"); at 2 rows the two are within 5%.
PREFILL_MIN_ROWS = 3


def lengths_from_indptr(indptr, name: str) -> np.ndarray:
    """Per-request lengths of an indptr ``[batch+1]`` (starts at 0, non-decreasing), int64.

    Raises PlanError naming `name` otherwise. Example: ``[0, 3, 3, 7] -> [3, 0, 4]``.
    """
    a = _int_array(indptr, name)
    if a.shape[0] < 1:
        raise PlanError(f"{name} must have batch_size + 1 >= 1 entries, got an empty array")
    if a[0] != 0:
        raise PlanError(f"{name} must start at 0, got {name}[0] = {a[0]}")
    d = a[1:] - a[:-1]  # np.diff, without its Python overhead
    if (d < 0).any():
        i = int(np.argmax(d < 0))
        raise PlanError(
            f"{name} must be non-decreasing, but {name}[{i + 1}] = {a[i + 1]} < "
            f"{name}[{i}] = {a[i]}"
        )
    return d


def chunk_bound(total_kv: int, num_ctas: int, *, min_kv_chunk: int = MIN_KV_CHUNK,
                kv_align: int = 1) -> int:
    """The KV chunk bound: ``max(min_kv_chunk, ceil(total_kv / num_ctas))`` rounded up to a
    multiple of kv_align. Example: ``chunk_bound(262144, 132, kv_align=16) == 2000``.
    """
    bound = max(min_kv_chunk, -(-total_kv // num_ctas), 1)
    return -(-bound // kv_align) * kv_align


def _one_round_bound(span: np.ndarray, bound: int, num_ctas: int, kv_align: int) -> int:
    """`bound`, or a larger multiple of kv_align that cuts the spans into at most num_ctas
    chunks (one round: no CTA runs two) at no more cost than `bound`'s second round.

    With more chunks than CTAs, longest-first assignment gives the CTA holding the
    num_ctas-th longest chunk the next one as well, so that CTA's load is at least the sum
    of the two. Any bound up to that sum whose chunks fit one round finishes no later, and
    splits less (fewer partial states to merge); the smallest such bound is taken. Example:
    256 units of 8192 positions on 528 CTAs: `chunk_bound` gives 3992, 3 chunks of ~2731 per
    unit, 768 chunks, so some CTAs run 5462 positions; 4096 gives 512 chunks of 4096.
    """
    if span.shape[0] > num_ctas:  # more units than CTAs: never one round
        return bound

    def num_chunks(b: int) -> int:
        return int(np.maximum(-(-span // b), 1).sum())

    n = np.maximum(-(-span // bound), 1)
    if int(n.sum()) <= num_ctas:
        return bound
    longest = np.sort(np.repeat(-(-span // n), n))[::-1]  # chunk lengths, longest first
    second_round = int(longest[num_ctas - 1] + longest[num_ctas])
    lo, hi = -(-bound // kv_align), second_round // kv_align  # candidate bounds / kv_align
    if hi < lo or num_chunks(hi * kv_align) > num_ctas:
        return bound
    while lo < hi:  # the chunk count never grows with the bound: bisect for the smallest
        mid = (lo + hi) // 2
        if num_chunks(mid * kv_align) <= num_ctas:
            hi = mid
        else:
            lo = mid + 1
    return lo * kv_align


def worst_case_bounds(*, max_batch_size: int, max_total_q: int, num_kv_heads: int,
                      group_size: int, rows_per_tile: int, num_ctas: int) -> PlanBounds:
    """Capacities that no batch within (max_batch_size, max_total_q) can exceed when the
    chunk bound is automatic (no kv_chunk_size override).

    Why they hold: every split unit has a KV span > bound >= total span / num_ctas and is cut
    into ceil(span / bound) < 2 span / bound chunks, so all split chunks together number fewer
    than 2 total_kv / bound <= 2 num_ctas, each with at most rows_per_tile partial rows; a
    merge row takes at least two of them. Unsplit units number at most
    num_kv_heads * (batch + ceil(total_q * group / rows_per_tile)).
    """
    units = num_kv_heads * (max_batch_size + -(-max_total_q * group_size // rows_per_tile))
    partial_rows = 2 * num_ctas * rows_per_tile
    merge_rows = min(max_total_q * num_kv_heads * group_size, partial_rows // 2)
    return PlanBounds(
        max_batch_size=max_batch_size, max_total_q=max_total_q,
        max_work_items=units + 2 * num_ctas, max_partial_rows=partial_rows,
        max_merge_rows=merge_rows,
    )


def plan_batch(
    qo_lens: Sequence[int] | np.ndarray,
    kv_lens: Sequence[int] | np.ndarray,
    *,
    num_kv_heads: int,
    group_size: int,
    rows_per_tile: int,
    num_ctas: int,
    min_kv_chunk: int = MIN_KV_CHUNK,
    kv_align: int = 1,
    kv_chunk_size: int | None = None,
    bounds: PlanBounds | None = None,
    mask: Any = None,
    head_dim: int | None = None,
    pairs: Any = None,
    compute_bound: bool = False,
) -> Plan:
    """Schedule a ragged batch over `num_ctas` CTAs. Pure CPU, deterministic.

    Args:
        qo_lens, kv_lens: [batch] query and KV lengths per request (0 <= qo_len <= kv_len:
            queries are the last tokens of their sequence, LANGUAGE.md section 4).
        num_kv_heads, group_size: KV heads and query heads per KV head (GQA group).
        rows_per_tile: fused rows per work item (the kernel's R, from launch_config).
        num_ctas: CTAs of the (fixed) decode grid.
        min_kv_chunk: the automatic bound never goes below this many KV positions.
        kv_align: chunk lengths are rounded up to multiples of this (the kernel's KV tile).
        kv_chunk_size: override the bound (tests force splits with a small value); used as
            given, ignoring min_kv_chunk and kv_align. Requests longer than it are split.
        bounds: workspace capacities; exceeding one raises CapacityError naming it.
        mask, head_dim: the variant's IR mask (``ir.Variant.mask``) and the head_dim. With a
            mask, each unit's KV range is trimmed to its first .. last KV tile that the mask
            analysis (`classify_tiles`, params unknown) does not prove fully masked, and it is
            costed by its non-EMPTY tiles only (`plan_trim.trim`). None: the whole [0, kv_len).
        pairs: the per-pair masks of the batch by name (`pairmask.PairBlocks`): the analysis
            classes their reads by the blocks (without them: unknown).
        compute_bound: the kernel's CTAs each run at their own SM's pace (the prefill kernel):
            when nothing is split, cut the last items where each CTA's share ends
            (`plan_balance`), within `bounds`, if that finishes sooner; and with at least
            num_ctas / 3 (request, KV head) groups, run each CTA's items group by group
            (`plan_assign.by_group`).

    Returns a Plan. Requests with qo_len == 0 produce no work. Example::

        plan_batch([1, 128], [5000, 300], num_kv_heads=2, group_size=4, rows_per_tile=16,
                   num_ctas=8)
    """
    for arg, value in (("num_kv_heads", num_kv_heads), ("group_size", group_size),
                       ("rows_per_tile", rows_per_tile), ("num_ctas", num_ctas),
                       ("min_kv_chunk", min_kv_chunk), ("kv_align", kv_align)):
        _check_positive(arg, value)
    if kv_chunk_size is not None:
        _check_positive("kv_chunk_size", kv_chunk_size)
    qo, kv, total_q = _lengths(qo_lens, kv_lens)
    bounds = bounds or PlanBounds()
    batch = qo.shape[0]
    _check_bound(bounds.max_batch_size, "max_batch_size", batch, "requests")
    _check_bound(bounds.max_total_q, "max_total_q", total_q, "query tokens")
    return _schedule(qo, kv, num_kv_heads=num_kv_heads, group_size=group_size,
                     rows_per_tile=rows_per_tile, num_ctas=num_ctas, min_kv_chunk=min_kv_chunk,
                     kv_align=kv_align, kv_chunk_size=kv_chunk_size, bounds=bounds, mask=mask,
                     head_dim=head_dim, pairs=pairs,
                     compute_bound=bounds if compute_bound else None)


def _lengths(qo_lens, kv_lens) -> tuple[np.ndarray, np.ndarray, int]:
    """Checked int64 qo_lens, kv_lens (plan_batch's Args) and total_q; raises PlanError."""
    qo = _int_array(qo_lens, "qo_lens")
    kv = _int_array(kv_lens, "kv_lens")
    if qo.shape != kv.shape:
        raise PlanError(
            f"qo_lens and kv_lens must have one entry per request, got {qo.shape[0]} and "
            f"{kv.shape[0]}"
        )
    # 0 <= qo <= kv implies kv >= 0: two checks in the common case, all of them (in the
    # order that picks the message) only when one fails.
    if qo.size and (int(qo.min()) < 0 or (qo > kv).any()):
        for name, a in (("qo_lens", qo), ("kv_lens", kv)):
            if (a < 0).any():
                i = int(np.argmax(a < 0))
                raise PlanError(f"{name} must be >= 0, got {name}[{i}] = {a[i]}")
        i = int(np.argmax(qo > kv))
        raise PlanError(
            f"request {i} has {qo[i]} queries but only {kv[i]} KV positions: queries are the "
            "last tokens of their sequence (q_pos = kv_len - qo_len + i), so qo_len must be "
            "<= kv_len; append the new tokens' K/V to the cache before planning"
        )
    total_q = int(qo.sum())
    if int(kv.max(initial=0)) >= 2**31 or total_q >= 2**31:
        raise PlanError("lengths overflow int32: total_q and every kv_len must be < 2**31")
    return qo, kv, total_q


def _schedule(qo, kv, *, num_kv_heads, group_size, rows_per_tile, num_ctas, min_kv_chunk,
              kv_align, kv_chunk_size, bounds, mask, head_dim, pairs=None, lens32=None,
              kv_from=None, force_split=None, compute_bound=None) -> Plan:
    """plan_batch after its checks (lengths from _lengths, arguments positive).

    compute_bound: for a compute-bound list (plan_batch's compute_bound), the capacities (a
    PlanBounds) the levelling step (`plan_balance`) may fill when nothing else is split and
    the bound is automatic; None: a list of items streaming KV from HBM (no levelling, items
    longest first in every CTA).

    lens32: the frozen int32 copies of (qo, kv) for the Plan, when the caller has them.
    kv_from [batch] (cascades, `plan_cascade`): request b's units cover KV positions from
    kv_from[b] on (a shared level before them holds the rest); force_split [batch] bool:
    request b's rows write partial states even when unsplit (a cascade merges them)."""
    if lens32 is None:
        lens32 = (frozen(qo), frozen(kv))
    if not qo.any():  # no queries: no work (the other kernel's list of a plan_mixed)
        return _empty_plan(lens32, num_kv_heads=num_kv_heads, group_size=group_size,
                           rows_per_tile=rows_per_tile, num_ctas=num_ctas,
                           min_kv_chunk=min_kv_chunk, kv_align=kv_align,
                           kv_chunk_size=kv_chunk_size)

    # 1. Units, ordered (request, kv_head, tile).
    u = plan_units.work_units(qo, group_size, rows_per_tile, num_kv_heads)
    num_units = u.req.shape[0]
    # Every request with queries has units on every KV head: that many (request, KV head)
    # groups.
    by_group = compute_bound is not None and plan_assign.by_group(
        num_kv_heads * int(np.count_nonzero(qo)), num_ctas)

    # 1b. Each unit's KV span [span0, span1) and visible-position count (its KV cost).
    trim = None
    if mask is not None:
        if head_dim is None:
            raise PlanError("plan_batch: head_dim is required with a mask")
        trim = plan_trim.trim(mask, qo, kv, u, group_size, num_kv_heads, int(head_dim), kv_align,
                              pairs)
        span0, span1 = trim.span0, trim.span1
        span = span1 if span0 is None else span1 - span0
        if trim.cum is None:  # no tiles (causal decode): as unmasked, over the trimmed spans
            trim = None
    else:
        span0, span1 = None, kv[u.req]  # span0 None: every span starts at 0
        span = span1
    if kv_from is not None:  # a cascade's own levels hold the positions before kv_from
        lo = kv_from[u.req]
        span0 = lo if span0 is None else np.maximum(span0, lo)
        span1 = np.maximum(span1, span0)
        span = span1 - span0
    forced = force_split[u.req] if force_split is not None else None

    # 2. The chunk bound and each unit's chunk count / length (equal chunks of its span).
    if kv_chunk_size is None:
        bound = chunk_bound(int(span.sum()), num_ctas, min_kv_chunk=min_kv_chunk,
                            kv_align=kv_align)
        bound = _one_round_bound(span, bound, num_ctas, kv_align)
        align = kv_align
    else:
        bound, align = int(kv_chunk_size), 1
    if int(span.max()) <= bound and (forced is None or not forced.any()):
        # Nothing split (decode batches that fill the GPU): one item per unit, its whole span
        # (what the general path below computes for unit_n == 1), no partial rows, no merges;
        # or, levelling, the last units cut where the CTAs' shares end.
        _check_bound(bounds.max_work_items, "max_work_items", num_units, "work items")
        kv0 = np.zeros(num_units, dtype=np.int64) if span0 is None else span0
        kv_cost = span if trim is None else trim.visible_between(None, kv0, span1)
        cost = ROW_COST * u.rows + KV_COST * kv_cost
        lpt = levelled = None
        if (compute_bound is not None and kv_from is None and kv_chunk_size is None
                and group_size * num_kv_heads * int(qo.sum()) >= LEVEL_MIN_ROWS * num_units):
            lpt = plan_assign.longest_first(cost, num_ctas)
            levelled = _levelled(u, cost, lpt, kv0, span1, trim, kv_align, num_ctas,
                                 compute_bound)
        if levelled is None:
            fields_ = (u.req, u.kvh, u.row0, kv0, span1, np.full(num_units, -1, dtype=np.int64))
            work = plan_assign.work_lists(cost, fields_, num_ctas, lpt, by_group)
            return _plan(qo, kv, lens32, num_ctas, num_kv_heads, group_size, rows_per_tile,
                         bound, work, NO_MERGE, 0)
        unit_n = np.bincount(levelled.unit, minlength=num_units)
        order = np.argsort(levelled.rank)
        return _chunked(qo, kv, lens32, u, unit_n, unit_n > 1, levelled.unit, levelled.kv0,
                        levelled.kv1, trim, (order, levelled.cta[order]), bound=bound,
                        bounds=bounds, num_ctas=num_ctas, num_kv_heads=num_kv_heads,
                        group_size=group_size, rows_per_tile=rows_per_tile,
                        by_group=by_group)

    unit_n = np.maximum(-(-span // bound), 1)  # empty span: one empty chunk, unsplit
    chunk_len = -(-span // unit_n)
    chunk_len = -(-chunk_len // align) * align
    unit_n = np.where(span > 0, -(-span // np.maximum(chunk_len, 1)), 1)  # alignment may merge
    unit_split = unit_n > 1 if forced is None else (unit_n > 1) | forced
    if span0 is None:
        span0 = np.zeros(num_units, dtype=np.int64)

    # Items: each unit repeated unit_n times, chunks in KV order.
    item_unit = np.repeat(np.arange(num_units, dtype=np.int64), unit_n)
    item_first = np.cumsum(unit_n) - unit_n
    item_c = np.arange(item_unit.shape[0], dtype=np.int64) - item_first[item_unit]
    item_kv0 = span0[item_unit] + item_c * chunk_len[item_unit]
    item_kv1 = np.minimum(item_kv0 + chunk_len[item_unit], span1[item_unit])
    return _chunked(qo, kv, lens32, u, unit_n, unit_split, item_unit, item_kv0, item_kv1,
                    trim, None, bound=bound, bounds=bounds, num_ctas=num_ctas,
                    num_kv_heads=num_kv_heads, group_size=group_size,
                    rows_per_tile=rows_per_tile, by_group=by_group)


def _levelled(u, cost, lpt, kv0, kv1, trim, kv_align, num_ctas, capacities):
    """`plan_balance.level_tail` of the units (their rows LEVEL_MIN_ROWS or more on average),
    or None where it declines or its pieces would not fit the capacities (a PlanBounds)."""

    def visible(units, a, b):
        return KV_COST * (b - a if trim is None else trim.visible_between(units, a, b))

    def kv_at(units, a, amount):
        positions = -(-amount // KV_COST)
        if trim is None:
            return a + -(-positions // kv_align) * kv_align
        return trim.kv_at(units, a, positions)

    units = plan_balance.Units(cost=cost, fixed=ROW_COST * u.rows,
                               partial=MERGE_ROW_COST * u.rows, span0=kv0, span1=kv1,
                               visible=visible, kv_at=kv_at)
    out = plan_balance.level_tail(units, lpt, num_ctas, MERGE_LAUNCH_COST)
    if out is None:
        return None
    split = np.bincount(out.unit, minlength=cost.shape[0]) > 1
    partial_rows = int(u.rows[out.unit[split[out.unit]]].sum())
    merge_rows = int(u.rows[split].sum())
    for capacity, needed in ((capacities.max_work_items, out.unit.shape[0]),
                             (capacities.max_partial_rows, partial_rows),
                             (capacities.max_merge_rows, merge_rows)):
        if capacity is not None and needed > capacity:
            return None
    return out


def _chunked(qo, kv, lens32, u, unit_n, unit_split, item_unit, item_kv0, item_kv1, trim,
             assigned, *, bound, bounds, num_ctas, num_kv_heads, group_size,
             rows_per_tile, by_group=False) -> Plan:
    """The plan of units cut into items: item_* [items] in (unit, KV) order, unit_n [units]
    items per unit, unit_split [units] whether its items write partial states. assigned:
    the items' (order, cta) as `plan_assign.longest_first` gives them (levelled), or None
    for longest-first assignment; by_group: `plan_assign.work_lists`'."""
    item_rows = u.rows[item_unit]
    num_items = item_unit.shape[0]
    _check_bound(bounds.max_work_items, "max_work_items", num_items, "work items")
    if trim is None:
        item_kv_cost = item_kv1 - item_kv0
    else:
        item_kv_cost = trim.visible_between(item_unit, item_kv0, item_kv1)
    item_first = np.cumsum(unit_n) - unit_n

    # 4 (before 3: slots depend on creation order only). Partial rows, allocated in item order.
    item_split = unit_split[item_unit]
    slot_size = np.where(item_split, item_rows, 0)
    item_partial = np.cumsum(slot_size) - slot_size
    num_partial_rows = int(slot_size.sum())
    item_partial = np.where(item_split, item_partial, -1)
    _check_bound(bounds.max_partial_rows, "max_partial_rows", num_partial_rows,
                 "partial rows (split-KV states)")

    # 3. Longest chunk first to the least-loaded CTA (or the levelled CTAs).
    cost = ROW_COST * item_rows + KV_COST * item_kv_cost
    fields_ = (u.req[item_unit], u.kvh[item_unit], u.row0[item_unit], item_kv0, item_kv1,
               item_partial)
    work = plan_assign.work_lists(cost, fields_, num_ctas, assigned, by_group)

    merge = plan_units.merge_rows(qo, u, unit_split, unit_n, item_first, item_partial,
                                  group_size, num_kv_heads)
    _check_bound(bounds.max_merge_rows, "max_merge_rows", merge.count, "merge rows")
    return _plan(qo, kv, lens32, num_ctas, num_kv_heads, group_size, rows_per_tile, bound,
                 work, merge, num_partial_rows)


def _plan(qo, kv, lens32, num_ctas, num_kv_heads, group_size, rows_per_tile, bound, work,
          merge, num_partial_rows) -> Plan:
    work_indptr, w = work
    return Plan(
        num_ctas=int(num_ctas), num_kv_heads=int(num_kv_heads), group_size=int(group_size),
        rows_per_tile=int(rows_per_tile), kv_chunk_size=int(bound),
        qo_lens=lens32[0], kv_lens=lens32[1], work_indptr=work_indptr,
        work_request=w[0], work_kv_head=w[1], work_row_start=w[2], work_kv_start=w[3],
        work_kv_end=w[4], work_partial=w[5],
        merge_count=merge.count, merge_indptr=merge.indptr, merge_slots=merge.slots,
        merge_token=merge.token, merge_head=merge.head, merge_request=merge.request,
        num_partial_rows=num_partial_rows,
    )


def _empty_plan(lens32, *, num_kv_heads, group_size, rows_per_tile, num_ctas, min_kv_chunk,
                kv_align, kv_chunk_size) -> Plan:
    """The plan of a batch without queries: no items, no partial rows, no merges.
    lens32: its frozen int32 (qo_lens, kv_lens)."""
    if kv_chunk_size is None:
        bound = chunk_bound(0, num_ctas, min_kv_chunk=min_kv_chunk, kv_align=kv_align)
    else:
        bound = int(kv_chunk_size)
    e = EMPTY_I32
    return Plan(
        num_ctas=int(num_ctas), num_kv_heads=int(num_kv_heads), group_size=int(group_size),
        rows_per_tile=int(rows_per_tile), kv_chunk_size=int(bound),
        qo_lens=lens32[0], kv_lens=lens32[1], work_indptr=zeros_i32(int(num_ctas) + 1),
        work_request=e, work_kv_head=e, work_row_start=e, work_kv_start=e, work_kv_end=e,
        work_partial=e, merge_count=0, merge_indptr=ZERO_I32, merge_slots=e,
        merge_token=e, merge_head=e, merge_request=e, num_partial_rows=0,
    )




def _int_array(x, name: str) -> np.ndarray:
    try:
        a = np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise PlanError(f"{name} must be a 1-D array of integers: {e}") from None
    if a.ndim != 1:
        raise PlanError(f"{name} must be a 1-D array of integers, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu":  # not bool, float, object...
        raise PlanError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)  # read only: no copy needed


def _check_positive(name: str, value) -> None:
    if type(value) is int and value >= 1:  # the usual case, first (plan() calls this often)
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")


def _check_bound(capacity: int | None, bound: str, needed: int, what: str) -> None:
    if capacity is not None and needed > capacity:
        raise CapacityError(bound, needed, capacity, what)
