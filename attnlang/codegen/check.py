"""Pass 2, check: syntax tree -> typed IR (`attnlang.ir.Variant`).

Resolves every name (params, consts, built-ins), scopes built-ins to the stages that may read
them, checks and promotes types (explicit `Cast` nodes), expands `causal`, and folds consts
and constant sub-expressions. Every semantic error of the file is collected in one pass and
raised together as `AttnErrors`, sorted by position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attnlang import ir
from attnlang.errors import (
    AttnDeclarationError,
    AttnError,
    AttnErrors,
    AttnNameError,
    AttnScopeError,
    AttnTypeError,
    Span,
    did_you_mean,
)
from attnlang.grammar import ast
from attnlang.ir import BOOL, FLOAT, INT, Type

__all__ = ["check", "fold"]

_TYPES = {"float": FLOAT, "int": INT, "bool": BOOL}
_ROPE_FUNCS = ("rope", "rope_interleaved")
_ALL_FUNCS = tuple(ir.SCALAR_FUNCS) + ir.REDUCTIONS + _ROPE_FUNCS
_KEYWORDS = {"variant", "param", "const", "softmax", "on", "off", "and", "or", "not", "true",
             "false", "where"}
# Names a declaration may not take.
_RESERVED = set(ir.INDEX_VARS) | set(_ALL_FUNCS) | {"float", "int", "bool"} | _KEYWORDS
# Float-only scalar functions (min/max/abs/clamp keep ints; where is typed apart).
_INT_KEEPING = ("min", "max", "abs", "clamp")


class _Poison(Exception):
    """An error was already recorded for this sub-expression; stop checking it."""


@dataclass(frozen=True)
class _Const:
    type: Type
    value: bool | int | float


def check(module: ast.Module, source: str = "", filename: str = "<string>") -> ir.Variant:
    """Check a parsed file and return its typed IR.

    >>> from attnlang.grammar.parser import parse_ast
    >>> v = check(parse_ast("variant c\\nmask = causal"))
    >>> v.mask
    Binary(op='<=', a=Var(name='kv_pos', type=<Type.INT: 'int'>), ...)

    Raises AttnErrors carrying every error of the file.
    """
    return _Checker(source, filename).run(module)


class _Checker:
    def __init__(self, source: str, filename: str):
        self.source = source
        self.filename = filename
        self.errors: list[AttnError] = []
        self.params: dict[str, ir.ParamSpec] = {}
        self.consts: dict[str, _Const] = {}
        self.declared_at: dict[str, Span] = {}
        # Names whose declaration had an error: uses stay silent (no cascade of errors).
        self.broken: set[str] = set()

    # ---- errors ----

    def error(self, cls: type[AttnError], message: str, span: Span | None, hint: str | None = None):
        self.errors.append(cls(message, span, hint, self.source))

    def fail(self, cls: type[AttnError], message: str, span: Span | None, hint: str | None = None):
        self.error(cls, message, span, hint)
        raise _Poison

    # ---- driver ----

    def run(self, module: ast.Module) -> ir.Variant:
        # Every const of the file, to explain a use before its declaration.
        self.all_consts = {item.name: item.name_span for item in module.items
                           if isinstance(item, ast.ConstDecl)}
        stages: dict[str, ir.Expr | None] = {}
        stage_spans: dict[str, Span] = {}
        softmax = True
        for item in module.items:
            if isinstance(item, ast.ParamDecl):
                self.declare_param(item)
            elif isinstance(item, ast.ConstDecl):
                self.declare_const(item)
            elif isinstance(item, ast.StageDecl):
                if item.stage in stage_spans:
                    first = stage_spans[item.stage]
                    self.error(AttnDeclarationError, f"stage '{item.stage}' is defined twice",
                               item.stage_span, f"first defined at line {first.line}")
                    continue
                if item.stage == "softmax":
                    stage_spans["softmax"] = item.stage_span
                    softmax = item.expr.value
                    continue
                if item.stage not in ir.STAGES:
                    hint = did_you_mean(item.stage, ir.STAGES + ("softmax",)) or (
                        "the stages are " + ", ".join(ir.STAGES) + " and softmax")
                    self.error(AttnDeclarationError, f"unknown stage '{item.stage}'",
                               item.stage_span, hint)
                    continue
                stage_spans[item.stage] = item.stage_span
                stages[item.stage] = self.check_stage(item)
        if self.errors:
            raise AttnErrors(self.errors)
        return ir.Variant(
            name=module.name,
            params=tuple(self.params.values()),
            consts=tuple((n, c.value) for n, c in self.consts.items()),
            softmax=softmax,
            source=self.source,
            filename=self.filename,
            **{s: stages.get(s) for s in ir.STAGES},
        )

    # ---- declarations ----

    def declare_name(self, name: str, span: Span) -> bool:
        if name in _RESERVED:
            what = "a built-in name" if name in ir.INDEX_VARS else "a built-in function"
            if name in _KEYWORDS:
                what = "a keyword"
            if name in _TYPES:
                what = "a type name"
            self.error(AttnNameError, f"'{name}' is {what} and cannot be redeclared", span,
                       "choose another name")
            return False
        if name in self.declared_at:
            self.error(AttnNameError, f"'{name}' is declared twice", span,
                       f"first declared at line {self.declared_at[name].line}")
            return False
        self.declared_at[name] = span
        return True

    def declare_param(self, d: ast.ParamDecl):
        ok = self.declare_name(d.name, d.name_span)
        self.broken.add(d.name)  # until it is fully declared
        ty = _TYPES.get(d.type_name)
        if ty not in (INT, FLOAT):
            hint = "params are 'float' or 'int' (a bool switch is a const)"
            self.error(AttnTypeError, f"unknown param type '{d.type_name}'", d.type_span, hint)
            return
        if d.extent is not None and d.extent not in ir.EXTENT_INDEX:
            hint = did_you_mean(d.extent, ir.EXTENT_INDEX) or (
                "extents are " + ", ".join(ir.EXTENT_INDEX))
            self.error(AttnDeclarationError, f"unknown tensor extent '{d.extent}'",
                       d.extent_span, hint)
            return
        default = None
        if d.default is not None:
            if d.extent is not None:
                self.error(AttnDeclarationError, f"tensor param '{d.name}' cannot have a default",
                           d.default.span, "pass the tensor to run()")
                return
            if ty is INT and not d.default.is_int:
                self.error(AttnTypeError,
                           f"default of int param '{d.name}' must be an integer, found "
                           f"{d.default.value!r}", d.default.span)
                return
            problem = out_of_range(d.default.value, ty)
            if problem:
                self.error(AttnTypeError, f"default of param '{d.name}' {problem} (it is "
                           f"{_show(d.default.value)})", d.default.span, _RANGE_HINT[ty])
                return
            default = float(d.default.value) if ty is FLOAT else int(d.default.value)
        if ok:
            self.params[d.name] = ir.ParamSpec(d.name, ty, d.extent, default, d.span)
            self.broken.discard(d.name)

    def declare_const(self, d: ast.ConstDecl):
        ok = self.declare_name(d.name, d.name_span)
        self.broken.add(d.name)  # until it is fully declared
        ty = _TYPES.get(d.type_name)
        if ty is None:
            hint = did_you_mean(d.type_name, _TYPES) or "consts are 'float', 'int' or 'bool'"
            self.error(AttnTypeError, f"unknown const type '{d.type_name}'", d.type_span, hint)
            return
        try:
            e = self.expr(d.expr, stage=None)
        except _Poison:
            return
        if not isinstance(e, ir.Const):
            self.error(AttnDeclarationError,
                       f"const '{d.name}' must be computable at compile time", d.expr.span,
                       "a const may use literals and earlier consts only; use a param for "
                       "values known at run time")
            return
        try:
            e = self.coerce(e, ty, d.expr.span, f"const '{d.name}'")
        except _Poison:
            return
        if ok:
            self.consts[d.name] = _Const(ty, e.value)
            self.broken.discard(d.name)

    # ---- stages ----

    def check_stage(self, item: ast.StageDecl) -> ir.Expr | None:
        try:
            e = self.expr(item.expr, stage=item.stage)
            if item.stage == "mask":
                return self.coerce(e, BOOL, item.expr.span, "the mask")
            return self.coerce(e, FLOAT, item.expr.span, f"the {item.stage} stage")
        except _Poison:
            return None

    def coerce(self, e: ir.Expr, ty: Type, span: Span, what: str) -> ir.Expr:
        if e.type is ty:
            return e
        if ty is FLOAT and e.type is INT:
            return self.fold(ir.Cast(e, FLOAT, span))
        hint = {
            BOOL: ("a bool const is true, false or a condition such as '1 < 2'"
                   if what.startswith("const") else
                   "a mask is a condition such as 'q_pos - kv_pos < 128'"),
            FLOAT: "use where(cond, 1.0, 0.0) to turn a condition into a number",
            INT: None,
        }[ty]
        self.fail(AttnTypeError, f"{what} must be {ty}, found {e.type}", span, hint)

    # ---- expressions ----

    def expr(self, node: ast.Node, stage: str | None) -> ir.Expr:
        method = getattr(self, "expr_" + type(node).__name__)
        return method(node, stage)

    def exprs(self, nodes, stage: str | None) -> list[ir.Expr]:
        """Each of `nodes` checked even when an earlier one has an error, so one expression
        reports all its independent errors (`f(1, 2) + g(3, 4)`: both arities)."""
        out, poisoned = [], False
        for node in nodes:
            try:
                out.append(self.expr(node, stage))
            except _Poison:
                poisoned = True
        if poisoned:
            raise _Poison
        return out

    def expr_Number(self, n: ast.Number, stage):
        problem = out_of_range(n.value, INT if n.is_int else FLOAT)
        if problem:
            shown = ("overflows to infinity" if n.value == math.inf
                     else f"{_show(n.value)} {problem}")
            self.fail(AttnTypeError, f"the literal {shown}", n.span,
                      _RANGE_HINT[INT if n.is_int else FLOAT])
        return ir.Const(n.value, INT if n.is_int else FLOAT, n.span)

    def fold(self, e: ir.Expr) -> ir.Expr:
        """`fold`, with a constant that leaves int32 / finite float32 reported at e."""
        try:
            return fold(e)
        except ConstRangeError as err:
            self.fail(AttnTypeError, f"this constant expression {err.problem}", e.span,
                      _RANGE_HINT.get(e.type))

    def expr_Boolean(self, n: ast.Boolean, stage):
        return ir.Const(n.value, BOOL, n.span)

    def expr_Name(self, n: ast.Name, stage):
        if n.id in self.broken:
            raise _Poison
        if n.id in self.consts:
            c = self.consts[n.id]
            return ir.Const(c.value, c.type, n.span)
        if stage is None:  # inside a const declaration
            if n.id in self.params or n.id in ir.INDEX_VARS:
                self.fail(AttnDeclarationError, f"a const cannot use '{n.id}'", n.span,
                          "a const may use literals and earlier consts only")
            self.unknown_name(n.id, n.span, stage)
        if n.id in self.params:
            p = self.params[n.id]
            if p.is_tensor:
                idx = ir.EXTENT_INDEX[p.extent]
                self.fail(AttnTypeError, f"tensor param '{n.id}' must be indexed", n.span,
                          f"write {n.id}[{idx}]")
            return ir.Param(n.id, p.type, n.span)
        if n.id in ir.INDEX_VARS:
            self.check_scope(n.id, stage, n.span)
            ty = ir.INDEX_VARS[n.id][0]
            if n.id == "causal":
                kv_pos = ir.Var("kv_pos", INT, n.span)
                q_pos = ir.Var("q_pos", INT, n.span)
                return ir.Binary("<=", kv_pos, q_pos, BOOL, n.span)
            return ir.Var(n.id, ty, n.span)
        self.unknown_name(n.id, n.span, stage)

    def unknown_name(self, name: str, span: Span, stage: str | None):
        if name in _ALL_FUNCS:
            self.fail(AttnTypeError, f"'{name}' is a function; call it", span,
                      f"write {name}(...)")
        visible = set(self.consts)
        if stage is not None:
            visible |= set(self.params)
            visible |= {v for v, (_, stages) in ir.INDEX_VARS.items() if stage in stages}
        later = self.all_consts.get(name)
        if later is not None and stage is None:
            self.fail(AttnNameError, f"const '{name}' is used before its declaration", span,
                      f"a const sees only the consts declared above it; '{name}' is declared "
                      f"at line {later.line}: move it up")
        hint = did_you_mean(name, visible) or did_you_mean(name, ir.INDEX_VARS)
        if hint is None and stage is not None:
            hint = "declare it with 'param' (run time) or 'const' (compile time)"
        self.fail(AttnNameError, f"unknown name '{name}'", span, hint)

    def check_scope(self, name: str, stage: str | None, span: Span):
        allowed = ir.INDEX_VARS[name][1]
        if stage in allowed:
            return
        where = ", ".join(s for s in ir.STAGES if s in allowed)
        self.fail(AttnScopeError, f"'{name}' is not visible in the {stage} stage", span,
                  f"'{name}' may be used in: {where}")

    def expr_Index(self, n: ast.Index, stage):
        if stage is None:
            self.fail(AttnDeclarationError, f"a const cannot use '{n.name}'", n.span,
                      "a const may use literals and earlier consts only")
        if n.name in self.broken:
            raise _Poison
        p = self.params.get(n.name)
        if p is None:
            if n.name in ir.INDEX_VARS or n.name in self.consts:
                self.fail(AttnTypeError, f"'{n.name}' is a scalar and cannot be indexed", n.span)
            self.unknown_name(n.name, n.span, stage)
        if not p.is_tensor:
            self.fail(AttnTypeError, f"scalar param '{n.name}' cannot be indexed", n.span,
                      f"declare it as 'param {n.name}: {p.type}[heads]' (or kv_heads, batch, "
                      "dim) to pass a tensor")
        want = ir.EXTENT_INDEX[p.extent]
        if n.index != want:
            self.fail(AttnTypeError,
                      f"'{n.name}' has extent {p.extent} and is indexed by '{want}', not "
                      f"'{n.index}'", n.index_span, f"write {n.name}[{want}]")
        self.check_scope(want, stage, n.index_span)
        return ir.ParamIndex(n.name, want, p.type, n.span)

    def expr_UnaryOp(self, n: ast.UnaryOp, stage):
        x = self.expr(n.x, stage)
        if n.op == "not":
            self.need(x, BOOL, n.x.span, "'not'")
            return self.fold(ir.Unary("not", x, BOOL, n.span))
        self.need_number(x, n.x.span, "unary '-'")
        return self.fold(ir.Unary("-", x, x.type, n.span))

    def expr_BinOp(self, n: ast.BinOp, stage):
        a, b = self.exprs((n.a, n.b), stage)
        op = n.op
        if op in ("and", "or"):
            self.need(a, BOOL, n.a.span, f"'{op}'")
            self.need(b, BOOL, n.b.span, f"'{op}'")
            return self.fold(ir.Binary(op, a, b, BOOL, n.span))
        if op in ("==", "!=") and a.type is BOOL and b.type is BOOL:
            return self.fold(ir.Binary(op, a, b, BOOL, n.span))
        self.need_number(a, n.a.span, f"'{op}'")
        self.need_number(b, n.b.span, f"'{op}'")
        if op == "**":
            a, b = self.to_float(a, n.a.span), self.to_float(b, n.b.span)
            return self.fold(ir.Binary(op, a, b, FLOAT, n.span))
        if a.type is not b.type:
            a, b = self.to_float(a, n.a.span), self.to_float(b, n.b.span)
        ty = BOOL if op in ("<", "<=", ">", ">=", "==", "!=") else a.type
        if op in ("/", "%") and isinstance(b, ir.Const) and b.type is INT and b.value == 0:
            self.fail(AttnTypeError, f"integer {'division' if op == '/' else 'modulo'} by zero",
                      n.b.span)
        return self.fold(ir.Binary(op, a, b, ty, n.span))

    def expr_Keyword(self, n: ast.Keyword, stage):  # only reachable from a misplaced kwarg
        self.fail(AttnTypeError, f"unexpected keyword argument '{n.name}'", n.span)

    def expr_Call(self, n: ast.Call, stage):
        f = n.func
        if f in _ROPE_FUNCS:
            return self.call_rope(n, stage)
        if f in ir.REDUCTIONS and len(n.args) == 1 and not n.kwargs:
            return self.call_reduce(n, stage)
        if f not in ir.SCALAR_FUNCS:
            hint = did_you_mean(f, _ALL_FUNCS) or (
                "functions are " + ", ".join(sorted(set(_ALL_FUNCS))))
            self.fail(AttnNameError, f"unknown function '{f}'", n.func_span, hint)
        if n.kwargs:
            self.fail(AttnTypeError, f"{f}() takes no keyword arguments", n.kwargs[0].span)
        want = ir.SCALAR_FUNCS[f]
        if len(n.args) != want:  # reported, then the arguments' own errors too
            self.error(AttnTypeError,
                       f"{f}() takes {want} argument{'s' if want > 1 else ''}, found {len(n.args)}",
                       n.span)
            self.exprs(n.args, stage)
            raise _Poison
        args = self.exprs(n.args, stage)
        spans = [a.span for a in n.args]
        if f == "where":
            self.need(args[0], BOOL, spans[0], "where()'s condition")
            a, b = args[1], args[2]
            if (a.type is BOOL) != (b.type is BOOL):
                self.fail(AttnTypeError, "where() branches must have the same type, found "
                          f"{a.type} and {b.type}", n.span)
            if a.type is not b.type:
                a, b = self.to_float(a, spans[1]), self.to_float(b, spans[2])
            return self.fold(ir.Call("where", (args[0], a, b), a.type, n.span))
        for a, s in zip(args, spans, strict=True):
            self.need_number(a, s, f"{f}()")
        if f in _INT_KEEPING and all(a.type is INT for a in args):
            return self.fold(ir.Call(f, tuple(args), INT, n.span))
        args = [self.to_float(a, s) for a, s in zip(args, spans, strict=True)]
        return self.fold(ir.Call(f, tuple(args), FLOAT, n.span))

    def vector_stage_only(self, n: ast.Call, stage):
        if stage not in ir.VECTOR_STAGES:
            where = "a const" if stage is None else f"the {stage} stage"
            self.fail(AttnScopeError, f"{n.func}() works on head vectors and cannot be used in "
                      f"{where}", n.func_span,
                      "it may be used in: " + ", ".join(ir.VECTOR_STAGES))

    def call_reduce(self, n: ast.Call, stage):
        self.vector_stage_only(n, stage)
        x = self.expr(n.args[0], stage)
        self.need_number(x, n.args[0].span, f"{n.func}()")
        return ir.Reduce(n.func, self.to_float(x, n.args[0].span), FLOAT, n.span)

    def call_rope(self, n: ast.Call, stage):
        self.vector_stage_only(n, stage)
        if len(n.args) not in (2, 3) or len(n.args) + len(n.kwargs) > 3:
            self.fail(AttnTypeError, f"{n.func}() takes (x, pos, theta=10000.0), found "
                      f"{len(n.args) + len(n.kwargs)} arguments", n.span)
        theta_node = n.args[2] if len(n.args) == 3 else None
        for kw in n.kwargs:
            if kw.name != "theta":
                self.fail(AttnTypeError, f"unexpected keyword argument '{kw.name}' of "
                          f"{n.func}()", kw.span, did_you_mean(kw.name, ["theta"]))
            theta_node = kw.value
        x = self.expr(n.args[0], stage)
        self.need_number(x, n.args[0].span, f"{n.func}()")
        pos = self.expr(n.args[1], stage)
        if pos.type is not INT:
            self.fail(AttnTypeError, f"{n.func}() position must be int, found {pos.type}",
                      n.args[1].span, "positions are q_pos, kv_pos or int expressions of them")
        if ir.varies_with_dim(pos):
            self.fail(AttnTypeError, f"{n.func}() position must be the same for the whole "
                      "vector", n.args[1].span)
        if theta_node is None:
            theta = ir.Const(10000.0, FLOAT)
        else:
            theta = self.expr(theta_node, stage)
            self.need_number(theta, theta_node.span, "theta")
            theta = self.to_float(theta, theta_node.span)
            if ir.varies_with_dim(theta):
                self.fail(AttnTypeError, "theta must be the same for the whole vector",
                          theta_node.span)
        return ir.Rope(self.to_float(x, n.args[0].span), pos, theta,
                       n.func == "rope_interleaved", FLOAT, n.span)

    # ---- type helpers ----

    def need(self, e: ir.Expr, ty: Type, span: Span, what: str):
        if e.type is not ty:
            hint = "compare it, e.g. 'x > 0'" if ty is BOOL else None
            self.fail(AttnTypeError, f"{what} expects {ty}, found {e.type}", span, hint)

    def need_number(self, e: ir.Expr, span: Span, what: str):
        if e.type is BOOL:
            self.fail(AttnTypeError, f"{what} expects a number, found bool", span,
                      "use where(cond, 1.0, 0.0) to turn a condition into a number")

    def to_float(self, e: ir.Expr, span: Span) -> ir.Expr:
        return self.fold(ir.Cast(e, FLOAT, span)) if e.type is INT else e


# ---- constant folding ----------------------------------------------------------------------


def _c_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _c_mod(a: int, b: int) -> int:
    return a - b * _c_div(a, b)


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
}

_FOLD_CALL = {
    "exp": math.exp, "exp2": lambda x: 2.0**x, "log": math.log, "log2": math.log2,
    "sqrt": math.sqrt, "rsqrt": lambda x: 1.0 / math.sqrt(x), "tanh": math.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)), "abs": abs, "floor": math.floor,
    "ceil": math.ceil, "softplus": lambda x: max(x, 0.0) + math.log1p(math.exp(-abs(x))),
    "min": min, "max": max, "pow": lambda a, b: float(a) ** float(b),
    "clamp": lambda x, lo, hi: min(max(x, lo), hi), "where": lambda c, a, b: a if c else b,
}


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_FLT_MAX = float(np.finfo(np.float32).max)
_RANGE_HINT = {
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


def _show(value) -> str:
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
        return _const(not e.x.value if e.op == "not" else -e.x.value, e)
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
                                  f"{', '.join(_show(a.value) for a in e.args)})") from None
        return _const(value, e)
    return e


def _const(value, e: ir.Expr) -> ir.Expr:
    problem = out_of_range(value, e.type)
    if problem:
        raise ConstRangeError(problem if isinstance(value, complex)
                              else f"{problem} (it is {_show(value)})")
    if e.type is FLOAT:
        value = float(value)
    elif e.type is INT:
        value = int(value)
    else:
        value = bool(value)
    return ir.Const(value, e.type, e.span)
