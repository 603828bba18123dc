"""Mixed batches: one plan for the decode and prefill kernels plus the merge kernel.

Requests with more than PREFILL_MIN_ROWS fused rows (qo_len * group_size) go to the prefill
kernel (tensor cores, 128-row tiles; with GQA groups of 4 or more, single-token decode too),
the others to the decode kernel. Each kernel gets its own work list, scheduled by the
planner (`planner.plan_batch`'s rules) over its own grid with the other kernel's requests
given no queries (no work); the two lists share the partial-state buffer (the prefill
list's slots follow the decode list's) and one merge list. Pure CPU, deterministic.

Example::

    plan = plan_mixed([1, 500], [4000, 900], num_kv_heads=8, group_size=4,
                      decode=Tiling(4, 528, 32), prefill=Tiling(64, 264, 64))
    plan.decode.num_work_items, plan.prefill.num_work_items
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from attnlang.runtime import planner
from attnlang.runtime.plan_units import EMPTY_I32, ZERO_I32, frozen, zeros_i32
from attnlang.runtime.planner import (
    MIN_KV_CHUNK,
    Plan,
    PlanBounds,
    PlanError,
    _check_bound,
    _check_positive,
    _empty_plan,
    _lengths,
    _schedule,
    worst_case_bounds,
)

__all__ = ["Tiling", "BatchPlan", "plan_mixed", "worst_case_mixed_bounds"]


@dataclass(frozen=True)
class Tiling:
    """How one kernel cuts work: fused rows per item, CTAs of its grid, KV chunk alignment.

    Example: ``Tiling(rows_per_tile=64, num_ctas=264, kv_align=64)`` (prefill, head_dim 128).
    """

    rows_per_tile: int
    num_ctas: int
    kv_align: int = 1


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """The plan of a batch for both attention kernels plus the merge kernel.

    decode / prefill: each kernel's Plan (its work list over its own grid; a request appears
    in one of them only, its qo_lens are 0 for the other kernel's requests). Partial rows of
    the prefill list follow the decode list's (``prefill.work_partial`` is already offset),
    and the merge arrays here cover both (merge_token in the batch's numbering):
    ``merge_slots[merge_indptr[m]:merge_indptr[m+1]]`` are merge row m's partial rows in KV
    order (the sub-plans' own merge arrays are not used by the runtime).
    """

    decode: Plan
    prefill: Plan
    merge_count: int
    merge_indptr: np.ndarray
    merge_slots: np.ndarray
    merge_token: np.ndarray
    merge_head: np.ndarray
    merge_request: np.ndarray
    num_partial_rows: int
    # A cascade's shared levels (`attnlang.runtime.cascade.plan_cascade`): the cascade
    # kernel's work list (its partial rows come first), per item the group's token end and
    # the q_pos range of its rows ([items, 3] flattened), and each token's request.
    cascade: Plan | None = None
    cascade_item: np.ndarray = field(default_factory=lambda: EMPTY_I32)
    token_request: np.ndarray = field(default_factory=lambda: EMPTY_I32)
    cascade_groups: Any = None  # its CascadeGroups (which requests share what)

    @property
    def batch_size(self) -> int:
        return self.decode.batch_size

    @property
    def total_q(self) -> int:
        return self.decode.total_q + self.prefill.total_q

    @property
    def num_work_items(self) -> int:
        shared = self.cascade.num_work_items if self.cascade is not None else 0
        return self.decode.num_work_items + self.prefill.num_work_items + shared

    @property
    def num_split_requests(self) -> int:
        return self.decode.num_split_requests + self.prefill.num_split_requests

    @property
    def kv_chunk_size(self) -> int:
        """The decode list's KV chunk bound (see each sub-plan for its own)."""
        return self.decode.kv_chunk_size

    def merge_arrays(self) -> dict[str, np.ndarray]:
        """The merge kernel's plan arguments (after merge_count), in kernel-argument order."""
        return {
            "merge_indptr": self.merge_indptr, "merge_slots": self.merge_slots,
            "merge_token": self.merge_token, "merge_head": self.merge_head,
            "merge_request": self.merge_request,
        }

    def same_as(self, other: BatchPlan) -> bool:
        """True if both plans hold identical values (the determinism check)."""
        if not (self.decode.same_as(other.decode) and self.prefill.same_as(other.prefill)):
            return False
        if (self.cascade is None) != (other.cascade is None) or (
                self.cascade is not None and not (
                    self.cascade.same_as(other.cascade)
                    and np.array_equal(self.cascade_item, other.cascade_item)
                    and np.array_equal(self.token_request, other.token_request))):
            return False
        if (self.merge_count, self.num_partial_rows) != (other.merge_count,
                                                         other.num_partial_rows):
            return False
        return all(np.array_equal(a, other.merge_arrays()[k])
                   for k, a in self.merge_arrays().items())


def plan_mixed(
    qo_lens: Sequence[int] | np.ndarray,
    kv_lens: Sequence[int] | np.ndarray,
    *,
    num_kv_heads: int,
    group_size: int,
    decode: Tiling,
    prefill: Tiling,
    prefill_min_rows: int | None = None,
    min_kv_chunk: int = MIN_KV_CHUNK,
    kv_chunk_size: int | None = None,
    bounds: PlanBounds | None = None,
    mask: Any = None,
    head_dim: int | None = None,
    pairs: Any = None,
    kv_from: np.ndarray | None = None,
    force_split: np.ndarray | None = None,
) -> BatchPlan:
    """Schedule a ragged batch over the decode and prefill kernels. Pure CPU, deterministic.

    Request b runs in the prefill kernel iff ``qo_lens[b] * group_size > prefill_min_rows``
    (default planner.PREFILL_MIN_ROWS, read at each call).
    Each kernel's list is `plan_batch` over its requests (the others get qo_len 0) with its
    own Tiling (and the mask / head_dim for KV trimming, see plan_batch); the cost model, the
    KV chunk bound (per list: each kernel fills the GPU on its own, they run one after the
    other) and the determinism are plan_batch's. kv_chunk_size overrides both lists' bound.

    kv_from, force_split: a cascade's (`attnlang.runtime.cascade`): per request, the first
    KV position its units cover, and whether its rows always write partial states.

    bounds: max_work_items caps each list (the workspace holds one section per list);
    max_partial_rows and max_merge_rows cap the two lists together. Raises PlanError /
    CapacityError. Example::

        plan = plan_mixed([1, 500], [4000, 900], num_kv_heads=8, group_size=4,
                          decode=Tiling(4, 528, 32), prefill=Tiling(64, 264, 64))
        plan.decode.num_work_items, plan.prefill.num_work_items
    """
    if prefill_min_rows is None:  # read now, so tuning scripts can override the constant
        prefill_min_rows = planner.PREFILL_MIN_ROWS
    if prefill_min_rows < 0:
        raise PlanError(f"prefill_min_rows must be >= 0, got {prefill_min_rows}")
    for arg, value in (("num_kv_heads", num_kv_heads), ("group_size", group_size),
                       ("min_kv_chunk", min_kv_chunk),
                       ("decode.rows_per_tile", decode.rows_per_tile),
                       ("decode.num_ctas", decode.num_ctas), ("decode.kv_align", decode.kv_align),
                       ("prefill.rows_per_tile", prefill.rows_per_tile),
                       ("prefill.num_ctas", prefill.num_ctas),
                       ("prefill.kv_align", prefill.kv_align)):
        _check_positive(arg, value)
    if kv_chunk_size is not None:
        _check_positive("kv_chunk_size", kv_chunk_size)
    qo, kv, total_q = _lengths(qo_lens, kv_lens)
    bounds = bounds or PlanBounds()
    _check_bound(bounds.max_batch_size, "max_batch_size", qo.shape[0], "requests")
    _check_bound(bounds.max_total_q, "max_total_q", total_q, "query tokens")
    per_list = _list_bounds(bounds.max_work_items)
    common = dict(num_kv_heads=num_kv_heads, group_size=group_size, min_kv_chunk=min_kv_chunk,
                  kv_chunk_size=kv_chunk_size, bounds=per_list, mask=mask, head_dim=head_dim,
                  pairs=pairs, kv_from=kv_from, force_split=force_split)
    if mask is not None and head_dim is None:
        raise PlanError("plan_mixed: head_dim is required with a mask")
    any_prefill = int(qo.max(initial=0)) * group_size > prefill_min_rows
    # The lists' Plans share the frozen kv_lens; a decode-only batch's prefill list gets
    # shared zeros for its qo_lens (and the other way round).
    kv32, no_q = frozen(kv), zeros_i32(qo.shape[0])
    if any_prefill:
        to_prefill = qo * group_size > prefill_min_rows
        dec_qo, pre_qo = np.where(to_prefill, 0, qo), np.where(to_prefill, qo, 0)
        dec_lens, pre_lens = (frozen(dec_qo), kv32), (frozen(pre_qo), kv32)
    else:
        dec_qo, pre_qo = qo, None
        dec_lens, pre_lens = (frozen(qo), kv32), (no_q, kv32)
    dec = _schedule(dec_qo, kv, rows_per_tile=decode.rows_per_tile, num_ctas=decode.num_ctas,
                    kv_align=decode.kv_align, lens32=dec_lens, **common)
    if pre_qo is None:
        pre = _empty_plan(pre_lens, num_kv_heads=num_kv_heads, group_size=group_size,
                          rows_per_tile=prefill.rows_per_tile, num_ctas=prefill.num_ctas,
                          min_kv_chunk=min_kv_chunk, kv_align=prefill.kv_align,
                          kv_chunk_size=kv_chunk_size)
    else:
        # The prefill kernel's CTAs run at their SMs' pace: its list is levelled (within
        # what the decode list leaves of the partial and merge rows) and ordered for L2.
        room = PlanBounds(max_work_items=per_list.max_work_items,
                          max_partial_rows=_left(bounds.max_partial_rows, dec.num_partial_rows),
                          max_merge_rows=_left(bounds.max_merge_rows, dec.merge_count))
        pre = _schedule(pre_qo, kv, rows_per_tile=prefill.rows_per_tile,
                        num_ctas=prefill.num_ctas, kv_align=prefill.kv_align, lens32=pre_lens,
                        compute_bound=room, **common)
    if dec.merge_count == 0 and pre.merge_count == 0:
        # Nothing split (no partial rows either): nothing to renumber or merge.
        return BatchPlan(decode=dec, prefill=pre, merge_count=0, merge_indptr=ZERO_I32,
                         merge_slots=EMPTY_I32, merge_token=EMPTY_I32,
                         merge_head=EMPTY_I32, merge_request=EMPTY_I32, num_partial_rows=0)
    num_partial_rows = dec.num_partial_rows + pre.num_partial_rows
    _check_bound(bounds.max_partial_rows, "max_partial_rows", num_partial_rows,
                 "partial rows (split-KV states)")
    merge_count = dec.merge_count + pre.merge_count
    _check_bound(bounds.max_merge_rows, "max_merge_rows", merge_count, "merge rows")
    if not any_prefill:
        # Decode only: the decode list's merge rows already use the batch's numbering.
        return BatchPlan(decode=dec, prefill=pre, merge_count=merge_count,
                         merge_indptr=dec.merge_indptr, merge_slots=dec.merge_slots,
                         merge_token=dec.merge_token, merge_head=dec.merge_head,
                         merge_request=dec.merge_request, num_partial_rows=num_partial_rows)
    # Each sub-plan's qo_lens are the queries its list covers (0 for the other kernel's
    # requests). The prefill list's partial rows follow the decode list's.
    shift = dec.num_partial_rows
    pre = replace(pre, work_partial=frozen(
        np.where(pre.work_partial >= 0, pre.work_partial.astype(np.int64) + shift, -1)))
    indptr = np.concatenate((dec.merge_indptr, pre.merge_indptr[1:] + dec.merge_indptr[-1]))
    # A sub-plan numbers merge tokens from its own qo_lens (the other kernel's requests have
    # none there): move them to the batch's token numbering.
    qo_start = np.cumsum(qo) - qo
    tokens = []
    for sub in (dec, pre):
        sub_start = np.cumsum(sub.qo_lens) - sub.qo_lens
        tokens.append(sub.merge_token + (qo_start - sub_start)[sub.merge_request])
    return BatchPlan(
        decode=dec, prefill=pre, merge_count=merge_count,
        merge_indptr=frozen(indptr),
        merge_slots=frozen(np.concatenate((dec.merge_slots,
                                           pre.merge_slots.astype(np.int64) + shift))),
        merge_token=frozen(np.concatenate(tokens)),
        merge_head=frozen(np.concatenate((dec.merge_head, pre.merge_head))),
        merge_request=frozen(np.concatenate((dec.merge_request, pre.merge_request))),
        num_partial_rows=num_partial_rows,
    )


@functools.lru_cache(maxsize=16)
def _list_bounds(max_work_items: int | None) -> PlanBounds:
    """One list's bounds in plan_mixed: work items only (the others cap both lists)."""
    return PlanBounds(max_work_items=max_work_items)


def _left(capacity: int | None, used: int) -> int | None:
    return None if capacity is None else capacity - used


def worst_case_mixed_bounds(*, max_batch_size: int, max_total_q: int, num_kv_heads: int,
                            group_size: int, decode: Tiling, prefill: Tiling) -> PlanBounds:
    """Capacities no batch within (max_batch_size, max_total_q) exceeds in `plan_mixed` with
    the automatic chunk bound: each list is a plan_batch over a sub-batch, so
    `worst_case_bounds` holds for it; work items are per list (the larger of the two), partial
    and merge rows add up (merge rows also never exceed one per (token, head))."""
    dec, pre = (worst_case_bounds(max_batch_size=max_batch_size, max_total_q=max_total_q,
                                  num_kv_heads=num_kv_heads, group_size=group_size,
                                  rows_per_tile=t.rows_per_tile, num_ctas=t.num_ctas)
                for t in (decode, prefill))
    return PlanBounds(
        max_batch_size=max_batch_size, max_total_q=max_total_q,
        max_work_items=max(dec.max_work_items, pre.max_work_items),
        max_partial_rows=dec.max_partial_rows + pre.max_partial_rows,
        max_merge_rows=min(max_total_q * num_kv_heads * group_size,
                           dec.max_merge_rows + pre.max_merge_rows),
    )
