"""The planner's trimming step: each work unit's KV span cut to the tiles its mask shows.

Step 1 of `attnlang.runtime.planner`: every (unit, KV tile) pair is classed by the mask
analysis (`attnlang.codegen.mask_tiles.classify_tiles`) at the unit's query positions in one
vectorised call; a unit keeps the span from its first to its last tile with a visible pair,
and is costed by the positions of its visible tiles (`Trim.visible_between`). Sound: EMPTY
means every pair of the tile is masked for any params.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

__all__ = ["TRIM_TILE", "Trim", "trim", "reads_head"]

# KV tiles of the planner's mask analysis: at least this many keys (a multiple of the
# kernel's KV tile, so trimmed spans start on kernel tile boundaries). Coarser tiles make
# fewer (unit, tile) pairs to classify; the kernel still skips its own finer EMPTY tiles.
# A per-pair mask's layout can hide its blocks from coarse tiles (a random layout of 64 x 64
# blocks leaves 75% of 128-key tiles non-EMPTY, 50% of 64-key ones), so costs follow its
# finer tiles, at twice the classification time.
TRIM_TILE = 128
TRIM_TILE_PAIRS = 64


@dataclass(frozen=True, eq=False)
class Trim:
    """Per unit: KV span [span0, span1) and, per (unit, tile) pair, visible positions."""

    span0: np.ndarray | None  # None: all 0 (no unit needed tiles)
    span1: np.ndarray
    tile: int
    pair_off: np.ndarray | None  # [units] first pair of the unit's representative
    ntile: np.ndarray | None  # [units], 0: untiled (FULL or EMPTY as a whole)
    cum: np.ndarray | None  # [pairs + 1] prefix sums of visible positions; None: no tiles

    def visible_between(self, unit, kv0, kv1) -> np.ndarray:
        """Positions of non-EMPTY tiles in [kv0, kv1) (tile-granular: a chunk boundary
        inside a tile counts that tile in full, capped at the chunk length). unit: the
        unit of each range; None: one range per unit, in unit order."""
        if self.cum is None:  # no unit needed tiles
            return kv1 - kv0
        ntile = self.ntile if unit is None else self.ntile[unit]
        tiled = ntile > 0  # else the unit's span is all FULL (or empty)
        t0 = np.where(tiled, kv0 // self.tile, 0)
        t1 = np.minimum(-(-kv1 // self.tile), ntile)
        off = self.pair_off if unit is None else self.pair_off[unit]
        vis = self.cum[off + np.maximum(t1, t0)] - self.cum[off + t0]
        return np.where(tiled, np.minimum(vis, kv1 - kv0), kv1 - kv0)

    def kv_at(self, unit, kv0, amount) -> np.ndarray:
        """Per range: the first tile boundary after kv0 (a tile boundary) with `amount`
        (> 0) visible positions between them by visible_between's count; past the unit's
        last tile, that tile's end. unit: as visible_between's."""
        aligned = kv0 + -(-amount // self.tile) * self.tile  # every position visible
        if self.cum is None:
            return aligned
        ntile = self.ntile if unit is None else self.ntile[unit]
        off = self.pair_off if unit is None else self.pair_off[unit]
        t0 = np.minimum(kv0 // self.tile, ntile)
        reached = np.searchsorted(self.cum, self.cum[off + t0] + amount, side="left") - off
        return np.where(ntile > 0, np.clip(reached, t0 + 1, ntile) * self.tile, aligned)


@functools.cache
def _mask_tiles():
    """attnlang.codegen.mask_tiles, imported on first use (an import statement per call
    costs microseconds)."""
    from attnlang.codegen import mask_tiles

    return mask_tiles


def reads_head(mask) -> bool:
    """Whether the mask reads `head` or `kv_head` (memoized per mask object: plan() asks
    with the same mask every call)."""
    hit = _READS_HEAD.get(id(mask))
    if hit is None or hit[0] is not mask:
        if len(_READS_HEAD) >= 64:
            _READS_HEAD.clear()
        names = _mask_names(mask, set())
        hit = _READS_HEAD[id(mask)] = (mask, "head" in names or "kv_head" in names)
    return hit[1]


# id(mask) -> (mask, reads head): the mask is kept so its id cannot be reused meanwhile.
_READS_HEAD: dict[int, tuple[Any, bool]] = {}


def _mask_names(e, out: set) -> set:
    """Names of the Vars an IR expression reads (walks dataclass fields)."""
    from attnlang import ir

    if isinstance(e, ir.Var):
        out.add(e.name)
    elif isinstance(e, (tuple, list)):
        for x in e:
            _mask_names(x, out)
    elif isinstance(e, ir.Expr):
        for f in fields(e):
            if f.name != "span":
                _mask_names(getattr(e, f.name), out)
    return out


def trim(mask, qo, kv, u, group_size, num_kv_heads, head_dim, kv_align,
          pairs=None) -> Trim:
    """Classify every (unit, KV tile) pair with the mask analysis at the unit's query
    positions (q_pos = kv_len - qo_len + fused_row // group) in one vectorised call, and
    trim each unit to its first .. last non-EMPTY tile. Sound: the analysis is conservative
    (EMPTY means every pair of the tile is masked for any params), so only tiles without a
    visible pair leave the span. A unit with no non-EMPTY tile gets the empty span [0, 0):
    one item that writes its rows' o = 0 / lse = -inf. Units of different KV heads share
    the classification when the mask reads neither `head` nor `kv_head`."""
    mt = _mask_tiles()
    EMPTY, FULL, PARTIAL, TileEnv, classify_tiles = (  # noqa: N806
        mt.EMPTY, mt.FULL, mt.PARTIAL, mt.TileEnv, mt.classify_tiles)
    tile = -(-(TRIM_TILE_PAIRS if pairs else TRIM_TILE) // kv_align) * kv_align
    ci, req, qo_c, lo, hi, kvh = u.classes(qo, reads_head(mask))
    kv_len = kv[req]
    q_first = kv_len - qo_c
    q_lo, q_hi = q_first + lo, q_first + hi
    num_cls = req.shape[0]
    geometry = dict(num_heads=num_kv_heads * group_size, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, pairs=pairs)
    # Level 0: the unit's whole range. FULL (causal decode) or EMPTY needs no tiles.
    whole = classify_tiles(mask, TileEnv(q_lo=q_lo, q_hi=q_hi, kv_lo=_ZERO_POS,
                                         kv_hi=kv_len - 1, batch=req, kv_head=kvh,
                                         qo_len=qo_c, kv_len=kv_len, **geometry))
    tiled = whole == PARTIAL
    if not tiled.any():
        s1 = np.where(whole == FULL, kv_len, 0)[ci]
        return Trim(span0=None, span1=s1, tile=tile, pair_off=None, ntile=None, cum=None)
    ntile_c = np.where(tiled, -(-kv_len // tile), 0)
    p_of = np.repeat(np.arange(num_cls, dtype=np.int64), ntile_c)
    first_pair = np.cumsum(ntile_c) - ntile_c
    t = np.arange(p_of.shape[0], dtype=np.int64) - first_pair[p_of]
    kv_lo = t * tile
    kv_hi = np.minimum(kv_lo + tile, kv_len[p_of]) - 1
    env = TileEnv(q_lo=q_lo[p_of], q_hi=q_hi[p_of], kv_lo=kv_lo, kv_hi=kv_hi,
                  batch=req[p_of], kv_head=kvh[p_of], qo_len=qo_c[p_of],
                  kv_len=kv_len[p_of], **geometry)
    visible = (classify_tiles(mask, env) != EMPTY) if p_of.size else np.zeros(0, bool)
    vis_pos = np.where(visible, kv_hi - kv_lo + 1, 0)
    cum = np.concatenate(([0], np.cumsum(vis_pos)))
    # First / last non-EMPTY tile per classified unit (pairs are ordered (unit, tile)).
    nz = np.flatnonzero(visible)
    nz_unit = p_of[nz]
    has = np.zeros(num_cls, dtype=bool)
    t_first = np.zeros(num_cls, dtype=np.int64)
    t_last = np.full(num_cls, -1, dtype=np.int64)
    if nz.size:
        starts = np.flatnonzero(np.diff(nz_unit, prepend=-1))
        ends = np.append(starts[1:], nz.size) - 1
        w = nz_unit[starts]
        has[w] = True
        t_first[w] = t[nz[starts]]
        t_last[w] = t[nz[ends]]
    s0_c = np.where(has, t_first * tile, 0)
    s1_c = np.where(has, np.minimum((t_last + 1) * tile, kv_len), 0)
    s1_c = np.where(whole == FULL, kv_len, s1_c)  # untiled: FULL whole range, EMPTY [0, 0)
    # Map every unit to its classified representative.
    return Trim(span0=s0_c[ci], span1=s1_c[ci], tile=tile, pair_off=first_pair[ci],
                 ntile=ntile_c[ci], cum=cum)


_ZERO_POS = np.zeros((), dtype=np.int64)  # kv_lo of every whole range (broadcasts)
_ZERO_POS.setflags(write=False)
