"""Constant folding and the ranges of constants (used by the checker, pass 2).

A sub-expression whose operands are all constants is evaluated here, in float64 / Python
ints with the kernels' semantics (C's truncating `/` and `%`, floor `//` and `mod`), and
must land inside its type: ints are int32, floats finite float32 (LANGUAGE.md section 9).
"""

from __future__ import annotations

import math

import numpy as np

from attnlang import ir
from attnlang.ir import BOOL, FLOAT, INT, Type

__all__ = ["fold", "out_of_range", "show", "ConstRangeError", "RANGE_HINT"]


def _c_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _c_mod(a: int, b: int) -> int:
    return a - b * _c_div(a, b)


def _floor_div(a, b):
    """`//`: Python's floor division on ints; floor(a / b) on floats (as the kernels)."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return float(math.floor(a / b))


def _floor_mod(a, b):
    """`mod(a, b)`: a - b * (a // b), the sign of b (Python's `%`)."""
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    return a - b * math.floor(a / b)


def _shift_left(a: int, n: int) -> int:
    return a << n if 0 <= n <= 31 else 0


def _shift_right(a: int, n: int) -> int:
    return a >> n if 0 <= n <= 31 else (-1 if a < 0 else 0)


def _to_int(x: float) -> int:
    if math.isnan(x):
        return 0
    return int(x)  # toward zero; a value outside int32 is reported by the range check


_FOLD_BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "**": lambda a, b: float(a) ** float(b),
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "and": lambda a, b: a and b,
    "or": lambda a, b: a or b,
    "//": _floor_div,
    "&": lambda a, b: a & b,
    "|": lambda a, b: a | b,
    "^": lambda a, b: a ^ b,
    "<<": _shift_left,
    ">>": _shift_right,
}

_FOLD_CALL = {
    "exp": math.exp, "exp2": lambda x: 2.0**x, "log": math.log, "log2": math.log2,
    "sqrt": math.sqrt, "rsqrt": lambda x: 1.0 / math.sqrt(x), "tanh": math.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)), "abs": abs, "floor": math.floor,
    "ceil": math.ceil, "softplus": lambda x: max(x, 0.0) + math.log1p(math.exp(-abs(x))),
    "min": min, "max": max, "pow": lambda a, b: float(a) ** float(b),
    "clamp": lambda x, lo, hi: min(max(x, lo), hi), "where": lambda c, a, b: a if c else b,
    "erf": math.erf, "sin": math.sin, "cos": math.cos, "mod": _floor_mod, "int": _to_int,
    "float": float,
}


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
RANGE_HINT = {
    INT: "ints are 32-bit: from -2147483648 to 2147483647",
    FLOAT: "floats are 32-bit: finite, of magnitude at most 3.4028235e38",
    BOOL: None,
}


class ConstRangeError(ValueError):
    """A constant (literal or folded) outside its type's range; `problem` says how."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


def out_of_range(value, ty: Type) -> str | None:
    """Why `value` cannot be a constant of type ty (None if it can): ints are int32, floats
    finite float32 (a decimal that rounds to float32's largest finite value is fine).

    >>> out_of_range(2**31, INT)
    'does not fit in a 32-bit int'
    """
    if isinstance(value, complex):
        return "is not a real number"
    if ty is INT and not _INT32_MIN <= int(value) <= _INT32_MAX:
        return "does not fit in a 32-bit int"
    if ty is FLOAT:
        v = float(value)
        if math.isnan(v):
            return "is not a number (NaN)"
        with np.errstate(over="ignore"):
            if not np.isfinite(np.float32(v)):
                return "is not a finite 32-bit float"
    return None


def show(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:10]}...{text[-6:]} ({len(text)} digits)"


def fold(e: ir.Expr) -> ir.Expr:
    """Evaluate e if all its operands are constants (C semantics for int / and %).

    Leaves e unchanged when an operand is not constant. Raises ConstRangeError when the
    value would leave int32 / finite float32 or is undefined (division by zero, a domain
    error, a complex power): the kernel would compute inf, nan or garbage there.
    """
    if isinstance(e, ir.Cast) and isinstance(e.x, ir.Const):
        return ir.Const(float(e.x.value), FLOAT, e.span)
    if isinstance(e, ir.Unary) and isinstance(e.x, ir.Const):
        x = e.x.value
        return _const(not x if e.op == "not" else ~x if e.op == "~" else -x, e)
    if isinstance(e, ir.Binary) and isinstance(e.a, ir.Const) and isinstance(e.b, ir.Const):
        a, b = e.a.value, e.b.value
        try:
            if e.op in ("/", "%"):
                if e.type is INT:
                    value = _c_div(a, b) if e.op == "/" else _c_mod(a, b)
                else:
                    value = a / b if e.op == "/" else math.fmod(a, b)
            else:
                value = _FOLD_BINARY[e.op](a, b)
        except ZeroDivisionError:
            raise ConstRangeError("divides by zero") from None
        except (OverflowError, ValueError):
            raise ConstRangeError("has no finite value") from None
        return _const(value, e)
    if isinstance(e, ir.Call) and all(isinstance(a, ir.Const) for a in e.args):
        try:
            value = _FOLD_CALL[e.fn](*(a.value for a in e.args))
        except ZeroDivisionError:
            raise ConstRangeError("divides by zero") from None
        except (OverflowError, ValueError):
            raise ConstRangeError(f"has no finite value ({e.fn} of "
                                  f"{', '.join(show(a.value) for a in e.args)})") from None
        return _const(value, e)
    return e


def _const(value, e: ir.Expr) -> ir.Expr:
    problem = out_of_range(value, e.type)
    if problem:
        raise ConstRangeError(problem if isinstance(value, complex)
                              else f"{problem} (it is {show(value)})")
    if e.type is FLOAT:
        value = float(value)
    elif e.type is INT:
        value = int(value)
    else:
        value = bool(value)
    return ir.Const(value, e.type, e.span)
