"""The planner's assignment step: work items, sorted by cost, to CTAs (greedy LPT), and
the order of each CTA's list.

Step 3 of `attnlang.runtime.planner`: each item goes to the CTA with the least accumulated
cost, ties by CTA index, exactly as a heap would place them; the vectorised steps here pick
the same CTAs faster where they provably agree (tests/runtime/test_plan_fast_paths.py).
Integer and ordered throughout, so the same costs always give the same assignment.
`work_lists` groups the items by CTA, longest first or (`by_group`) in creation order.

Example: ``assign(np.array([5, 3, 3, 1]), 2).tolist()`` -> ``[0, 1, 1, 0]``.
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["assign", "assign_round", "assign_heap", "assign_equal", "longest_first", "work_lists",
           "by_group"]


def assign(sorted_cost: np.ndarray, num_ctas: int) -> np.ndarray:
    """Greedy LPT: item i (costs sorted descending) -> the least-loaded CTA, ties by index.

    Exactly the heap algorithm (`assign_heap`), in vectorized steps where they provably
    pick the same CTAs: a long run of equal costs (`assign_equal`), else a round of one
    item per CTA (`assign_round`); the heap itself where a round places few items.
    """
    n, m = sorted_cost.shape[0], num_ctas
    if n <= m:
        # Every CTA is empty when its item arrives: the heap would pick CTA i for item i.
        return np.arange(n, dtype=np.int64)
    loads = np.zeros(m, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    i = 0
    if sorted_cost[m - 1] > 0:
        # Every CTA is empty when one of the first m items arrives: CTA i takes item i.
        out[:m] = np.arange(m)
        loads[:] = sorted_cost[:m]
        i = m
    while i < n:
        c = int(sorted_cost[i])
        if c > 0 and i + RUN_MIN <= n and sorted_cost[i + RUN_MIN - 1] == c:  # a long run
            end = i + int(np.count_nonzero(sorted_cost[i:] == c))
            picks = assign_equal(loads, c, end - i)
            if picks is not None:
                out[i:end] = picks
                i = end
                continue
        placed = assign_round(loads, sorted_cost[i:i + m], out[i:i + m])
        i += placed
        if placed < RUN_MIN and i < n:
            # Loads too uneven for rounds: the heap for a while (a round costs about as much
            # as the heap placing a few dozen items).
            stop = min(n, i + max(m, HEAP_STRETCH))
            out[i:stop] = assign_heap(loads, sorted_cost[i:stop])
            i = stop
    return out


# Shortest run of equal costs (or round) worth a vectorized step; heap stretch after a short
# round.
RUN_MIN = 64
HEAP_STRETCH = 256


def assign_round(loads: np.ndarray, costs: np.ndarray, out: np.ndarray) -> int:
    """Place the next b >= 1 items (costs sorted descending, at most one per CTA) as the heap
    would, for the largest b this proves; updates `loads`, writes out[:b], returns b.

    With the CTAs in heap order s_1 < s_2 < ... (by (load, index)), item i goes to s_i as long
    as no CTA that took an item of this round comes back before s_i: those keys are at least
    L(s_1) + costs[b - 1], so ``L(s_1) + costs[i] > L(s_i)`` for i < b suffices (both sides
    are monotone in i). Item 0 always goes to s_1.
    """
    order = np.argsort(loads, kind="stable")  # ties by index: the heap's (load, cta) order
    k = costs.shape[0]
    least = loads[order[:k]]
    ok = least[0] + costs > least
    b = k if ok.all() else max(int(ok.argmin()), 1)
    picks = order[:b]
    out[:b] = picks
    loads[picks] += costs[:b]
    return b


def assign_heap(loads: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """The plain heap loop over `costs`, starting from (and updating) `loads`."""
    m = loads.shape[0]
    # Heap keys pack (load, cta) into one int, load * stride + cta: the same order as the
    # tuple, several times faster to compare. A sorted list is a valid heap.
    stride = 1 << max(m - 1, 1).bit_length()
    heap = sorted((loads * stride + np.arange(m)).tolist())
    mask = stride - 1
    out = []
    append, replace = out.append, heapq.heapreplace
    for c in costs.tolist():
        key = heap[0]
        append(key & mask)
        replace(heap, key + c * stride)
    keys = np.asarray(heap, dtype=np.int64)
    loads[keys & mask] = keys // stride
    return np.asarray(out, dtype=np.int64)


def assign_equal(loads: np.ndarray, c: int, k: int) -> np.ndarray | None:
    """k items of equal cost c, as the heap would place them; updates `loads`.

    Giving an item to CTA j at load L turns its heap key into L + c, CTA j's next candidate,
    so the heap's picks are the k smallest pairs (L_j + t c, j), t >= 0, in (value, j)
    order. Equal loads make that round robin from CTA 0. Otherwise the k-th smallest value is
    at most max(L) + c ceil(k / m) (every CTA has ceil(k/m) + 1 candidates up to there), so
    only those candidates are generated. Returns None (use the heap) when the loads are so
    uneven that there would be too many.
    """
    m = loads.shape[0]
    top = int(loads.max())
    if int(loads.min()) == top and c > 0:
        picks = np.arange(k, dtype=np.int64) % m
        loads += c * (k // m + (np.arange(m) < k % m))
        return picks
    hi = top + c * -(-k // m)
    per_cta = (hi - loads) // c + 1
    total = int(per_cta.sum())
    if total > 8 * k + 2 * m:
        return None
    cta = np.repeat(np.arange(m, dtype=np.int64), per_cta)
    t = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(per_cta) - per_cta, per_cta)
    value = loads[cta] + t * c
    picks = cta[np.lexsort((cta, value))[:k]]
    loads += c * np.bincount(picks, minlength=m)
    return picks


def longest_first(cost: np.ndarray, num_ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """Longest item first to the least-loaded CTA: (order, cta), the items in assignment
    order (cost descending, ties by creation order) and the CTA each of them takes."""
    n = cost.shape[0]
    if n and int(cost.min()) == int(cost.max()) > 0:
        # All equal (uniform decode batches): creation order, round robin from CTA 0 (what
        # the sort and assign give), so CTA c runs items c, c + m, c + 2m, ...
        order = np.arange(n, dtype=np.int64)
        return order, order % num_ctas
    order = np.argsort(-cost, kind="stable")
    return order, assign(cost[order], num_ctas)


def work_lists(cost, item_fields, num_ctas, assigned=None, by_group=False):
    """The items grouped by CTA, in assignment order within each CTA, or with by_group in
    creation order ((request, KV head) major: `by_group`).

    item_fields: the six [items] int64 arrays of the kernel's work list (request, kv_head,
    row_start, kv_start, kv_end, partial), in creation order. assigned: `longest_first`'s
    (order, cta) where the caller has it (or another assignment in that form); None:
    computed here. Returns (work_indptr, block): int32 read-only, block [6, items] holding
    the fields in work-list order (its rows are the contiguous work_* arrays)."""
    n = cost.shape[0]
    if assigned is None and n and int(cost.min()) == int(cost.max()) > 0:
        # All equal (uniform decode batches): round robin in creation order, as longest_first
        # gives it, so CTA c runs items c, c + m, c + 2m, ... in either order, no sort needed.
        cta_of = np.arange(n, dtype=np.int64) % num_ctas
        grid = np.arange(-(-n // num_ctas) * num_ctas).reshape(-1, num_ctas).T.ravel()
        items = grid[grid < n]
    else:
        order, cta_of = longest_first(cost, num_ctas) if assigned is None else assigned
        items = _grouped(order, cta_of, by_group)
    work_indptr = np.zeros(num_ctas + 1, dtype=np.int32)
    np.cumsum(np.bincount(cta_of, minlength=num_ctas), out=work_indptr[1:])
    work_indptr.setflags(write=False)
    # One int32 conversion and one gather for all six arrays (np.take keeps rows contiguous).
    block = np.take(np.array(item_fields, dtype=np.int32), items, axis=1)
    block.setflags(write=False)
    return work_indptr, block


def _grouped(order: np.ndarray, cta_of: np.ndarray, by_group: bool) -> np.ndarray:
    """The items grouped by CTA (order, cta_of: an assignment as longest_first gives it),
    each CTA's in assignment order, or with by_group in creation order."""
    if not by_group:
        return order[np.argsort(cta_of, kind="stable")]
    cta_item = np.empty(order.shape[0], dtype=np.int64)
    cta_item[order] = cta_of
    return np.argsort(cta_item, kind="stable")


def by_group(num_groups: int, num_ctas: int) -> bool:
    """Whether a compute-bound list runs each CTA's items in creation order, (request, KV
    head) major, rather than longest first: where its units fall in at least num_ctas / 3
    (request, KV head) groups.

    A longest-first round runs items of similar cost at once, about num_ctas / groups of each
    group; below 3 they share little K/V in L2 (8 prompts of 2048 tokens at 32 heads: 256
    groups, every CTA streaming K/V no other CTA reads: memory-bound). In creation order the
    CTAs walk the groups together, about units-per-group CTAs on each group. That costs where
    a group has many units and longest first already shares: one prompt of 16384 tokens at 32
    heads puts 128 CTAs on one head's K/V (8% slower than longest first's 4 per head), 4096
    tokens 2%; with 64 or more groups it measured +1% to +23% (benchmarks/NOTES.md)."""
    return 3 * num_groups >= num_ctas
