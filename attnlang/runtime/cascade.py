"""Shared-prefix cascades: requests whose page lists begin with the same pages read them once.

A paged cache stores a prefix shared by several requests (a system prompt, few-shot
examples, the prompt of parallel samples) once: their page lists begin with the same page
ids. A cascade plan attends each shared run once for all the queries of its requests, in
the `cascade` kernel (a prefill kernel with kCascade: one work item's rows are the fused rows
of several requests, each row with its own request's Index, so rope, masks and every hook
see true positions), and each request's remaining positions in the usual kernels; every row
of those requests then merges its partial states (the merge kernel: softmax by log-sum-exp,
softmax-off variants by sum), which is exact.

Levels nest: a group of requests sharing positions [kv_from, kv_to) may hold smaller groups
sharing more, [kv_to, kv_to'), and so on (the longest-common-prefix intervals of adjacent
page lists). Pure CPU and deterministic, like the planner.

>>> import numpy as np
>>> from attnlang.runtime.plan_mixed import Tiling
>>> kv_indptr, kv_indices = np.array([0, 3, 6, 7]), np.array([7, 8, 9, 7, 8, 4, 5])
>>> lcp = adjacent_shared(kv_indptr, kv_indices, np.array([40, 45, 16]), page_size=16)
>>> lcp.tolist()   # requests 0 and 1 share pages 7, 8: 32 positions
[32, 0]
>>> groups = find_groups(lcp, min_shared_kv=16)
>>> groups
CascadeGroups(requests 0..1: kv [0, 32))
>>> plan = plan_cascade([1, 1, 1], [40, 45, 16], groups, num_kv_heads=2, group_size=4,
...                     decode=Tiling(4, 8, 32), prefill=Tiling(64, 4, 64))
>>> plan.cascade.num_work_items, plan.merge_count   # 2 KV heads; 2 requests x 8 heads
(2, 16)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from attnlang.runtime import plan_assign, planner
from attnlang.runtime import plan_mixed as mixed
from attnlang.runtime.plan_mixed import BatchPlan, Tiling
from attnlang.runtime.plan_units import frozen, zeros_i32
from attnlang.runtime.planner import PlanBounds, PlanError

__all__ = ["CASCADE_MIN_KV", "CascadeGroups", "adjacent_shared", "find_groups",
           "explicit_groups", "choose_groups", "plan_cascade", "worst_case_cascade_bounds"]

# A group's level pays where it saves at least this many KV positions per extra request:
# below it, the merge of every row of its requests costs more than the reads it saves
# (benchmarks/cascade.py's sweep, benchmarks/NOTES.md).
CASCADE_MIN_KV = 256


@dataclass(frozen=True, eq=False)
class CascadeGroups:
    """Shared levels: group g is requests [first[g], end[g]) sharing KV positions
    [kv_from[g], kv_to[g]) (int64 arrays; nested groups follow their parent's kv_to)."""

    first: np.ndarray
    end: np.ndarray
    kv_from: np.ndarray
    kv_to: np.ndarray

    @property
    def count(self) -> int:
        return int(self.first.shape[0])

    def __repr__(self) -> str:
        rows = ", ".join(f"requests {f}..{e - 1}: kv [{a}, {b})" for f, e, a, b in
                         zip(self.first, self.end, self.kv_from, self.kv_to, strict=True))
        return f"CascadeGroups({rows})"


def adjacent_shared(kv_indptr: np.ndarray, kv_indices: np.ndarray, kv_lens: np.ndarray,
                    page_size: int) -> np.ndarray:
    """[batch - 1] int64: the KV positions requests b and b + 1 share, from position 0: their
    leading equal page ids times page_size, at most the shorter request's length."""
    batch = kv_lens.shape[0]
    shared = np.zeros(max(batch - 1, 0), dtype=np.int64)  # in pages, then positions
    if batch < 2 or kv_indices.shape[0] == 0:
        return shared
    indptr = kv_indptr.astype(np.int64)
    pages = np.diff(indptr)
    m = np.minimum(pages[:-1], pages[1:])  # pages the pair can share
    # Pairs whose first pages agree (one vectorised test; a batch without sharing stops
    # here), then each such pair's lists compared as two slices: the page table's own
    # memory, no gathered copies (10x cheaper than one gather over every pair's pages).
    first = np.minimum(indptr[:-1], kv_indices.shape[0] - 1)
    same_first = (m > 0) & (kv_indices[first[:-1]] == kv_indices[first[1:]])
    for b in np.flatnonzero(same_first).tolist():
        a, n = int(indptr[b]), int(m[b])
        c = int(indptr[b + 1])
        differing = np.flatnonzero(kv_indices[a:a + n] != kv_indices[c:c + n])
        shared[b] = differing[0] if differing.size else n
    kv = kv_lens.astype(np.int64)
    return np.minimum(shared * page_size, np.minimum(kv[:-1], kv[1:]))


def find_groups(lcp: np.ndarray, *, min_shared_kv: int = CASCADE_MIN_KV) -> CascadeGroups:
    """The shared levels worth a cascade, from `adjacent_shared`'s array: every maximal run
    of requests sharing more positions than the run around it (an LCP interval) whose own
    positions beyond its parent level's are at least min_shared_kv. Parents come first."""
    intervals = _lcp_intervals(lcp)  # (first, end, shared), children before parents
    intervals.sort(key=lambda t: (t[2], t[0]))  # parents (fewer shared positions) first
    chosen: list[tuple[int, int, int, int]] = []
    for first, end, shared in intervals:
        # The deepest chosen level holding this run (chosen ones are laminar with it).
        base = max((to for f, e, _, to in chosen if f <= first and end <= e), default=0)
        if end - first >= 2 and shared - base >= min_shared_kv:
            chosen.append((first, end, base, shared))
    chosen.sort(key=lambda t: (t[0], t[2]))
    return _groups(chosen)


def explicit_groups(groups: Sequence[Sequence[int]], lcp: np.ndarray, qo_lens: np.ndarray,
                    kv_lens: np.ndarray) -> CascadeGroups:
    """plan(cascade=[(first_request, end_request, shared_kv), ...]) checked against the page
    table: each group's requests must share their first shared_kv positions (same page
    ids), groups nest or are disjoint, and a nested group shares more than its parent."""
    batch = kv_lens.shape[0]
    rows = []
    for i, g in enumerate(groups):
        try:
            first, end, shared = (int(x) for x in g)
        except (TypeError, ValueError):
            raise PlanError(f"cascade group {i} must be (first_request, end_request, "
                            f"shared_kv), got {g!r}") from None
        if not (0 <= first < end <= batch) or end - first < 2:
            raise PlanError(f"cascade group {i} {(first, end, shared)}: requests "
                            f"[{first}, {end}) must be 2 or more of the batch's {batch}")
        held = int(lcp[first:end - 1].min())
        if not 0 < shared <= held:
            raise PlanError(
                f"cascade group {i}: requests {first}..{end - 1} share {held} KV positions "
                f"(equal page ids from position 0, within every request's length), not "
                f"{shared}; a shared prefix must be the same pages in every page list")
        rows.append((first, end, shared))
    rows.sort(key=lambda t: (t[0], -t[1]))
    chosen: list[tuple[int, int, int, int]] = []
    for first, end, shared in rows:
        parents = [c for c in chosen if c[0] <= first and end <= c[1]]
        for f, e, _, _ in chosen:
            if f < end and first < e and not (f <= first and end <= e):
                raise PlanError(f"cascade groups [{f}, {e}) and [{first}, {end}) overlap "
                                "without nesting")
        base = max((c[3] for c in parents), default=0)
        if shared <= base:
            raise PlanError(f"cascade group [{first}, {end}) shares {shared} positions, no "
                            f"more than the group holding it ({base})")
        chosen.append((first, end, base, shared))
    return _groups(chosen)


def choose_groups(cascade: Any, inputs, page_size: int, *, enabled: bool
                  ) -> CascadeGroups | None:
    """plan()'s `cascade` argument -> the shared levels to plan, or None for none.

    None: "auto" where the BatchAttention has the cascade kernel (enabled), else none;
    "auto" or True: `find_groups` over the page table; False: none; else explicit levels,
    checked (`explicit_groups`). inputs: plan()'s validated `PlanInputs`. Raises ValueError
    for a cascade asked of a BatchAttention without the kernel, or an unknown string."""
    if cascade is None:
        cascade = "auto" if enabled else False
    if cascade is False:
        return None
    if not enabled:
        raise ValueError("plan(cascade=...) needs the cascade kernel: construct "
                         "BatchAttention(..., cascade=True)")
    if isinstance(cascade, str) and cascade != "auto":
        raise ValueError(f"cascade must be None, 'auto', True, False or a list of "
                         f"(first_request, end_request, shared_kv), got {cascade!r}")
    lcp = adjacent_shared(inputs.kv_indptr, inputs.kv_indices, inputs.kv_lens, page_size)
    if cascade is True or cascade == "auto":
        groups = find_groups(lcp)
    else:
        groups = explicit_groups(cascade, lcp, inputs.qo_lens, inputs.kv_lens)
    return groups if groups.count else None


def _groups(rows: list[tuple[int, int, int, int]]) -> CascadeGroups:
    a = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return CascadeGroups(first=a[:, 0].copy(), end=a[:, 1].copy(), kv_from=a[:, 2].copy(),
                         kv_to=a[:, 3].copy())


def _lcp_intervals(lcp: np.ndarray) -> list[tuple[int, int, int]]:
    """The LCP intervals of adjacent shared lengths: (first, end, shared) for every maximal
    run of requests [first, end) whose adjacent pairs all share >= shared > 0 positions
    (a stack over the array, as in suffix-array LCP intervals)."""
    out: list[tuple[int, int, int]] = []
    stack = [(0, 0)]  # (shared, first request)
    n = lcp.shape[0] + 1
    for i in range(1, n):
        h, lb = int(lcp[i - 1]), i - 1
        while h < stack[-1][0]:
            shared, lb = stack.pop()
            out.append((lb, i, shared))
        if h > stack[-1][0]:
            stack.append((h, lb))
    while len(stack) > 1:
        shared, lb = stack.pop()
        out.append((lb, n, shared))
    return out


def plan_cascade(qo_lens, kv_lens, groups: CascadeGroups, *, num_kv_heads: int,
                 group_size: int, decode: Tiling, prefill: Tiling,
                 prefill_min_rows: int | None = None,
                 min_kv_chunk: int = planner.MIN_KV_CHUNK, kv_chunk_size: int | None = None,
                 bounds: PlanBounds | None = None, mask=None, head_dim: int | None = None,
                 pairs=None, own_in_cascade: bool = False) -> BatchPlan:
    """A BatchPlan with the groups' shared levels in the cascade kernel's list.

    Each group is one virtual request of the cascade list (its requests' tokens, its KV
    range), scheduled like a prefill request (`planner` rules, no mask trimming: the kernel
    skips a tile only where the mask hides it from every row). The requests' own positions
    (from the deepest group's kv_to on) are `plan_mixed`'s, every row of a grouped request
    writing a partial state; the merge list gathers each row's states from both, the
    cascade's first. own_in_cascade: the grouped requests' own positions that plan_mixed
    gives the prefill kernel run in the cascade kernel's list instead (a request of its own
    is a group of one there), so both kinds of items share one launch and one balance; the
    caller asks for it where the variant's mask and logits do not read the request (else the
    cascade kernel would lose their tile classes). Arguments as plan_mixed's. Raises
    PlanError / CapacityError."""
    qo, kv, total_q = planner._lengths(qo_lens, kv_lens)
    bounds = bounds or PlanBounds()
    batch = qo.shape[0]
    if groups.count and (int(groups.end.max()) > batch or int(groups.first.min()) < 0):
        raise PlanError("a cascade group reaches past the batch")
    kv_from = np.zeros(batch, dtype=np.int64)
    grouped = np.zeros(batch, dtype=bool)
    for f, e, to in zip(groups.first, groups.end, groups.kv_to, strict=True):
        kv_from[f:e] = np.maximum(kv_from[f:e], to)
        grouped[f:e] = True
    rest = mixed.plan_mixed(qo, kv, num_kv_heads=num_kv_heads, group_size=group_size,
                              decode=decode, prefill=prefill, prefill_min_rows=prefill_min_rows,
                              min_kv_chunk=min_kv_chunk, kv_chunk_size=kv_chunk_size,
                              bounds=bounds, mask=mask, head_dim=head_dim, pairs=pairs,
                              kv_from=kv_from if groups.count else None,
                              force_split=grouped if groups.count else None)
    if not groups.count or not qo[grouped].any():
        return rest

    qo_start = np.concatenate(([0], np.cumsum(qo)))
    group_q0 = qo_start[groups.first]
    group_qo = qo_start[groups.end] - group_q0
    shared = planner._schedule(
        group_qo, groups.kv_to, num_kv_heads=num_kv_heads, group_size=group_size,
        rows_per_tile=prefill.rows_per_tile, num_ctas=prefill.num_ctas,
        min_kv_chunk=min_kv_chunk, kv_align=prefill.kv_align, kv_chunk_size=kv_chunk_size,
        bounds=mixed._list_bounds(bounds.max_work_items), mask=None, head_dim=head_dim,
        lens32=(frozen(group_qo), frozen(groups.kv_to)),
        kv_from=groups.kv_from, force_split=np.ones(groups.count, dtype=bool))

    # Tokens: their request and q_pos (bottom-right: the queries end their sequence).
    token_request = np.repeat(np.arange(batch, dtype=np.int64), qo)
    q_pos = (kv - qo - qo_start[:-1])[token_request] + np.arange(total_q, dtype=np.int64)

    # Items: the group (virtual request) -> its first request; the q_pos range of the rows.
    g = shared.work_request.astype(np.int64)
    row0 = shared.work_row_start.astype(np.int64)
    rows = np.minimum(group_qo[g] * group_size - row0, prefill.rows_per_tile)
    t0 = group_q0[g] + row0 // group_size
    t1 = group_q0[g] + (row0 + rows - 1) // group_size + 1
    q_lo, q_hi = _range_min_max(q_pos, t0, t1)
    cascade_item = np.stack((qo_start[groups.end][g], q_lo, q_hi), axis=1).ravel()
    cascade = replace(shared, work_request=frozen(groups.first[g]))
    prefill_list = rest.prefill
    if own_in_cascade and rest.prefill.num_work_items:
        cascade, prefill_list, cascade_item = _own_items_to_cascade(
            cascade, cascade_item, rest.prefill, grouped, qo, kv, qo_start, group_size,
            prefill, shared.num_partial_rows)

    # Partial rows: the cascade list's first, then the decode and prefill lists'.
    n_shared = shared.num_partial_rows
    num_partial = n_shared + rest.num_partial_rows
    planner._check_bound(bounds.max_partial_rows, "max_partial_rows", num_partial,
                         "partial rows (split-KV and cascade states)")
    lists = {}
    for name, sub in (("decode", rest.decode), ("prefill", prefill_list)):
        lists[name] = replace(sub, work_partial=frozen(np.where(
            sub.work_partial >= 0, sub.work_partial.astype(np.int64) + n_shared, -1)))

    # Merge rows: the cascade's (numbered in its groups' tokens) and the rest's, by
    # (token, head), each row's cascade states first.
    num_heads = num_kv_heads * group_size
    s_virtual_start = np.concatenate(([0], np.cumsum(group_qo)))[:-1]
    s_req = shared.merge_request.astype(np.int64)
    s_token = shared.merge_token.astype(np.int64) - s_virtual_start[s_req] + group_q0[s_req]
    s_key = s_token * num_heads + shared.merge_head
    r_key = rest.merge_token.astype(np.int64) * num_heads + rest.merge_head
    s_n, r_n = np.diff(shared.merge_indptr), np.diff(rest.merge_indptr)
    slot_key = np.concatenate((np.repeat(s_key, s_n), np.repeat(r_key, r_n)))
    slots = np.concatenate((shared.merge_slots.astype(np.int64),
                            rest.merge_slots.astype(np.int64) + n_shared))
    # Two sorted runs: a stable sort merges them, each row's cascade slots first.
    order = np.argsort(slot_key, kind="stable")
    sorted_keys = slot_key[order]
    starts = np.flatnonzero(np.diff(sorted_keys, prepend=-1))
    keys = sorted_keys[starts]
    counts = np.diff(np.append(starts, sorted_keys.shape[0]))
    merge_rows = int(keys.shape[0])
    planner._check_bound(bounds.max_merge_rows, "max_merge_rows", merge_rows, "merge rows")
    indptr = np.concatenate(([0], np.cumsum(counts)))
    token = keys // num_heads
    return BatchPlan(
        decode=lists["decode"], prefill=lists["prefill"], merge_count=merge_rows,
        merge_indptr=frozen(indptr), merge_slots=frozen(slots[order]),
        merge_token=frozen(token), merge_head=frozen(keys % num_heads),
        merge_request=frozen(token_request[token]), num_partial_rows=num_partial,
        cascade=cascade, cascade_item=frozen(cascade_item),
        token_request=frozen(token_request), cascade_groups=groups,
    )


def _own_items_to_cascade(cascade, cascade_item, prefill_list, grouped, qo, kv, qo_start,
                          group_size, tiling: Tiling, n_shared: int):
    """Move the prefill list's items of grouped requests into the cascade list (each a group
    of one request: its token end, its rows' q_pos range) and schedule both lists again over
    their CTAs. Partial rows keep their numbers (the prefill list's are shifted by n_shared
    here, as plan_cascade shifts what stays). Returns (cascade, prefill, cascade_item)."""
    w = {k: a.astype(np.int64) for k, a in prefill_list.work_arrays().items()}
    move = grouped[w["work_request"]]
    fields = ("work_request", "work_kv_head", "work_row_start", "work_kv_start", "work_kv_end",
              "work_partial")
    b, row0 = w["work_request"][move], w["work_row_start"][move]
    rows = np.minimum(qo[b] * group_size - row0, tiling.rows_per_tile)
    q0 = kv[b] - qo[b]
    own_item = np.stack((qo_start[b + 1], q0 + row0 // group_size,
                         q0 + (row0 + rows - 1) // group_size), axis=1)
    partial = w["work_partial"][move]
    moved = [w[f][move] for f in fields[:-1]] + [np.where(partial >= 0, partial + n_shared,
                                                          -1)]
    c = {k: a.astype(np.int64) for k, a in cascade.work_arrays().items()}
    all_fields = [np.concatenate((c[f], m)) for f, m in zip(fields, moved, strict=True)]
    items = np.concatenate((cascade_item.reshape(-1, 3), own_item))
    span = all_fields[4] - all_fields[3]
    c_rows = np.minimum((cascade_item.reshape(-1, 3)[:, 0] - qo_start[c["work_request"]])
                        * group_size - c["work_row_start"], tiling.rows_per_tile)
    cost = planner.ROW_COST * np.concatenate((c_rows, rows)) + planner.KV_COST * span
    # The item triples travel as three more fields, so they follow the items' new order.
    work_indptr, block = plan_assign.work_lists(cost, [*all_fields, *items.T], tiling.num_ctas)
    new_cascade = replace(cascade, work_indptr=work_indptr,
                          **{f: np.ascontiguousarray(block[i]) for i, f in enumerate(fields)})
    kept = ~move
    if kept.any():
        k_rows = np.minimum(qo[w["work_request"][kept]] * group_size
                            - w["work_row_start"][kept], tiling.rows_per_tile)
        k_cost = (planner.ROW_COST * k_rows
                  + planner.KV_COST * (w["work_kv_end"][kept] - w["work_kv_start"][kept]))
        k_indptr, k_block = plan_assign.work_lists(k_cost, [w[f][kept] for f in fields],
                                                   tiling.num_ctas)
    else:
        k_indptr = zeros_i32(tiling.num_ctas + 1)
        k_block = np.zeros((6, 0), dtype=np.int32)
    new_prefill = replace(prefill_list, work_indptr=k_indptr,
                          **{f: k_block[i] for i, f in enumerate(fields)})
    return new_cascade, new_prefill, np.ascontiguousarray(block[6:].T).ravel()


def worst_case_cascade_bounds(*, max_batch_size: int, max_total_q: int, num_kv_heads: int,
                              group_size: int, decode: Tiling, prefill: Tiling) -> PlanBounds:
    """`worst_case_mixed_bounds` for plans that may hold one shared level: the level is a
    prefill list over its groups (at most a batch of them, max_total_q tokens), every row of
    a grouped request writes a partial state in it and in its own list even where neither
    splits (two more per (token, head)), and every row may merge. Nested levels can need
    more; plan_cascade then names the bound."""
    worst = mixed.worst_case_mixed_bounds(
        max_batch_size=max_batch_size, max_total_q=max_total_q, num_kv_heads=num_kv_heads,
        group_size=group_size, decode=decode, prefill=prefill)
    shared = planner.worst_case_bounds(
        max_batch_size=max_batch_size, max_total_q=max_total_q, num_kv_heads=num_kv_heads,
        group_size=group_size, rows_per_tile=prefill.rows_per_tile, num_ctas=prefill.num_ctas)
    rows = max_total_q * num_kv_heads * group_size  # (token, head) rows
    return replace(worst, max_partial_rows=worst.max_partial_rows + shared.max_partial_rows
                   + 2 * rows, max_merge_rows=rows)


def _range_min_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """min and max of values[lo[i]:hi[i]] for each i (non-empty ranges)."""
    if lo.shape[0] == 0:
        return lo.copy(), lo.copy()
    padded = np.append(values, 0)  # reduceat's indices must be < len
    idx = np.stack((lo, hi), axis=1).ravel()
    return (np.minimum.reduceat(padded, idx)[::2], np.maximum.reduceat(padded, idx)[::2])
