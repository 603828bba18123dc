"""What a plan is: the work list of one batch (`Plan`, laid out as docs/INTERNALS.md says),
the cost of one work item it is balanced by, the workspace capacities it must fit
(`PlanBounds`) and the errors of planning (`PlanError`, `CapacityError`). How a plan is made
is `attnlang.runtime.planner`'s business (which re-exports these names)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

__all__ = ["ROW_COST", "KV_COST", "PlanError", "CapacityError", "PlanBounds", "Plan",
           "item_rows"]

# Cost model of one work item: ROW_COST * fused rows + KV_COST * KV positions, in units of
# "one KV position": reading one K row and one V row (4 * head_dim bytes at 16 bit). A query
# row costs about the same per item (load q, write o or its partial, finish the softmax),
# doubled because a row's epilogue does not overlap the KV stream as well.
ROW_COST = 2
KV_COST = 1


class PlanError(ValueError):
    """A batch description the planner cannot schedule (bad lengths or arguments)."""


class CapacityError(PlanError):
    """The batch needs more workspace than the capacity fixed at construction.

    `bound` names the capacity (a BatchAttention constructor argument), `needed` and
    `capacity` the sizes.
    """

    def __init__(self, bound: str, needed: int, capacity: int, what: str):
        self.bound, self.needed, self.capacity = bound, needed, capacity
        super().__init__(
            f"this batch needs {needed} {what} but the workspace holds {capacity} "
            f"({bound}={capacity}); the capacity is fixed when BatchAttention is built so its "
            f"buffers never move (CUDA graphs): build it with {bound}={needed} or more"
        )


@dataclass(frozen=True)
class PlanBounds:
    """Capacities of the device workspace; None means unbounded (planner-only use).

    Example: ``PlanBounds(max_batch_size=256, max_total_q=8192, max_work_items=40000,
    max_partial_rows=16896, max_merge_rows=8448)``.
    """

    max_batch_size: int | None = None
    max_total_q: int | None = None
    max_work_items: int | None = None
    max_partial_rows: int | None = None
    max_merge_rows: int | None = None


@dataclass(frozen=True, eq=False)
class Plan:
    """The work list of one batch, as docs/INTERNALS.md lays it out.

    Work items (W of them), grouped by CTA: CTA c runs items
    ``work_indptr[c] .. work_indptr[c+1]-1``. Item w covers fused rows
    ``[work_row_start[w], min(work_row_start[w] + rows_per_tile, qo_len * group_size))`` of
    request ``work_request[w]`` for KV head ``work_kv_head[w]``, over KV positions
    ``[work_kv_start[w], work_kv_end[w])``; ``work_partial[w]`` is -1 (write the output) or
    the first of its partial rows.

    Merge rows (M = merge_count), one per (token, query head) of every split request:
    ``merge_slots[merge_indptr[m]:merge_indptr[m+1]]`` are its partial rows in KV order,
    ``merge_token[m]`` its row of q/out, ``merge_head[m]`` its query head,
    ``merge_request[m]`` its request.

    All arrays are contiguous read-only int32. Shapes: work_indptr [num_ctas+1], work_* [W],
    merge_indptr [M+1], merge_slots [num_partial_rows], merge_token/head/request [M].
    """

    num_ctas: int
    num_kv_heads: int
    group_size: int
    rows_per_tile: int
    kv_chunk_size: int  # the KV chunk bound this plan used
    qo_lens: np.ndarray  # [batch] int32
    kv_lens: np.ndarray  # [batch] int32
    work_indptr: np.ndarray
    work_request: np.ndarray
    work_kv_head: np.ndarray
    work_row_start: np.ndarray
    work_kv_start: np.ndarray
    work_kv_end: np.ndarray
    work_partial: np.ndarray
    merge_count: int
    merge_indptr: np.ndarray
    merge_slots: np.ndarray
    merge_token: np.ndarray
    merge_head: np.ndarray
    merge_request: np.ndarray
    num_partial_rows: int

    @property
    def batch_size(self) -> int:
        return int(self.qo_lens.shape[0])

    @property
    def total_q(self) -> int:
        return int(self.qo_lens.sum())

    @property
    def num_work_items(self) -> int:
        return int(self.work_request.shape[0])

    @property
    def num_split_requests(self) -> int:
        split = np.unique(self.work_request[self.work_partial >= 0])
        return int(split.shape[0])

    def work_arrays(self) -> dict[str, np.ndarray]:
        """The decode kernel's plan arguments, in kernel-argument order."""
        return {
            "work_indptr": self.work_indptr, "work_request": self.work_request,
            "work_kv_head": self.work_kv_head, "work_row_start": self.work_row_start,
            "work_kv_start": self.work_kv_start, "work_kv_end": self.work_kv_end,
            "work_partial": self.work_partial,
        }

    def merge_arrays(self) -> dict[str, np.ndarray]:
        """The merge kernel's plan arguments (after merge_count), in kernel-argument order."""
        return {
            "merge_indptr": self.merge_indptr, "merge_slots": self.merge_slots,
            "merge_token": self.merge_token, "merge_head": self.merge_head,
            "merge_request": self.merge_request,
        }

    def cta_costs(self) -> np.ndarray:
        """Cost (ROW_COST * rows + KV_COST * kv) accumulated by each CTA, [num_ctas] int64."""
        rows = item_rows(self.qo_lens[self.work_request] * self.group_size,
                          self.work_row_start, self.rows_per_tile)
        cost = ROW_COST * rows + KV_COST * (self.work_kv_end - self.work_kv_start).astype(np.int64)
        cta = np.repeat(np.arange(self.num_ctas), np.diff(self.work_indptr))
        return np.bincount(cta, weights=cost, minlength=self.num_ctas).astype(np.int64)

    def same_as(self, other: Plan) -> bool:
        """True if both plans hold identical values (the determinism check)."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray):
                if a.dtype != b.dtype or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True


def item_rows(fused_rows: np.ndarray, row_start: np.ndarray, rows_per_tile: int) -> np.ndarray:
    """The fused rows of each work item: its request's rows from row_start, at most a tile."""
    return np.minimum(fused_rows.astype(np.int64) - row_start, rows_per_tile)
