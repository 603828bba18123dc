"""Typed IR expressions -> C++ text: the one recursive renderer and its tables (pass 3).

``expr_c`` renders one expression in an `Env` (the stage, and whether it is evaluated per
element of a head vector); op -> C text comes from format tables (``_BINARY``, ``_UNARY``,
``_CALLS``), no visitor per node. Every form parenthesises itself, so no precedence logic.
Literals follow the checker's ranges (finite float32, int32); params are members of the
variant's ``Params`` (``p.u_<name>``, see `member_name`); tables read through
``attnlang::table_at``; bounded reductions are immediately invoked lambdas.
`attnlang.codegen.lower` assembles these expressions into the hooks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from attnlang import ir
from attnlang.ir import BOOL, FLOAT, INT

__all__ = ["Env", "expr_c", "table_c", "span_c", "member_name", "literal", "c_string", "children",
           "reads", "reads_only", "is_invariant", "uses_dim", "CTYPE", "TENSOR_CTYPE", "REDUCE",
           "ROPE", "VARS", "CHEAP_CALLS"]

CTYPE = {BOOL: "bool", INT: "int", FLOAT: "float"}
# Bool tables are bytes (torch.bool / numpy bool storage), read as `!= 0`.
TENSOR_CTYPE = {INT: "const int*", FLOAT: "const float*", BOOL: "const unsigned char*"}
# The largest decimal that still rounds to a finite float32 (the checker's rule): half an ulp
# of FLT_MAX above it rounds down to it.
_FLT_MAX_DECIMAL = 3.4028235677973362e38
_INT32 = (-(2**31), 2**31 - 1)

# ------------------------------------------------------------------------------ the tables
# Operands arrive already rendered; every form parenthesises itself, so no precedence logic.

_UNARY = {
    ("-", INT): "(-{x})",
    ("-", FLOAT): "(-{x})",
    ("~", INT): "(~{x})",
    ("not", BOOL): "(!{x})",
}

# Keyed by (op, operand type). Int `/` and `%` are C's (truncate toward zero; a divisor that
# is not a nonzero literal goes through the helpers, where a zero yields 0), `//` floors,
# float `%` is fmodf (the sign of the dividend, like the reference), `**` is always float.
_BINARY = {
    **{(op, t): f"({{a}} {op} {{b}})" for op in "+-*" for t in (INT, FLOAT)},
    ("/", INT): "attnlang::idiv({a}, {b})",
    ("/", FLOAT): "({a} / {b})",
    ("%", INT): "attnlang::imod({a}, {b})",
    ("%", FLOAT): "fmodf({a}, {b})",
    ("//", INT): "attnlang::floor_div({a}, {b})",
    ("//", FLOAT): "floorf({a} / {b})",
    **{(op, INT): f"({{a}} {op} {{b}})" for op in "&|^"},
    ("<<", INT): "attnlang::shl({a}, {b})",
    (">>", INT): "attnlang::shr({a}, {b})",
    ("**", FLOAT): "powf({a}, {b})",
    **{(op, t): f"({{a}} {op} {{b}})"
       for op in ("<", "<=", ">", ">=", "==", "!=") for t in (INT, FLOAT, BOOL)},
    ("and", BOOL): "({a} && {b})",
    ("or", BOOL): "({a} || {b})",
}

# Keyed by (function, result type). Fast hardware approximations where LANGUAGE.md section 7
# allows them (common.cuh holds the inline-PTX helpers); int forms of min/max/abs/clamp.
_CALLS = {
    ("exp", FLOAT): "__expf({0})",
    ("exp2", FLOAT): "attnlang::ex2_approx({0})",
    ("log", FLOAT): "__logf({0})",
    ("log2", FLOAT): "__log2f({0})",
    ("sqrt", FLOAT): "sqrtf({0})",
    ("rsqrt", FLOAT): "rsqrtf({0})",
    ("tanh", FLOAT): "attnlang::tanh_approx({0})",
    ("sigmoid", FLOAT): "attnlang::sigmoid({0})",
    ("softplus", FLOAT): "attnlang::softplus({0})",
    ("abs", FLOAT): "fabsf({0})",
    ("abs", INT): "attnlang::iabs({0})",
    ("floor", FLOAT): "floorf({0})",
    ("ceil", FLOAT): "ceilf({0})",
    ("min", FLOAT): "fminf({0}, {1})",
    ("min", INT): "attnlang::imin({0}, {1})",
    ("max", FLOAT): "fmaxf({0}, {1})",
    ("max", INT): "attnlang::imax({0}, {1})",
    ("pow", FLOAT): "powf({0}, {1})",
    ("clamp", FLOAT): "fminf(fmaxf({0}, {1}), {2})",
    ("clamp", INT): "attnlang::imin(attnlang::imax({0}, {1}), {2})",
    # erf for exact GELU; sin/cos reduced in turns first, as rope (positions reach 1e5).
    ("erf", FLOAT): "erff({0})",
    ("sin", FLOAT): "attnlang::sin_reduced({0})",
    ("cos", FLOAT): "attnlang::cos_reduced({0})",
    ("mod", INT): "attnlang::floor_mod({0}, {1})",
    ("mod", FLOAT): "attnlang::floor_mod({0}, {1})",
    ("int", INT): "attnlang::float_to_int({0})",
    **{("where", t): "({0} ? {1} : {2})" for t in (BOOL, INT, FLOAT)},
}

# Calls that cost an instruction or two per score: not worth a table or a register of their own
# (attnlang.codegen.distance_terms, tile_uniform's row parts).
CHEAP_CALLS = ("min", "max", "abs", "clamp", "where", "int", "floor", "ceil")

# Reductions over dim: lane-local reduce of a float[VEC], then a butterfly over the TX lanes.
REDUCE = {
    "sum": "attnlang::group_sum<VEC, TX>({0})",
    "mean": "attnlang::group_mean<VEC, TX>({0})",
    "max": "attnlang::group_max<VEC, TX>({0})",
    "min": "attnlang::group_min<VEC, TX>({0})",
}

ROPE = {
    False: "attnlang::rope_rotate_half<VEC, TX>({out}, {x}, dim0, {pos}, {theta})",
    True: "attnlang::rope_interleaved<VEC, TX>({out}, {x}, dim0, {pos}, {theta})",
}

# Built-in names -> C. Index fields come from the kernel-built `Index ix`; `head_dim` is the
# template's compile-time constant; `causal` is expanded by the checker (kept for hand IR).
VARS = {
    **{name: f"ix.{name}" for name in (
        "batch", "head", "kv_head", "qo_len", "kv_len", "q_pos", "kv_pos",
        "num_heads", "num_kv_heads", "sm_scale")},
    "head_dim": "attnlang::kHeadDim",
    "causal": "(ix.kv_pos <= ix.q_pos)",
    "logits": "s",
}
# The run-time size of each named extent. A `batch` axis is always the first, whose extent
# enters no stride (and its index, a request of the batch, is not tested): any value will do.
_EXTENT_C = {"heads": "ix.num_heads", "kv_heads": "ix.num_kv_heads", "batch": "0",
             "dim": "(VEC * TX)"}  # the length of the stage's vector (q/k or v/o)
# A literal divisor other than 0 needs no zero test: C's own / and % then.
_LITERAL_DIVISION = {("/", INT): "({a} / {b})", ("%", INT): "({a} % {b})"}




# ------------------------------------------------------------------------------ literals


def _float_literal(value: float) -> str:
    v = float(value)
    if not math.isfinite(v) or abs(v) > _FLT_MAX_DECIMAL:
        raise ValueError(f"float constant {value!r} is not a finite float32")
    text = repr(abs(v))  # shortest round-trip text: '1e-06', '50.0', '1e+20'
    if "e" not in text and "." not in text:
        text += ".0"
    text += "f"
    return f"(-{text})" if math.copysign(1.0, v) < 0 else text


def _int_literal(value: int) -> str:
    v = int(value)
    if not _INT32[0] <= v <= _INT32[1]:
        raise ValueError(f"int constant {value!r} does not fit in a 32-bit int")
    return f"({v})" if v < 0 else str(v)


def literal(e: ir.Const) -> str:
    if e.type is BOOL:
        return "true" if e.value else "false"
    if e.type is INT:
        return _int_literal(e.value)
    return _float_literal(e.value)


def c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def member_name(param: str) -> str:
    """The Params member for a param: its name behind a prefix, so that no user name can
    collide with a C++ keyword, a CUDA or NVRTC macro (``__shared__``, ``NULL``,
    ``__CUDA_ARCH__``) or one of attnlang's own (``ATTNLANG_HD``). Kernel arguments carry
    the prefix ``param_`` for the same reason.

    >>> member_name("cap"), member_name("__shared__")
    ('u_cap', 'u___shared__')
    """
    return "u_" + param


# ------------------------------------------------------------------------------ expressions


@dataclass(frozen=True)
class Env:
    """What the names of one expression mean in C.

    elem: inside the per-element loop of a vector stage (``x[i]``, ``dim``); input: the
    stage's element name (q/k/v/o); hoisted: Reduce/Rope sub-trees already in temporaries;
    exact: under a node that truncates or compares floats (`int()`, `floor`, `<`...), where
    an ulp can change the result, so divisions keep IEEE's quotient.
    """

    stage: str
    elem: bool = False
    input: str | None = None
    hoisted: tuple[tuple[ir.Expr, str], ...] = ()
    exact: bool = False

    def temp(self, e: ir.Expr) -> str | None:
        for node, name in self.hoisted:
            if node == e:
                return name
        return None


def children(e: ir.Expr) -> tuple[ir.Expr, ...]:
    if isinstance(e, (ir.Cast, ir.Unary, ir.Reduce)):
        return (e.x,)
    if isinstance(e, ir.Binary):
        return (e.a, e.b)
    if isinstance(e, ir.Call):
        return e.args
    if isinstance(e, ir.Rope):
        return (e.x, e.pos, e.theta)
    if isinstance(e, ir.ParamIndex):
        return e.indices
    if isinstance(e, ir.Loop):
        return (e.body,)
    return ()


def reads(e: ir.Expr, pred) -> bool:
    """Does e or a node under it satisfy pred?"""
    return pred(e) or any(reads(c, pred) for c in children(e))


def reads_only(e: ir.Expr, banned: tuple[str, ...], allowed=lambda n: False,
               bound: frozenset = frozenset()) -> bool:
    """Does e read none of the built-in names `banned` (outside sub-trees `allowed` accepts)
    and no reduction variable bound outside it?"""
    if allowed(e):
        return True
    if isinstance(e, ir.Var):
        return e.name not in banned
    if isinstance(e, ir.LoopVar):
        return e.name in bound
    if isinstance(e, ir.Loop):
        return reads_only(e.body, banned, allowed, bound | {e.var})
    return all(reads_only(c, banned, allowed, bound) for c in children(e))


def expr_c(e: ir.Expr, env: Env) -> str:
    """C text of an expression in `env` (the one recursive renderer; tables do the rest)."""
    name = env.temp(e)
    if name is not None:  # a hoisted reduction (scalar) or rope (per element)
        return f"{name}[i]" if isinstance(e, ir.Rope) else name
    if not env.exact and _truncates(e):
        env = replace(env, exact=True)
    if isinstance(e, ir.Const):
        return literal(e)
    if isinstance(e, ir.Var):
        if e.name == env.input or e.name == "dim":
            if not env.elem:
                raise ValueError(f"'{e.name}' used outside a per-element context")
            return "x[i]" if e.name == env.input else "dim"
        if e.name not in VARS:
            raise ValueError(f"stage '{env.stage}' cannot read '{e.name}'")
        return VARS[e.name]
    if isinstance(e, ir.Param):
        return f"p.{member_name(e.name)}"
    if isinstance(e, ir.ParamIndex):
        return table_c(e, lambda i: expr_c(i, env))
    if isinstance(e, ir.LoopVar):
        return f"loop_{e.name}"
    if isinstance(e, ir.Loop):
        return _loop_c(e, expr_c(e.body, env))
    if isinstance(e, ir.Cast):
        if isinstance(e.x, ir.Const) and e.x.type is INT:
            return _float_literal(float(e.x.value))
        return f"((float)({expr_c(e.x, env)}))"
    if isinstance(e, ir.Unary):
        return _UNARY[(e.op, e.type)].format(x=expr_c(e.x, env))
    if isinstance(e, ir.Binary):
        key = (e.op, e.a.type)
        if key not in _BINARY:
            raise ValueError(f"no C form for {e.a.type} {e.op} {e.b.type}")
        if key in _LITERAL_DIVISION and isinstance(e.b, ir.Const) and e.b.value != 0:
            return _LITERAL_DIVISION[key].format(a=expr_c(e.a, env), b=expr_c(e.b, env))
        if key == ("/", FLOAT) and is_invariant(e.b):
            # A divisor of scalar params and constants only: through its reciprocal, which
            # the compiler folds or hoists (an IEEE division per score costs ~10 instructions
            # and a slow-path call). Within an ulp of a / b, far inside LANGUAGE.md section 7;
            # where an ulp could flip a truncation or comparison, corrected to IEEE's quotient.
            a, b = expr_c(e.a, env), expr_c(e.b, env)
            if env.exact and not _power_of_two(e.b):
                return f"attnlang::div_invariant({a}, {b})"
            return f"({a} * (1.0f / {b}))"
        return _BINARY[key].format(a=expr_c(e.a, env), b=expr_c(e.b, env))
    if isinstance(e, ir.Call):
        key = (e.fn, e.type)
        if key not in _CALLS:
            raise ValueError(f"no C form for {e.fn}(...) of type {e.type}")
        return _CALLS[key].format(*(expr_c(a, env) for a in e.args))
    if isinstance(e, (ir.Reduce, ir.Rope)):
        raise ValueError(f"{type(e).__name__} outside a vector stage")
    raise TypeError(f"unknown IR node {type(e).__name__}")


# A bounded reduction's start value and step, by (op, type).
_LOOP_INIT = {"sum": {INT: "0", FLOAT: "0.0f"},
              "max": {INT: "(-2147483647 - 1)", FLOAT: "attnlang::neg_inf()"},
              "min": {INT: "2147483647", FLOAT: "(-attnlang::neg_inf())"},
              "any": {BOOL: "false"}, "all": {BOOL: "true"}}
_LOOP_STEP = {"sum": "acc + ({v})", "max": "attnlang::imax(acc, {v})",
              "min": "attnlang::imin(acc, {v})", "any": "acc || ({v})", "all": "acc && ({v})"}
_LOOP_STEP_FLOAT = {"max": "fmaxf(acc, {v})", "min": "fminf(acc, {v})"}


# Longest bounded reduction the C++ compiler may unroll.
_UNROLLED_LOOP = 8


def _loop_c(e: ir.Loop, body: str) -> str:
    """A bounded reduction as an immediately invoked lambda (an expression, like the rest)."""
    ctype = CTYPE[e.type]
    step = (_LOOP_STEP_FLOAT if e.type is FLOAT else {}).get(e.op, _LOOP_STEP[e.op])
    # A long loop stays a loop: the kernels already unroll the elements around it (64 per
    # thread in the wgmma path), and 64 x 64 unrolled bodies take NVRTC minutes.
    rolled = '_Pragma("unroll 1") ' if e.stop - e.start > _UNROLLED_LOOP else ""
    return (f"([&]() {{ {ctype} acc = {_LOOP_INIT[e.op][e.type]}; {rolled}"
            f"for (int loop_{e.var} = {e.start}; loop_{e.var} < {e.stop}; ++loop_{e.var}) "
            f"acc = {step.format(v=body)}; return acc; }}())")


def table_c(e: ir.ParamIndex, index_c) -> str:
    """C text of a table read; index_c renders one index expression. A named extent's index
    is the kernel's own variable, in range by construction (`Known`: no bound test). A
    per-pair mask reads one bit of the request's packed matrix (common.cuh, pair_bit)."""
    if e.extents == ir.PAIR_EXTENTS:
        row, col = (index_c(i) for i in e.indices)
        return f"attnlang::pair_bit(p.{member_name(e.name)}, ix, {row}, {col})"
    read = f"attnlang::table_at(p.{member_name(e.name)}, {_axes(e.indices, e.extents, index_c)})"
    return f"({read} != 0)" if e.type is BOOL else read


def _axes(indices, extents, index_c) -> str:
    """table_at's (index, extent) arguments, a named extent's index as `Known`."""
    return ", ".join(f"attnlang::Known{{{index_c(i)}}}, {_EXTENT_C[n]}" if isinstance(n, str)
                     else f"{index_c(i)}, {n}" for i, n in zip(indices, extents, strict=True))


def span_c(e: ir.ParamIndex, index_c) -> str:
    """C text (a tri: 0 all false, 1 mixed, 2 all true) of a bool table read over a tile,
    where its last index is kv_pos (the tile's keys kv_lo..kv_hi) or q_pos (its queries
    q_lo..q_hi) and index_c renders the others (one value per tile): common.cuh's span_tri
    scans that stretch of the row."""
    *rest, position = e.indices
    *rest_extents, last = e.extents
    lo, hi = ("kv_lo", "kv_hi") if position.name == "kv_pos" else ("q_lo", "q_hi")
    axes = _axes(rest, rest_extents, index_c)
    extent = _EXTENT_C[last] if isinstance(last, str) else str(last)
    return (f"attnlang::span_tri(p.{member_name(e.name)}, {lo}, {hi}, {extent}"
            f"{', ' + axes if axes else ''})")


def _power_of_two(e: ir.Expr) -> bool:
    """Is e a constant whose reciprocal is exact (a power of two)?"""
    return (isinstance(e, ir.Const) and e.value != 0 and math.isfinite(e.value)
            and math.frexp(abs(e.value))[0] == 0.5)


def _truncates(e: ir.Expr) -> bool:
    """Can an ulp of a float operand change e's value by more than an ulp (e truncates,
    rounds or compares floats)?"""
    if isinstance(e, ir.Call) and e.fn in ("floor", "ceil", "mod"):
        return True
    if isinstance(e, ir.Binary) and e.op in ("%", "//"):
        return True
    return e.type is not FLOAT and any(c.type is FLOAT for c in children(e))


def is_invariant(e: ir.Expr) -> bool:
    """Is e built from scalar params and constants only (the same value for every key,
    query and element of a launch)?"""
    if isinstance(e, (ir.Const, ir.Param)):
        return True
    if isinstance(e, ir.Cast):
        return is_invariant(e.x)
    if isinstance(e, ir.Unary):
        return is_invariant(e.x)
    if isinstance(e, ir.Binary):
        return is_invariant(e.a) and is_invariant(e.b)
    return False


def uses_dim(e: ir.Expr, env: Env) -> bool:
    """Does the per-element text of e read `dim` (so the loop must define it)?"""
    if env.temp(e) is not None:
        return False
    if isinstance(e, ir.Var) and e.name == "dim":
        return True
    return any(uses_dim(c, env) for c in children(e))
