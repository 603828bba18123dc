"""A list's work units and merge rows: the arrays the planner (`planner`) cuts into work
items, and the (token, head) rows through which the merge kernel combines a split unit's
partial states. Also the frozen int32 arrays every plan holds.

A unit is one (request, KV head, row tile) of a list: its request's query rows fused with the
GQA group (query i, group member g -> fused row ``i * group_size + g``), cut into tiles of
``rows_per_tile``. Units depend on the qo lengths only, which successive decode steps repeat,
so the last few small sets are memoized.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

__all__ = ["WorkUnits", "work_units", "Merge", "NO_MERGE", "merge_rows", "frozen",
           "zeros_i32", "EMPTY_I32", "ZERO_I32"]


# Frozen int32 arrays: what a Plan holds (read-only, so that plans and memoized units can
# share them).

EMPTY_I32 = np.zeros(0, dtype=np.int32)
EMPTY_I32.setflags(write=False)
ZERO_I32 = np.zeros(1, dtype=np.int32)
ZERO_I32.setflags(write=False)


@functools.lru_cache(maxsize=16)
def zeros_i32(n: int) -> np.ndarray:
    """A shared read-only int32 array of n zeros (an empty list's work_indptr, qo_lens)."""
    out = np.zeros(n, dtype=np.int32)
    out.setflags(write=False)
    return out


def frozen(a: np.ndarray) -> np.ndarray:
    """a as a contiguous read-only int32 array of its own."""
    out = np.ascontiguousarray(a, dtype=np.int32)
    if out is a:
        out = out.copy()
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class WorkUnits:
    """The work units of one list, ordered (request, kv_head, row tile); [units] int64 each
    unless said otherwise.

    req, kvh, row0, rows: request, KV head, first fused row and fused rows of the unit.
    cls: index of the unit's (request, row tile), numbered in that order (units of different
    KV heads that share it see the same query positions). tiles [batch]: row tiles of each
    request; first [batch]: its first unit."""

    req: np.ndarray
    kvh: np.ndarray
    row0: np.ndarray
    rows: np.ndarray
    cls: np.ndarray
    tiles: np.ndarray
    first: np.ndarray
    group_size: int
    _classes: dict = field(default_factory=dict)

    def classes(self, qo, by_head: bool):
        """The units the mask analysis classifies (`plan_trim.trim`): every unit if by_head, else
        the kv_head 0 unit of each (request, row tile), which stands for all KV heads.
        Returns (ci, req, qo, q_lo, q_hi, kvh): ci [units] the classified unit standing for
        each unit, then per classified unit its request, qo_len, query offsets of its first
        and last fused row within the request, and KV head. Memoized (qo is the Units')."""
        hit = self._classes.get(by_head)
        if hit is None:
            if by_head:
                ci = cls_units = np.arange(self.req.shape[0], dtype=np.int64)
            else:
                ci, cls_units = self.cls, np.flatnonzero(self.kvh == 0)
            req, row0 = self.req[cls_units], self.row0[cls_units]
            g = self.group_size
            hit = (ci, req, qo[req], row0 // g, (row0 + self.rows[cls_units] - 1) // g,
                   self.kvh[cls_units])
            for a in hit:
                a.setflags(write=False)
            self._classes[by_head] = hit
        return hit


def work_units(qo, group_size, rows_per_tile, num_kv_heads) -> WorkUnits:
    """The units of requests with qo_len queries each (0: none). They depend on qo_lens
    only, which successive decode steps repeat: the last few (small) ones are memoized."""
    key = (qo.tobytes(), group_size, rows_per_tile, num_kv_heads)
    u = _UNITS.get(key)
    if u is None:
        u = _make_units(group_size * qo, group_size, rows_per_tile, num_kv_heads)
        if u.req.shape[0] <= _UNITS_MAX:
            if len(_UNITS) >= 8:
                _UNITS.clear()
            _UNITS[key] = u
    return u


_UNITS: dict[tuple, WorkUnits] = {}
_UNITS_MAX = 1 << 16  # units of a memoized entry, at most (a few MB)


def _make_units(fused, group_size, rows_per_tile, num_kv_heads) -> WorkUnits:
    tiles = -(-fused // rows_per_tile)  # 0 for qo_len == 0: no work
    per_req = tiles * num_kv_heads
    first = np.cumsum(per_req) - per_req
    if int(fused.max(initial=0)) <= rows_per_tile:
        # At most one row tile per request (decode): units are (request, kv_head) in order,
        # all starting at row 0. The general formulas below give the same arrays.
        unit = np.arange(int(per_req.sum()), dtype=np.int64)
        cls, kvh = unit // num_kv_heads, unit % num_kv_heads
        req = np.flatnonzero(tiles)[cls]
        return _frozen_units(req=req, kvh=kvh, row0=np.zeros_like(req), rows=fused[req],
                             cls=cls, tiles=tiles, first=first, group_size=group_size)
    req = np.repeat(np.arange(tiles.shape[0], dtype=np.int64), per_req)
    local = np.arange(req.shape[0], dtype=np.int64) - first[req]
    req_tiles = tiles[req]
    kvh = local // req_tiles
    tile = local % req_tiles
    row0 = tile * rows_per_tile
    rows = np.minimum(fused[req] - row0, rows_per_tile)
    cls = (np.cumsum(tiles) - tiles)[req] + tile
    return _frozen_units(req=req, kvh=kvh, row0=row0, rows=rows, cls=cls, tiles=tiles,
                         first=first, group_size=group_size)


def _frozen_units(group_size, **arrays) -> WorkUnits:
    for a in arrays.values():  # shared by later calls (memoized): never written
        a.setflags(write=False)
    return WorkUnits(group_size=group_size, **arrays)


@dataclass(frozen=True, eq=False)
class Merge:
    """A list's merge rows (Plan's merge_* fields): frozen int32 arrays and their count."""

    count: int
    indptr: np.ndarray
    slots: np.ndarray
    token: np.ndarray
    head: np.ndarray
    request: np.ndarray


NO_MERGE = Merge(0, ZERO_I32, EMPTY_I32, EMPTY_I32, EMPTY_I32, EMPTY_I32)


def merge_rows(qo, u, unit_split, unit_n, unit_first_item, item_partial,
                group_size, num_kv_heads) -> Merge:
    """The merge rows, ordered (request, token, head): every (token, head) of a split unit.

    The items of unit x are its unit_n[x] chunks in KV order from unit_first_item[x]; the
    partial row of its fused row f (token f // group, head kv_head * group + f % group) in
    chunk c is ``item_partial[unit_first_item[x] + c] + (f - row_start)``.
    """
    split = np.flatnonzero(unit_split)
    if not split.size:
        return NO_MERGE
    unit_rows = u.rows[split]
    unit = np.repeat(split, unit_rows)
    offset = np.arange(unit.shape[0], dtype=np.int64) - np.repeat(
        np.cumsum(unit_rows) - unit_rows, unit_rows)
    fused = u.row0[unit] + offset
    m_req = u.req[unit]
    token = (np.cumsum(qo) - qo)[m_req] + fused // group_size
    head = u.kvh[unit] * group_size + fused % group_size
    # Units run (request, kv_head, tile), so each KV head's rows are already in token order:
    # a stable sort (runs merged) puts them in (token, head) order.
    order = np.argsort(token * (num_kv_heads * group_size) + head, kind="stable")
    unit, offset, token, head, m_req = (a[order] for a in (unit, offset, token, head, m_req))
    n = unit_n[unit]
    indptr = np.zeros(n.shape[0] + 1, dtype=np.int64)
    np.cumsum(n, out=indptr[1:])
    # Slot of chunk c of merge row m: partial start of item (first item of unit + c) + offset.
    # Slot s = indptr[m] + c reads item s - (indptr[m] - first item of unit): per-row values
    # repeated over the row's slots (np.repeat is cheaper than gathers per slot).
    shift = np.repeat(indptr[:-1] - unit_first_item[unit], n)
    slots = item_partial[np.arange(shift.shape[0], dtype=np.int64) - shift] + np.repeat(offset, n)
    rows = np.array((token, head, m_req)).astype(np.int32)  # one conversion
    rows.setflags(write=False)
    return Merge(count=int(m_req.shape[0]), indptr=frozen(indptr), slots=frozen(slots),
                  token=rows[0], head=rows[1], request=rows[2])
