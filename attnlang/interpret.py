"""The NumPy interpreter of the typed IR: one expression's value over a grid of indices.

The reference (`attnlang.reference`) evaluates each stage of a request with it, on a grid
whose axes are the index variables the stage sees (see its docstring). One recursive
evaluator walks the tree; which NumPy function implements an operator or builtin is a table,
not a visitor per node (`_UNARY`, `_BINARY`, `_INT_BINARY`, `_CALLS`, `_REDUCE`). Ints are
int64 here (the kernels' int32 wrap is reproduced where the language defines it: shifts);
floats run in the scope's precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from attnlang import ir

__all__ = ["Scope", "evaluate", "stage_value"]


# ----------------------------------------------------------------------------------------
# The tables: IR operator / builtin name -> NumPy implementation.
# ----------------------------------------------------------------------------------------


def _c_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division truncating toward zero (C), unlike Python's floor division."""
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q)


def _floor_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`//`: floor division; on ints a zero divisor yields 0 (as `/`); on floats floor(a / b)."""
    if a.dtype.kind == "f":
        return np.floor(a / b)
    return np.floor_divide(a, np.where(b == 0, 1, b)) * (b != 0)


def _floor_mod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`mod(a, b)`: a - b * (a // b), the sign of b (Python's %); an int zero divisor gives 0."""
    if a.dtype.kind == "f":
        return a - b * np.floor(a / b)
    return np.mod(a, np.where(b == 0, 1, b)) * (b != 0)


def _int32(x: np.ndarray) -> np.ndarray:
    """Wrap to int32 (two's complement), as the kernels' int arithmetic does."""
    return np.asarray(x).astype(np.int64).astype(np.int32).astype(np.int64)


def _shift_left(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    inside = (n >= 0) & (n <= 31)
    return np.where(inside, _int32(np.left_shift(a, np.where(inside, n, 0))), 0)


def _shift_right(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    inside = (n >= 0) & (n <= 31)
    return np.where(inside, np.right_shift(a, np.where(inside, n, 0)), np.where(a < 0, -1, 0))


def _to_int(x: np.ndarray) -> np.ndarray:
    """`int(x)`: toward zero, saturating at the int32 range, NaN -> 0."""
    x = np.asarray(x, np.float64)
    clipped = np.clip(np.nan_to_num(x, nan=0.0), -2.0**31, 2.0**31 - 1)
    return np.trunc(clipped).astype(np.int64)


_erf = np.frompyfunc(math.erf, 1, 1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for very negative x and 1 / inf = 0, the right limit.
    return np.reciprocal(1 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    # log(1 + exp(x)) without overflow: log(exp(0) + exp(x)).
    return np.logaddexp(np.zeros_like(x), x)


def _clamp(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return np.minimum(np.maximum(x, lo), hi)


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "-": np.negative,
    "~": np.invert,
    "not": np.logical_not,
}

# Arithmetic on floats; `%` is C's fmod (sign of the dividend) for floats and ints alike.
_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide, "%": np.fmod,
    "**": np.power,
    "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
    "==": np.equal, "!=": np.not_equal,
    "and": np.logical_and, "or": np.logical_or, "//": _floor_div,
    "&": np.bitwise_and, "|": np.bitwise_or, "^": np.bitwise_xor,
    "<<": _shift_left, ">>": _shift_right,
}
# Where two ints differ from the float table.
_INT_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {"/": _c_div}
_COMPARISONS = frozenset({"<", "<=", ">", ">=", "==", "!="})
_LOGIC = frozenset({"and", "or"})

_CALLS: dict[str, Callable[..., np.ndarray]] = {
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sqrt": np.sqrt,
    "rsqrt": lambda x: np.reciprocal(np.sqrt(x)), "tanh": np.tanh, "sigmoid": _sigmoid,
    "abs": np.abs, "floor": np.floor, "ceil": np.ceil, "softplus": _softplus,
    # fmin/fmax: a NaN operand is ignored, as by the kernels' fminf/fmaxf.
    "min": np.fmin, "max": np.fmax, "pow": np.power, "clamp": _clamp,
    "where": np.where, "erf": lambda x: np.asarray(_erf(x), np.asarray(x).dtype),
    "sin": np.sin, "cos": np.cos, "mod": _floor_mod,
}

_REDUCE: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min,
}


# ----------------------------------------------------------------------------------------
# The evaluator.
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """What one stage of one request can read.

    names: the built-in names visible in the stage (INDEX_VARS), as arrays that broadcast
    against `shape`; params: validated run-time params (scalars 0-d, tensors 1-D).
    """

    stage: str
    shape: tuple[int, ...]
    names: Mapping[str, np.ndarray]
    params: Mapping[str, np.ndarray]
    fdtype: type[np.floating]

    def dtype(self, t: ir.Type) -> type[np.generic]:
        return {ir.BOOL: np.bool_, ir.INT: np.int64, ir.FLOAT: self.fdtype}[t]

    def cast(self, x: np.ndarray, t: ir.Type) -> np.ndarray:
        return np.asarray(x).astype(self.dtype(t), copy=False)

    def read(self, name: str) -> np.ndarray:
        try:
            return self.names[name]
        except KeyError:
            raise ValueError(
                f"'{name}' is not visible in stage '{self.stage}' (the checker should have "
                "rejected this variant)"
            ) from None

    def full(self, x: np.ndarray, t: ir.Type = ir.FLOAT) -> np.ndarray:
        """x cast to t and broadcast to the whole grid (e.g. the argument of a reduction)."""
        return np.broadcast_to(self.cast(x, t), self.shape)


def evaluate(e: ir.Expr, s: Scope) -> np.ndarray:
    """Value of e on the grid of scope s, with the dtype of e.type (broadcastable shape)."""
    try:
        handler = _NODES[type(e)]
    except KeyError:
        raise TypeError(f"the reference cannot evaluate IR node {type(e).__name__}") from None
    return handler(e, s)


def _eval_const(e: ir.Const, s: Scope) -> np.ndarray:
    return s.cast(e.value, e.type)


def _eval_var(e: ir.Var, s: Scope) -> np.ndarray:
    return s.cast(s.read(e.name), e.type)


def _eval_param(e: ir.Param, s: Scope) -> np.ndarray:
    return s.cast(s.params[e.name], e.type)


def _eval_param_index(e: ir.ParamIndex, s: Scope) -> np.ndarray:
    """A gather from the table; an index outside its axis reads 0 (false)."""
    table = s.params[e.name]
    indices = np.broadcast_arrays(*(np.asarray(evaluate(i, s), np.int64) for i in e.indices))
    inside = np.ones(indices[0].shape, bool)
    for index, n in zip(indices, table.shape, strict=True):
        inside &= (index >= 0) & (index < n)
    safe = tuple(np.where(inside, index, 0) for index in indices)
    return s.cast(np.where(inside, table[safe], 0), e.type)


def _eval_cast(e: ir.Cast, s: Scope) -> np.ndarray:
    return s.cast(evaluate(e.x, s), e.type)


def _eval_unary(e: ir.Unary, s: Scope) -> np.ndarray:
    return s.cast(_UNARY[e.op](evaluate(e.x, s)), e.type)


def _eval_binary(e: ir.Binary, s: Scope) -> np.ndarray:
    a, b = evaluate(e.a, s), evaluate(e.b, s)
    if e.op in _COMPARISONS:
        # Compare in the wider of the operand types (the checker usually made them equal).
        t = ir.FLOAT if ir.FLOAT in (e.a.type, e.b.type) else e.a.type
        a, b = s.cast(a, t), s.cast(b, t)
    elif e.op not in _LOGIC:
        a, b = s.cast(a, e.type), s.cast(b, e.type)
    fn = _INT_BINARY.get(e.op, _BINARY[e.op]) if e.type is ir.INT else _BINARY[e.op]
    return s.cast(fn(a, b), e.type)


def _eval_call(e: ir.Call, s: Scope) -> np.ndarray:
    args = [evaluate(a, s) for a in e.args]
    if e.fn == "int":
        return _to_int(s.cast(args[0], ir.FLOAT))
    if e.fn == "where":
        cond, a, b = args
        return np.where(s.cast(cond, ir.BOOL), s.cast(a, e.type), s.cast(b, e.type))
    # Float functions take float args; min/max/abs/clamp stay int when typed int.
    return s.cast(_CALLS[e.fn](*(s.cast(a, e.type) for a in args)), e.type)


def _eval_reduce(e: ir.Reduce, s: Scope) -> np.ndarray:
    if s.stage not in ir.VECTOR_STAGES:
        raise ValueError(f"reduction '{e.op}' in scalar stage '{s.stage}'")
    return s.cast(_REDUCE[e.op](s.full(evaluate(e.x, s)), axis=-1, keepdims=True), e.type)


def _eval_loop_var(e: ir.LoopVar, s: Scope) -> np.ndarray:
    return s.cast(s.read(e.name), e.type)


_LOOP_REDUCE = {"sum": np.add, "max": np.fmax, "min": np.fmin, "any": np.logical_or,
                "all": np.logical_and}


def _eval_loop(e: ir.Loop, s: Scope) -> np.ndarray:
    """The body at each value of the range, reduced in order (sum from the start)."""
    combine = _LOOP_REDUCE[e.op]
    total = None
    for i in range(e.start, e.stop):
        inner = replace(s, names={**s.names, e.var: np.asarray(i, np.int64)})
        value = s.cast(evaluate(e.body, inner), e.type)
        total = value if total is None else s.cast(combine(total, value), e.type)
    return total


def _eval_rope(e: ir.Rope, s: Scope) -> np.ndarray:
    """Rotary embedding along the dim axis (see ir.Rope for the two pairings)."""
    if s.stage not in ir.VECTOR_STAGES:
        raise ValueError(f"rope in scalar stage '{s.stage}'")
    x = s.full(evaluate(e.x, s))
    pos = s.cast(evaluate(e.pos, s), ir.FLOAT)
    theta = s.cast(evaluate(e.theta, s), ir.FLOAT)
    d = s.shape[-1]
    dim = np.arange(d)
    if e.interleaved:  # GPT-J: pairs (2i, 2i+1), frequency index i
        freq_index, partner, sign = dim // 2, dim ^ 1, np.where(dim % 2 == 0, -1, 1)
    else:  # rotate-half: pairs (i, i + d/2), frequency index i mod d/2
        half = d // 2
        freq_index, partner, sign = dim % half, (dim + half) % d, np.where(dim < half, -1, 1)
    exponent = (-2.0 * freq_index / d).astype(s.fdtype)
    angle = pos * np.power(theta, exponent)
    return x * np.cos(angle) + s.cast(sign, ir.FLOAT) * x[..., partner] * np.sin(angle)


_NODES: dict[type, Callable[[ir.Expr, Scope], np.ndarray]] = {
    ir.Const: _eval_const,
    ir.Var: _eval_var,
    ir.Param: _eval_param,
    ir.ParamIndex: _eval_param_index,
    ir.Cast: _eval_cast,
    ir.Unary: _eval_unary,
    ir.Binary: _eval_binary,
    ir.Call: _eval_call,
    ir.Reduce: _eval_reduce,
    ir.Rope: _eval_rope,
    ir.LoopVar: _eval_loop_var,
    ir.Loop: _eval_loop,
}


def stage_value(v: ir.Variant, name: str, s: Scope, default: np.ndarray) -> np.ndarray:
    """The stage's value over its whole grid; `default` (the identity) if it is omitted."""
    e = v.stage(name)
    if e is None:
        return default
    t = ir.BOOL if name == "mask" else ir.FLOAT
    return s.full(evaluate(e, s), t)
