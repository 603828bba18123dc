"""Mask analysis: classify a whole tile of (query, key) pairs from the variant's mask.

A tile is the box q_pos in [q_lo, q_hi] x kv_pos in [kv_lo, kv_hi]. Evaluating the mask
expression over intervals instead of numbers gives, soundly, one of

    EMPTY   every pair of the tile is masked: skip the tile (no loads, no math)
    PARTIAL some may be visible: evaluate the mask per element
    FULL    every pair is visible: skip the per-element mask

This recognises causal, sliding windows, sinks, prefix lengths and their and/or/not
combinations without pattern matching, and stays correct (PARTIAL) on anything it cannot
bound. The same interval semantics exist twice:

- `classify_tiles` (NumPy, vectorised over many tiles) for the planner, which knows the
  lengths but not the run-time params (they come at run()): params are unbounded there.
- `lower_mask_tile` (C++ text) for the kernels, which know the params too: the body of
  `variant::mask_tile(q_lo, q_hi, kv_lo, kv_hi, params, ix)` returning 0/1/2.

Ints are exact. Float sub-expressions are bounded with a safety margin before any
comparison (the kernel computes them in float32 with fast intrinsics), so a float boundary
only ever costs a PARTIAL tile, never a wrong skip.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnlang import ir
from attnlang.ir import BOOL, FLOAT

__all__ = ["EMPTY", "PARTIAL", "FULL", "TileEnv", "classify_tiles", "lower_mask_tile",
           "lower_interval", "interval_of"]

EMPTY, PARTIAL, FULL = 0, 1, 2
_INT_TOP = 1 << 40  # bounds of an unknown int: far beyond any position or length
_INT32 = 1 << 31  # int() saturates at -2^31 and 2^31 - 1
_FLOAT_MARGIN_REL, _FLOAT_MARGIN_ABS = 1e-4, 1e-6


@dataclass
class TileEnv:
    """What is known about a batch of tiles; arrays broadcast against each other.

    q_lo..kv_hi: inclusive position bounds. batch, kv_head, qo_len, kv_len: per tile.
    group: num_heads // num_kv_heads (the query heads of kv_head are a range). pairs: the
    per-pair masks plan() was given, by name (`pairmask.PairBlocks`): their tiles are classed
    by the blocks; without them a per-pair read is unknown (PARTIAL).
    """

    q_lo: np.ndarray
    q_hi: np.ndarray
    kv_lo: np.ndarray
    kv_hi: np.ndarray
    batch: np.ndarray
    kv_head: np.ndarray
    qo_len: np.ndarray
    kv_len: np.ndarray
    num_heads: int
    num_kv_heads: int
    head_dim: int
    pairs: Mapping[str, Any] | None = None


def classify_tiles(mask: ir.Expr | None, env: TileEnv) -> np.ndarray:
    """EMPTY/PARTIAL/FULL (int8) for every tile of env; FULL everywhere without a mask.

    >>> import attnlang as al
    >>> m = al.parse("variant c\\nmask = causal").mask
    >>> a = lambda *x: np.array(x)
    >>> env = TileEnv(a(0, 64), a(63, 127), a(64, 0), a(127, 63), a(0, 0), a(0, 0),
    ...               a(128, 128), a(128, 128), 32, 8, 128)
    >>> classify_tiles(m, env).tolist()   # tile above the diagonal, tile below it
    [0, 2]
    """
    shape = np.broadcast(env.q_lo, env.q_hi, env.kv_lo, env.kv_hi, env.batch).shape
    if mask is None:
        return np.full(shape, FULL, np.int8)
    tri = _NumpyIntervals(env).tri(mask)
    if tri.shape == shape:  # already a fresh array of every tile: no broadcast, no copy
        return tri.astype(np.int8, copy=False)
    return np.broadcast_to(tri, shape).astype(np.int8)


def interval_of(e: ir.Expr, env: TileEnv):
    """(lo, hi) arrays bounding the int or float e over every tile of env (params unknown)."""
    return _NumpyIntervals(env).iv(e)


class _NumpyIntervals:
    """Interval evaluation over NumPy arrays: ints as int64 (lo, hi), floats as float64
    (lo, hi), bools as tri-states (0 false, 1 unknown, 2 true)."""

    def __init__(self, env: TileEnv):
        self.env = env

    def point(self, x):
        x = np.asarray(x)
        return x, x

    def top(self, ty):
        if ty is FLOAT:
            return np.asarray(-np.inf), np.asarray(np.inf)
        return np.asarray(-_INT_TOP), np.asarray(_INT_TOP)

    def tri(self, e: ir.Expr) -> np.ndarray:
        if isinstance(e, ir.Const):
            return np.asarray(FULL if e.value else EMPTY, np.int8)
        if isinstance(e, ir.Unary):  # not
            return 2 - self.tri(e.x)
        if isinstance(e, ir.Binary) and e.op in ("and", "or"):
            a, b = self.tri(e.a), self.tri(e.b)
            return np.minimum(a, b) if e.op == "and" else np.maximum(a, b)
        if isinstance(e, ir.Binary):  # comparison
            if e.a.type is BOOL:
                a, b = self.tri(e.a), self.tri(e.b)
                known = (a != PARTIAL) & (b != PARTIAL)
                same = np.where(known, np.where(a == b, FULL, EMPTY), PARTIAL)
                return same if e.op == "==" else 2 - same
            return _compare(e.op, self.iv(e.a), self.iv(e.b), e.a.type is FLOAT)
        if isinstance(e, ir.Call) and e.fn == "where":
            c, a, b = self.tri(e.args[0]), self.tri(e.args[1]), self.tri(e.args[2])
            either = np.where(a == b, a, PARTIAL)
            return np.where(c == FULL, a, np.where(c == EMPTY, b, either)).astype(np.int8)
        pairs = self.env.pairs
        if (isinstance(e, ir.ParamIndex) and e.extents == ir.PAIR_EXTENTS and pairs
                and e.name in pairs):  # indexed (q_row, kv_pos): the checker's rule
            env = self.env
            first_row = env.kv_len - env.qo_len
            return pairs[e.name].classify(env.batch, env.q_lo - first_row, env.q_hi - first_row,
                                          env.kv_lo, env.kv_hi)
        return np.asarray(PARTIAL, np.int8)  # a bool param or anything unforeseen

    def iv(self, e: ir.Expr):
        env = self.env
        if isinstance(e, ir.Const):
            return self.point(e.value)
        if isinstance(e, ir.Var):
            if e.name == "q_pos":
                return env.q_lo, env.q_hi
            if e.name == "kv_pos":
                return env.kv_lo, env.kv_hi
            if e.name == "head":
                group = env.num_heads // env.num_kv_heads
                return env.kv_head * group, env.kv_head * group + group - 1
            known = {"batch": env.batch, "kv_head": env.kv_head, "qo_len": env.qo_len,
                     "kv_len": env.kv_len, "num_heads": env.num_heads,
                     "num_kv_heads": env.num_kv_heads, "head_dim": env.head_dim}
            if e.name in known:
                return self.point(known[e.name])
            return self.top(e.type)  # sm_scale: a run-time float
        if isinstance(e, (ir.Param, ir.ParamIndex)):
            return self.top(e.type)  # params are known only at run()
        if isinstance(e, ir.Cast):
            lo, hi = self.iv(e.x)
            return lo.astype(np.float64), hi.astype(np.float64)
        if isinstance(e, ir.Unary):
            lo, hi = self.iv(e.x)
            return (-hi - 1, -lo - 1) if e.op == "~" else (-hi, -lo)
        if isinstance(e, ir.Binary):
            return _arith(e.op, self.iv(e.a), self.iv(e.b), e.type, self.top(e.type))
        if isinstance(e, ir.Call):
            return self.call(e)
        return self.top(e.type)

    def call(self, e: ir.Call):
        if e.fn == "where":
            c = self.tri(e.args[0])
            (alo, ahi), (blo, bhi) = self.iv(e.args[1]), self.iv(e.args[2])
            lo = np.where(c == FULL, alo, np.where(c == EMPTY, blo, np.minimum(alo, blo)))
            hi = np.where(c == FULL, ahi, np.where(c == EMPTY, bhi, np.maximum(ahi, bhi)))
            return lo, hi
        args = [self.iv(a) for a in e.args]
        if e.fn == "mod" and e.type is not FLOAT:
            (alo, ahi), (blo, bhi) = args
            point = blo == bhi
            c = np.where(point & (blo != 0), blo, 1)
            pos_inside = (c > 0) & (alo >= 0) & (ahi < c)
            neg_inside = (c < 0) & (ahi <= 0) & (alo > c)
            lo = np.where(c > 0, 0, c + 1)
            hi = np.where(c > 0, c - 1, 0)
            # Within one period (one floor quotient), mod(x, c) grows with x.
            q = alo // c
            period = (q == ahi // c) & (blo != 0)
            lo = np.where(period, alo - q * c, np.where(pos_inside | neg_inside, alo, lo))
            hi = np.where(period, ahi - q * c, np.where(pos_inside | neg_inside, ahi, hi))
            lo, hi = np.where(blo == 0, 0, lo), np.where(blo == 0, 0, hi)
            return np.where(point, lo, -_INT_TOP), np.where(point, hi, _INT_TOP)
        if e.fn in ("min", "max"):
            f = np.minimum if e.fn == "min" else np.maximum
            return f(args[0][0], args[1][0]), f(args[0][1], args[1][1])
        if e.fn == "clamp":
            (xlo, xhi), (llo, lhi), (hlo, hhi) = args
            return np.minimum(np.maximum(xlo, llo), hhi), np.minimum(np.maximum(xhi, lhi), hhi)
        if e.fn == "abs":
            lo, hi = args[0]
            straddles = (lo < 0) & (hi > 0)
            return (np.where(straddles, 0, np.minimum(abs(lo), abs(hi))),
                    np.maximum(abs(lo), abs(hi)))
        if e.fn in _MONOTONE_UP:
            lo, hi = args[0]
            with np.errstate(all="ignore"):
                return _MONOTONE_UP[e.fn](lo), _MONOTONE_UP[e.fn](hi)
        if e.fn in ("log", "log2"):  # grows on [0, inf); a negative argument gives NaN
            lo, hi = args[0]
            f = np.log if e.fn == "log" else np.log2
            with np.errstate(all="ignore"):
                ok = lo >= 0
                return np.where(ok, f(np.where(ok, lo, 1.0)), -np.inf), np.where(ok, f(hi), np.inf)
        if e.fn == "int":  # truncation, saturating at int32, of the widened float
            lo, hi = _widen(*args[0])
            return _trunc_int32(lo, -_INT32), _trunc_int32(hi, _INT32 - 1)
        return self.top(e.type)


_MONOTONE_UP = {
    "floor": np.floor, "ceil": np.ceil, "exp": np.exp, "exp2": np.exp2, "tanh": np.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "softplus": lambda x: np.logaddexp(0.0, x),
}


def _arith(op, a, b, ty, top):
    (alo, ahi), (blo, bhi) = a, b
    if op == "+":
        return alo + blo, ahi + bhi
    if op == "-":
        return alo - bhi, ahi - blo
    if op == "*":
        with np.errstate(all="ignore"):
            corners = np.stack(np.broadcast_arrays(alo * blo, alo * bhi, ahi * blo, ahi * bhi))
        if ty is FLOAT:
            corners = np.where(np.isnan(corners), np.inf, corners)  # 0 * inf: unbounded
            lo = np.where(np.isinf(corners).any(0), -np.inf, corners.min(0))
            return lo, np.where(np.isinf(corners).any(0), np.inf, corners.max(0))
        return np.clip(corners.min(0), -_INT_TOP, _INT_TOP), np.clip(corners.max(0), -_INT_TOP,
                                                                    _INT_TOP)
    if op == "/" and ty is not FLOAT:
        # Truncating division by a known nonzero divisor is monotone in the dividend.
        point = (blo == bhi) & (blo != 0)
        c = np.where(point, blo, 1)
        q1, q2 = np.trunc(alo / c).astype(np.int64), np.trunc(ahi / c).astype(np.int64)
        zero = (blo == bhi) & (blo == 0)  # run-time division by zero yields 0
        lo = np.where(point, np.minimum(q1, q2), np.where(zero, 0, top[0]))
        hi = np.where(point, np.maximum(q1, q2), np.where(zero, 0, top[1]))
        return lo, hi
    if op == "/":
        positive, negative = blo > 0, bhi < 0
        with np.errstate(all="ignore"):
            corners = np.stack(np.broadcast_arrays(alo / blo, alo / bhi, ahi / blo, ahi / bhi))
        ok = (positive | negative) & ~np.isnan(corners).any(0)
        return np.where(ok, corners.min(0), -np.inf), np.where(ok, corners.max(0), np.inf)
    if op == "//" and ty is not FLOAT:
        # Floor division by a fixed divisor is monotone in the dividend.
        point = blo == bhi
        c = np.where(point & (blo != 0), blo, 1)
        q1, q2 = alo // c, ahi // c
        zero = point & (blo == 0)  # run-time division by zero yields 0
        lo = np.where(point, np.where(zero, 0, np.minimum(q1, q2)), top[0])
        hi = np.where(point, np.where(zero, 0, np.maximum(q1, q2)), top[1])
        return lo, hi
    if op == "%" and ty is not FLOAT:
        # |x % c| < |c| and x % c has the sign of x (C semantics); within one period of one
        # sign (one truncated quotient), x % c grows with x.
        point = (blo == bhi) & (blo != 0)
        m = np.where(point, np.abs(blo) - 1, _INT_TOP)
        lo = np.where(alo >= 0, 0, -m)
        hi = np.where(ahi <= 0, 0, m)
        c = np.where(point, blo, 1)
        q_lo, q_hi = np.trunc(alo / c).astype(np.int64), np.trunc(ahi / c).astype(np.int64)
        period = point & ((alo >= 0) | (ahi <= 0)) & (q_lo == q_hi)
        return np.where(period, alo - q_lo * c, lo), np.where(period, ahi - q_hi * c, hi)
    return top


def _trunc_int32(x, nan_bound: int):
    """x truncated toward zero and clamped to int32 (int64); a NaN bound becomes nan_bound."""
    with np.errstate(all="ignore"):
        x = np.clip(np.nan_to_num(np.where(np.isnan(x), nan_bound, x)), -_INT32, _INT32 - 1)
        return np.trunc(x).astype(np.int64)


def _widen(lo, hi):
    """A float interval widened by the margin that covers the kernel's float32 arithmetic
    with fast intrinsics (comparisons and int() take it)."""
    with np.errstate(all="ignore"):
        m = _FLOAT_MARGIN_REL * np.maximum(abs(lo), abs(hi)) + _FLOAT_MARGIN_ABS
        return lo - m, hi + m


def _compare(op, a, b, is_float):
    (alo, ahi), (blo, bhi) = a, b
    if is_float:  # widen: the kernel computes floats in float32 with fast intrinsics
        (alo, ahi), (blo, bhi) = _widen(alo, ahi), _widen(blo, bhi)
    if op in (">", ">="):
        (alo, ahi), (blo, bhi), op = (blo, bhi), (alo, ahi), {">": "<", ">=": "<="}[op]
    if op == "<":
        out = np.where(ahi < blo, FULL, np.where(alo >= bhi, EMPTY, PARTIAL))
    elif op == "<=":
        out = np.where(ahi <= blo, FULL, np.where(alo > bhi, EMPTY, PARTIAL))
    else:
        disjoint = (ahi < blo) | (bhi < alo)
        same_point = (alo == ahi) & (blo == bhi) & (alo == blo) & (not is_float)
        eq = np.where(same_point, FULL, np.where(disjoint, EMPTY, PARTIAL))
        out = eq if op == "==" else 2 - eq
    bounds = (alo, ahi, blo, bhi)
    if all(np.asarray(x).dtype.kind in "iub" for x in bounds):  # no NaN (planner's usual case)
        return np.asarray(out).astype(np.int8)
    nan = np.isnan(np.stack(np.broadcast_arrays(*bounds)).astype(np.float64)).any(0)
    return np.where(nan, PARTIAL, out).astype(np.int8)


# ---- C++ ------------------------------------------------------------------------------------

# Interval helpers used by the lowered body (kernels_templates/mask_tiles.cuh defines them).
_CPP_ARITH = {"+": "iv_add", "-": "iv_sub", "*": "iv_mul", "/": "iv_div", "%": "iv_mod",
              "//": "iv_floordiv"}
_CPP_CMP = {"<": "tri_lt", "<=": "tri_le", ">": "tri_gt", ">=": "tri_ge", "==": "tri_eq",
            "!=": "tri_ne"}
_CPP_VAR = {"batch": "ix.batch", "kv_head": "ix.kv_head", "qo_len": "ix.qo_len",
            "kv_len": "ix.kv_len", "num_heads": "ix.num_heads",
            "num_kv_heads": "ix.num_kv_heads", "head_dim": "kHeadDim", "sm_scale": "ix.sm_scale"}


def lower_mask_tile(mask: ir.Expr | None, literal, param, table, span=None) -> str:
    """C++ expression (an int: 0 EMPTY, 1 PARTIAL, 2 FULL) classifying the tile whose bounds
    are the variables q_lo, q_hi, kv_lo, kv_hi, given `p` (Params) and `ix` (Index).

    The lowering's own rules render the leaves: `literal(const)` an ir.Const, `param(name)`
    a scalar param (or a per-pair mask's buffer), `table(e)` a tensor read whose indices
    are all `batch` / `kv_head`, and `span(e)` (optional) the class of a bool table read at
    kv_pos or q_pos along its last axis (`is_global[batch, kv_pos]`, `span_axis`) over the
    tile's keys or queries. A per-pair mask's class over the tile comes from the block
    summary plan() stored beside its bits (common.cuh, pair_tile).
    """
    if mask is None:
        return "2"
    return _CppIntervals(literal, param, table, span).tri(mask)


def lower_interval(e: ir.Expr, literal, param, table) -> str:
    """C++ expression (an IvI or IvF) bounding the int or float e over the tile, with the
    leaves rendered as for `lower_mask_tile` (`attnlang.codegen.tile_uniform` bounds the
    logits' integer terms with it)."""
    return _CppIntervals(literal, param, table).iv(e)


def span_axis(e: ir.ParamIndex) -> str | None:
    """'kv_pos' or 'q_pos' where e is a bool table read at that position along its last
    axis, its other indices one value per tile (`is_global[batch, kv_pos]`): the kernels
    class it over a tile by scanning that stretch of the row. Else None."""
    *rest, last = e.indices
    if (e.type is BOOL and isinstance(last, ir.Var) and last.name in ("kv_pos", "q_pos")
            and all(isinstance(i, ir.Const) or (isinstance(i, ir.Var) and i.name in
                                                _TILE_INVARIANT) for i in rest)):
        return last.name
    return None


# Index variables that are one value over a whole tile.
_TILE_INVARIANT = ("batch", "kv_head")


class _CppIntervals:
    def __init__(self, literal, param, table, span=None):
        self.literal = literal
        self.param = param
        self.table = table
        self.span = span

    def tri(self, e: ir.Expr) -> str:
        if isinstance(e, ir.Const):
            return "2" if e.value else "0"
        if isinstance(e, ir.Unary):
            return f"(2 - {self.tri(e.x)})"
        if isinstance(e, ir.Binary) and e.op in ("and", "or"):
            f = "tri_and" if e.op == "and" else "tri_or"
            return f"{f}({self.tri(e.a)}, {self.tri(e.b)})"
        if isinstance(e, ir.Binary):
            if e.a.type is BOOL:
                fn = "tri_same" if e.op == "==" else "tri_differ"
                return f"{fn}({self.tri(e.a)}, {self.tri(e.b)})"
            return f"{_CPP_CMP[e.op]}({self.iv(e.a)}, {self.iv(e.b)})"
        if isinstance(e, ir.Call) and e.fn == "where":
            c, a, b = (self.tri(x) for x in e.args)
            return f"tri_where({c}, {a}, {b})"
        if isinstance(e, ir.ParamIndex) and e.extents == ir.PAIR_EXTENTS:
            # The checker made its indices (q_row, kv_pos): the box in rows of the request.
            return (f"attnlang::pair_tile({self.param(e.name)}, ix, q_lo - (ix.kv_len - "
                    f"ix.qo_len), q_hi - (ix.kv_len - ix.qo_len), kv_lo, kv_hi)")
        if isinstance(e, ir.ParamIndex) and self.span is not None and span_axis(e):
            return self.span(e)  # a per-token bool table: its row over the tile's positions
        return "1"

    def iv(self, e: ir.Expr) -> str:
        kind = "IvF" if e.type is FLOAT else "IvI"
        if isinstance(e, ir.Const):
            return f"{kind}::point({self.literal(e)})"
        if isinstance(e, ir.Var):
            if e.name == "q_pos":
                return "IvI{q_lo, q_hi}"
            if e.name == "kv_pos":
                return "IvI{kv_lo, kv_hi}"
            if e.name == "head":
                return "heads_of(ix)"
            return f"{kind}::point({_CPP_VAR[e.name]})"
        if isinstance(e, ir.Param):
            return f"{kind}::point({self.param(e.name)})"
        if isinstance(e, ir.ParamIndex):  # one value per tile only at batch / kv_head
            if all(isinstance(i, ir.Var) and i.name in _TILE_INVARIANT for i in e.indices):
                return f"{kind}::point({self.table(e)})"
            return f"{kind}::top()"
        if isinstance(e, ir.Cast):
            return f"to_float({self.iv(e.x)})"
        if isinstance(e, ir.Unary) and e.op == "~":  # ~x = -1 - x
            return f"iv_sub(IvI::point(-1), {self.iv(e.x)})"
        if isinstance(e, ir.Unary):
            return f"iv_neg({self.iv(e.x)})"
        if isinstance(e, ir.Binary) and e.op in _CPP_ARITH:
            return f"{_CPP_ARITH[e.op]}({self.iv(e.a)}, {self.iv(e.b)})"
        if isinstance(e, ir.Call):
            if e.fn == "where":
                c, a, b = self.tri(e.args[0]), self.iv(e.args[1]), self.iv(e.args[2])
                return f"iv_where({c}, {a}, {b})"
            if e.fn in ("min", "max", "abs", "clamp", "mod", "log", "log2", "int") \
                    or e.fn in _MONOTONE_UP:
                args = ", ".join(self.iv(a) for a in e.args)
                return f"iv_{'floormod' if e.fn == 'mod' else e.fn}({args})"
        return f"{kind}::top()"
