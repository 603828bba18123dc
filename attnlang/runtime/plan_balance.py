"""The planner's levelling step: the last items cut where each CTA's share ends.

Step 3b of `attnlang.runtime.planner`, for a kernel whose CTAs each run at their own SM's
pace (the prefill kernel: one persistent CTA per SM, bound by its tensor cores), so the
slowest CTA is the kernel's time. Longest-first assignment (`plan_assign`) leaves the CTAs
uneven by up to one item at the end: 1024 equal items on 132 CTAs give 100 CTAs eight
items and 32 seven, 3% over the mean, and no reordering of whole items does better.

So the first items keep their longest-first CTAs, and the last ones (the smallest: the
partial last round and one round more) are laid end to end on a tape and cut where each CTA's
share of them ends, the shares levelling the CTAs (McNaughton's wrap-around rule), each cut
at a KV tile boundary. At most num_ctas - 1 items are cut. A cut costs twice: each piece
pays an item's fixed cost (the shares reserve one per CTA), and the cut items' pieces write
partial states that the merge kernel reads after the attention kernel. The cut plan is
taken only if, with both, the cost model says it finishes sooner by more than `GAIN`.

Example (benchmarks/NOTES.md, "Levelled prefill lists"): 4096 units of 16384 + 256
positions on 132 CTAs (full attention S16384, 32 heads): makespan 32 items -> 31.1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["GAIN", "Units", "Levelled", "level_tail"]

# Least gain, as a fraction of the mean CTA load, worth cutting items for.
GAIN = 0.01

Ranges = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True, eq=False)
class Units:
    """The units to level, [units] each, in the cost model's units. cost: a whole unit's
    (fixed + visible(span)); fixed: what each item of the unit costs besides its KV
    positions; partial: what each item of a cut unit adds to the merge; [span0, span1): the
    unit's KV span. visible(units, kv0, kv1): the KV cost of ranges of units; kv_at(units,
    kv0, amount): the first KV tile boundary after kv0 with `amount` of KV cost before it
    (where a cut may fall; past the span: its end or beyond)."""

    cost: np.ndarray
    fixed: np.ndarray
    partial: np.ndarray
    span0: np.ndarray
    span1: np.ndarray
    visible: Ranges
    kv_at: Ranges


@dataclass(frozen=True, eq=False)
class Levelled:
    """A levelled list: [items] int64 arrays, items ordered (unit, KV) as the planner numbers
    them. cta: each item's CTA; rank: its place in that CTA's list (the longest-first items
    in their order, then the tape's pieces)."""

    unit: np.ndarray
    kv0: np.ndarray
    kv1: np.ndarray
    cta: np.ndarray
    rank: np.ndarray


def level_tail(u: Units, lpt: tuple[np.ndarray, np.ndarray], num_ctas: int,
               merge_launch: float) -> Levelled | None:
    """The units' items, the last ones cut to level the CTAs; None where longest-first
    assignment of whole units is within GAIN of the mean or cutting gains less than GAIN.

    lpt: the units' longest-first assignment, (order, cta) as `plan_assign.longest_first` gives
    it; merge_launch: what running the merge kernel at all costs. Pure and deterministic."""
    n, m = u.cost.shape[0], num_ctas
    if n <= m:
        return None
    order, cta = lpt
    loads = np.bincount(cta, weights=u.cost[order], minlength=m)
    mean = loads.sum() / m
    if loads.max() <= mean * (1 + GAIN):
        return None
    target = loads.max() - GAIN * mean  # the makespan a cut plan must beat

    head_n = max(n - (n % m + m), 0)
    head, tail = order[:head_n], order[head_n:]
    head_loads = np.bincount(cta[:head_n], weights=u.cost[head], minlength=m)
    level, ends, fill_ctas = _shares(head_loads, float(u.cost[tail].sum()),
                                     float(u.fixed[tail].mean()))
    if level + merge_launch > target:  # the cut plan's makespan, but for tile rounding
        return None
    cut_t, cut_kv = _cuts(ends[:-1], tail, u)

    # Pieces: each tail unit from its start, then from each cut inside it, in tape order; a
    # piece belongs to the share its start falls in.
    offset = cut_kv - u.span0[tail[np.minimum(cut_t, tail.shape[0] - 1)]]
    inside = (offset > 0) & (cut_t < tail.shape[0])
    width = int(u.span1.max() - u.span0.min()) + 1  # tape key: tail index * width + offset
    cut_key = cut_t * width + np.where(inside, offset, 0)
    starts = np.unique(np.concatenate((np.arange(tail.shape[0]) * width, cut_key[inside])))
    p_unit = tail[starts // width]
    p_kv0 = u.span0[p_unit] + starts % width
    same_unit_next = np.append(p_unit[1:] == p_unit[:-1], False)
    p_kv1 = np.where(same_unit_next, np.append(p_kv0[1:], 0), u.span1[p_unit])
    p_cta = fill_ctas[np.searchsorted(cut_key, starts, side="right")]
    p_cost = u.fixed[p_unit] + u.visible(p_unit, p_kv0, p_kv1)
    levelled = head_loads + np.bincount(p_cta, weights=p_cost, minlength=m)
    cut = np.bincount(p_unit, minlength=n)[p_unit] > 1
    if levelled.max() + merge_launch + u.partial[p_unit[cut]].sum() > target:
        return None

    unit = np.concatenate((head, p_unit))
    kv0 = np.concatenate((u.span0[head], p_kv0))
    kv1 = np.concatenate((u.span1[head], p_kv1))
    item_cta = np.concatenate((cta[:head_n], p_cta))
    rank = np.arange(unit.shape[0], dtype=np.int64)  # assignment order, the CTAs' list order
    by_unit = np.lexsort((kv0, unit))
    return Levelled(unit=unit[by_unit], kv0=kv0[by_unit], kv1=kv1[by_unit],
                    cta=item_cta[by_unit], rank=rank[by_unit])


def _cuts(ends, tail, u: Units):
    """Where the tape is cut at each share end: (tail index, KV position) [ends] each,
    non-decreasing; a cut at a unit's start (or past the tape) cuts between units."""
    after = np.cumsum(u.cost[tail])  # tape cost after each unit
    t = np.minimum(np.searchsorted(after, ends, side="right"), tail.shape[0] - 1)
    x = tail[t]
    amount = ends - (after[t] - u.cost[x]) - u.fixed[x]  # KV cost into the unit
    kv = u.kv_at(x, u.span0[x], np.maximum(amount, 0).astype(np.int64))
    kv = np.where(amount <= 0, u.span0[x], kv)
    at_end = kv >= u.span1[x]  # the cut falls after the unit: at the next one's start
    t = np.where(at_end, t + 1, t)
    kv = np.where(at_end, u.span0[tail[np.minimum(t, tail.shape[0] - 1)]], kv)
    return t, kv


def _shares(head_loads: np.ndarray, tape: float, piece_cost: float):
    """(level, ends, ctas): the water level over the head's loads, each CTA reserving one
    piece's fixed cost (a cut item's second piece pays it again), and the CTAs' shares of
    the tape up to it: their cumulative ends (the last = tape) and the CTAs, least loaded
    first."""
    load = head_loads + piece_cost
    by_load = np.argsort(load, kind="stable")
    s = load[by_load]
    # Water level with the k least loaded CTAs filled: (tape + their loads) / k; the right k
    # is the largest whose level reaches its own CTA's load.
    level = (tape + np.cumsum(s)) / np.arange(1, s.shape[0] + 1)
    k = int(np.flatnonzero(level >= s)[-1]) + 1
    share = level[k - 1] - s[:k]
    ends = np.cumsum(share)
    ends[-1] = tape
    return level[k - 1], ends, by_load[:k]
