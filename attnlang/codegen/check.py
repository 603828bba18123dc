"""Pass 2, check: syntax tree -> typed IR (`attnlang.ir.Variant`).

Resolves every name (params, consts, built-ins), scopes built-ins to the stages that may read
them, checks and promotes types (explicit `Cast` nodes), expands `causal`, and folds consts
and constant sub-expressions. Every semantic error of the file is collected in one pass and
raised together as `AttnErrors`, sorted by position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnlang import ir
from attnlang.codegen.fold import RANGE_HINT, ConstRangeError, fold, out_of_range, show
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

__all__ = ["check"]

_TYPES = {"float": FLOAT, "int": INT, "bool": BOOL}
_ROPE_FUNCS = ("rope", "rope_interleaved")
_ALL_FUNCS = tuple(ir.SCALAR_FUNCS) + ir.REDUCTIONS + _ROPE_FUNCS + ("any", "all", "range")
_KEYWORDS = {"variant", "param", "const", "let", "softmax", "on", "off", "and", "or", "not",
             "true", "false", "where", "for", "in"}
# Names a declaration may not take.
_RESERVED = set(ir.INDEX_VARS) | set(_ALL_FUNCS) | {"float", "int", "bool"} | _KEYWORDS
# Float-only scalar functions (these keep ints; where, int and float are typed apart).
_INT_KEEPING = ("min", "max", "abs", "clamp", "mod")
# Bitwise operators; on two bools the first three are the logical and, or and xor.
_BITWISE = ("&", "|", "^", "<<", ">>")
_BOOL_BITWISE = {"&": "and", "|": "or", "^": "!="}
# The stage a let's body is checked in at its declaration: every name resolves, scopes are
# checked later, at each stage that uses the let.
_ANY_STAGE = "*"


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
    >>> v.mask  # doctest: +ELLIPSIS
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
        self.lets: dict[str, ast.LetDecl] = {}
        self.let_values: dict[tuple[str, str], ir.Expr | None] = {}  # (let, stage) -> IR
        self.let_uses: list[tuple[str, Span]] = []  # the lets being expanded, innermost last
        self.loop_vars: list[str] = []  # the bounded reductions' variables in scope
        # Names whose declaration had an error: uses stay silent (no cascade of errors).
        self.broken: set[str] = set()

    # ---- errors ----

    def error(self, cls: type[AttnError], message: str, span: Span | None, hint: str | None = None):
        if self.let_uses and cls is AttnScopeError:
            name, use = self.let_uses[-1]
            hint = f"{hint}; let '{name}' is used at line {use.line}" if hint else None
        err = cls(message, span, hint, self.source)
        # A let's body is checked once per stage that uses it: report each error once.
        if not any(type(e) is cls and str(e) == str(err) for e in self.errors):
            self.errors.append(err)

    def fail(self, cls: type[AttnError], message: str, span: Span | None, hint: str | None = None):
        self.error(cls, message, span, hint)
        raise _Poison

    # ---- driver ----

    def run(self, module: ast.Module) -> ir.Variant:
        # Every const of the file, to explain a use before its declaration.
        self.all_consts = {item.name: item.name_span for item in module.items
                           if isinstance(item, ast.ConstDecl)}
        self.all_lets = {item.name: item.name_span for item in module.items
                         if isinstance(item, ast.LetDecl)}
        stages: dict[str, ir.Expr | None] = {}
        stage_spans: dict[str, Span] = {}
        softmax = True
        for item in module.items:
            if isinstance(item, ast.ParamDecl):
                self.declare_param(item)
            elif isinstance(item, ast.ConstDecl):
                self.declare_const(item)
            elif isinstance(item, ast.LetDecl):
                self.declare_let(item)
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
        if ty is None or (ty is BOOL and not d.extents):
            hint = ("params are 'float' or 'int', tensors also 'bool' (a bool switch is a "
                    "const)")
            self.error(AttnTypeError, f"unknown param type '{d.type_name}'"
                       if ty is None else "a scalar param cannot be bool", d.type_span, hint)
            return
        extents = self.extents(d)
        if extents is None:
            return
        default = None
        if d.default is not None:
            if extents:
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
                           f"{show(d.default.value)})", d.default.span, RANGE_HINT[ty])
                return
            default = float(d.default.value) if ty is FLOAT else int(d.default.value)
        if ok:
            self.params[d.name] = ir.ParamSpec(d.name, ty, extents, default, d.span)
            self.broken.discard(d.name)

    def extents(self, d: ast.ParamDecl) -> tuple[str | int, ...] | None:
        """A tensor param's extents: named ones as they are, consts by value; None after an
        error."""
        out: list[str | int] = []
        for axis, (ext, span) in enumerate(zip(d.extents, d.extent_spans, strict=True)):
            if isinstance(ext, str) and ext in self.consts:
                const = self.consts[ext]
                if const.type is not INT:
                    self.error(AttnTypeError, f"extent '{ext}' must be an int const, found "
                               f"{const.type}", span)
                    return None
                ext = const.value
            if isinstance(ext, int):
                if not 1 <= ext <= ir.MAX_TENSOR_ELEMENTS:
                    self.error(AttnDeclarationError, f"an extent must be from 1 to "
                               f"{ir.MAX_TENSOR_ELEMENTS}, found {ext}", span)
                    return None
            elif ext not in ir.EXTENT_INDEX:
                named = [c for c, v in self.consts.items() if v.type is INT]
                hint = did_you_mean(ext, [*ir.EXTENT_INDEX, *named]) or (
                    "an extent is " + ", ".join(ir.EXTENT_INDEX) + ", a number or an int const")
                self.error(AttnDeclarationError, f"unknown tensor extent '{ext}'", span, hint)
                return None
            elif ext == "batch" and axis > 0:
                self.error(AttnDeclarationError, "'batch' can only be the first extent", span,
                           "the kernels stride by the other extents only: declare [batch, ...]")
                return None
            out.append(ext)
        if any(e in ir.PAIR_EXTENTS for e in out) and (
                tuple(out) != ir.PAIR_EXTENTS or d.type_name != "bool"):
            self.error(AttnDeclarationError, f"'{d.name}' uses extent q or kv: a per-pair "
                       "mask is declared exactly bool[q, kv]", d.extent_spans[0],
                       f"write 'param {d.name}: bool[q, kv]' and read it as "
                       f"{d.name}[q_row, kv_pos]")
            return None
        fixed = math.prod(e for e in out if isinstance(e, int))
        if fixed > ir.MAX_TENSOR_ELEMENTS:
            self.error(AttnDeclarationError, f"tensor param '{d.name}' has {fixed} elements per "
                       f"run-time extent, more than {ir.MAX_TENSOR_ELEMENTS}", d.extent_spans[0])
            return None
        return tuple(out)

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

    def declare_let(self, d: ast.LetDecl):
        """A let's body is checked here once for its names and types; each stage that uses
        it checks it again in its own scope (`let_value`)."""
        ok = self.declare_name(d.name, d.name_span)
        self.broken.add(d.name)
        try:
            self.expr(d.expr, _ANY_STAGE)
        except _Poison:
            return
        if ok:
            self.lets[d.name] = d
            self.broken.discard(d.name)

    def let_value(self, name: str, use: Span, stage: str) -> ir.Expr:
        key = (name, stage)
        if key not in self.let_values:
            self.let_values[key] = None  # an error inside is reported once per stage
            self.let_uses.append((name, use))
            outer_loops, self.loop_vars = self.loop_vars, []  # a let sees no loop variable
            try:
                self.let_values[key] = self.expr(self.lets[name].expr, stage)
            finally:
                self.let_uses.pop()
                self.loop_vars = outer_loops
        value = self.let_values[key]
        if value is None:
            raise _Poison
        return value

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
                     else f"{show(n.value)} {problem}")
            self.fail(AttnTypeError, f"the literal {shown}", n.span,
                      RANGE_HINT[INT if n.is_int else FLOAT])
        return ir.Const(n.value, INT if n.is_int else FLOAT, n.span)

    def fold(self, e: ir.Expr) -> ir.Expr:
        """`fold`, with a constant that leaves int32 / finite float32 reported at e."""
        try:
            return fold(e)
        except ConstRangeError as err:
            self.fail(AttnTypeError, f"this constant expression {err.problem}", e.span,
                      RANGE_HINT.get(e.type))

    def expr_Boolean(self, n: ast.Boolean, stage):
        return ir.Const(n.value, BOOL, n.span)

    def expr_Name(self, n: ast.Name, stage):
        if n.id in self.loop_vars:
            return ir.LoopVar(n.id, INT, n.span)
        if n.id in self.broken:
            raise _Poison
        if n.id in self.consts:
            c = self.consts[n.id]
            return ir.Const(c.value, c.type, n.span)
        if stage is None:  # inside a const declaration
            if n.id in self.params or n.id in ir.INDEX_VARS or n.id in self.lets:
                self.fail(AttnDeclarationError, f"a const cannot use '{n.id}'", n.span,
                          "a const may use literals and earlier consts only")
            self.unknown_name(n.id, n.span, stage)
        if n.id in self.lets:
            return self.let_value(n.id, n.span, stage)
        if n.id in self.params:
            p = self.params[n.id]
            if p.is_tensor:
                self.fail(AttnTypeError, f"tensor param '{n.id}' must be indexed", n.span,
                          f"write {n.id}[{_index_hint(p)}]")
            return ir.Param(n.id, p.type, n.span)
        if n.id in ir.INDEX_VARS:
            self.check_scope(n.id, stage, n.span)
            ty = ir.INDEX_VARS[n.id][0]
            if n.id == "causal":
                kv_pos = ir.Var("kv_pos", INT, n.span)
                q_pos = ir.Var("q_pos", INT, n.span)
                return ir.Binary("<=", kv_pos, q_pos, BOOL, n.span)
            if n.id == "q_row":  # q_pos - (kv_len - qo_len): the backends know q_pos only
                offset = ir.Binary("-", ir.Var("kv_len", INT, n.span),
                                   ir.Var("qo_len", INT, n.span), INT, n.span)
                return ir.Binary("-", ir.Var("q_pos", INT, n.span), offset, INT, n.span)
            return ir.Var(n.id, ty, n.span)
        self.unknown_name(n.id, n.span, stage)

    def unknown_name(self, name: str, span: Span, stage: str | None):
        if name in _ALL_FUNCS:
            self.fail(AttnTypeError, f"'{name}' is a function; call it", span,
                      f"write {name}(...)")
        visible = set(self.consts)
        if stage is not None:
            visible |= set(self.params) | set(self.lets)
            visible |= {v for v, (_, stages) in ir.INDEX_VARS.items()
                        if stage in stages or stage == _ANY_STAGE}
        later = self.all_consts.get(name)
        if later is not None and stage is None:
            self.fail(AttnNameError, f"const '{name}' is used before its declaration", span,
                      f"a const sees only the consts declared above it; '{name}' is declared "
                      f"at line {later.line}: move it up")
        later = self.all_lets.get(name)
        if later is not None and stage is not None:
            self.fail(AttnNameError, f"let '{name}' is used before its declaration", span,
                      f"a let is visible below its declaration only; '{name}' is declared "
                      f"at line {later.line}: move it up")
        hint = did_you_mean(name, visible) or did_you_mean(name, ir.INDEX_VARS)
        if hint is None and stage is not None:
            hint = "declare it with 'param' (run time) or 'const' (compile time)"
        self.fail(AttnNameError, f"unknown name '{name}'", span, hint)

    def check_scope(self, name: str, stage: str | None, span: Span):
        allowed = ir.INDEX_VARS[name][1]
        if stage in allowed or stage == _ANY_STAGE:
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
            if n.name in ir.INDEX_VARS or n.name in self.consts or n.name in self.lets:
                self.fail(AttnTypeError, f"'{n.name}' is a scalar and cannot be indexed",
                          n.name_span)
            self.unknown_name(n.name, n.name_span, stage)
        if not p.is_tensor:
            self.fail(AttnTypeError, f"scalar param '{n.name}' cannot be indexed", n.name_span,
                      f"declare it as 'param {n.name}: {p.type}[heads]' (or kv_heads, batch, "
                      "dim, a number or an int const; several for a table) to pass a tensor")
        if len(n.indices) != len(p.extents):
            self.fail(AttnTypeError, f"'{n.name}' is {p.declared}: it takes {len(p.extents)} "
                      f"ind{'ex' if len(p.extents) == 1 else 'ices'}, found {len(n.indices)}",
                      n.span, f"write {n.name}[{_index_hint(p)}]")
        indices = self.exprs(n.indices, stage)
        for axis, (extent, node, e) in enumerate(zip(p.extents, n.indices, indices, strict=True)):
            if isinstance(extent, str):
                want = ir.EXTENT_INDEX[extent]
                if not (isinstance(node, ast.Name) and node.id == want):
                    hint = (f"a per-pair mask is read at the pair itself: {n.name}[q_row, kv_pos]"
                            if p.is_pair else f"write {want} there; a computed index needs a "
                            "fixed extent, such as [32] or an int const")
                    self.fail(AttnTypeError, f"axis {axis} of '{n.name}' has extent {extent} and "
                              f"is indexed by '{want}'", node.span, hint)
            elif e.type is not INT:
                self.fail(AttnTypeError, f"an index of '{n.name}' must be int, found {e.type}",
                          node.span, "convert a float with int(x) (toward zero) or "
                          "int(floor(x))" if e.type is FLOAT else None)
            elif isinstance(e, ir.Const) and not 0 <= e.value < extent:
                self.fail(AttnTypeError, f"index {e.value} is outside axis {axis} of "
                          f"'{n.name}' (0 to {extent - 1})", node.span)
        return ir.ParamIndex(n.name, tuple(indices), p.extents, p.type, n.span)

    def expr_UnaryOp(self, n: ast.UnaryOp, stage):
        x = self.expr(n.x, stage)
        if n.op == "not" or (n.op == "~" and x.type is BOOL):  # ~ on a bool: torch's not
            self.need(x, BOOL, n.x.span, f"'{n.op}'")
            return self.fold(ir.Unary("not", x, BOOL, n.span))
        if n.op == "~":
            self.need(x, INT, n.x.span, "'~'")
            return self.fold(ir.Unary("~", x, INT, n.span))
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
        if op in _BOOL_BITWISE and a.type is BOOL and b.type is BOOL:
            return self.fold(ir.Binary(_BOOL_BITWISE[op], a, b, BOOL, n.span))
        if op in _BITWISE:
            if a.type is not INT or b.type is not INT:
                self.fail(AttnTypeError, f"'{op}' takes two ints"
                          + (" or two bools" if op in _BOOL_BITWISE else "")
                          + f", found {a.type} and {b.type}", n.span, _bitwise_hint(a, b))
            if op in ("<<", ">>") and isinstance(b, ir.Const) and not 0 <= b.value <= 31:
                self.fail(AttnTypeError, f"shift count {b.value} is outside 0 to 31", n.b.span,
                          "ints are 32-bit")
            return self.fold(ir.Binary(op, a, b, INT, n.span))
        self.need_number(a, n.a.span, f"'{op}'")
        self.need_number(b, n.b.span, f"'{op}'")
        if op == "**":
            a, b = self.to_float(a, n.a.span), self.to_float(b, n.b.span)
            return self.fold(ir.Binary(op, a, b, FLOAT, n.span))
        if a.type is not b.type:
            a, b = self.to_float(a, n.a.span), self.to_float(b, n.b.span)
        ty = BOOL if op in ("<", "<=", ">", ">=", "==", "!=") else a.type
        if op in ("/", "//", "%") and isinstance(b, ir.Const) and b.type is INT and b.value == 0:
            self.fail(AttnTypeError, f"integer {'modulo' if op == '%' else 'division'} by zero",
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
        if f == "float":
            return self.to_float(args[0], spans[0])
        if f == "int":
            return args[0] if args[0].type is INT else self.fold(
                ir.Call("int", (args[0],), INT, n.span))
        if f in _INT_KEEPING and all(a.type is INT for a in args):
            if f == "mod" and isinstance(args[1], ir.Const) and args[1].value == 0:
                self.fail(AttnTypeError, "integer modulo by zero", spans[1])
            return self.fold(ir.Call(f, tuple(args), INT, n.span))
        args = [self.to_float(a, s) for a, s in zip(args, spans, strict=True)]
        return self.fold(ir.Call(f, tuple(args), FLOAT, n.span))

    def expr_Comprehension(self, n: ast.Comprehension, stage):
        """`op(body for var in range(...))`: a loop the kernels run per element."""
        if n.func not in ir.LOOP_REDUCTIONS:
            self.fail(AttnTypeError, f"'{n.func}' cannot reduce over a range", n.func_span,
                      "the reductions over a range are " + ", ".join(ir.LOOP_REDUCTIONS))
        if n.range_func != "range":
            self.fail(AttnTypeError, f"expected range(...), found '{n.range_func}'",
                      n.range_span, "write 'for i in range(N)' or 'range(start, stop)'")
        if stage is None:
            self.fail(AttnDeclarationError, "a const cannot use a reduction over a range",
                      n.span, "a const may use literals and earlier consts only")
        if not 1 <= len(n.range_args) <= 2:
            self.fail(AttnTypeError, f"range() takes 1 or 2 arguments, found "
                      f"{len(n.range_args)}", n.range_span)
        bounds = []
        for arg in self.exprs(n.range_args, None):
            if not (isinstance(arg, ir.Const) and arg.type is INT):
                self.fail(AttnTypeError, "range() bounds must be int constants", arg.span,
                          "literals or int consts: the kernels unroll nothing at run time")
            bounds.append(arg.value)
        start, stop = (0, bounds[0]) if len(bounds) == 1 else bounds
        if not 1 <= stop - start <= ir.MAX_LOOP_COUNT:
            self.fail(AttnTypeError, f"range({', '.join(map(str, bounds))}) has "
                      f"{max(stop - start, 0)} values; a reduction takes 1 to "
                      f"{ir.MAX_LOOP_COUNT}", n.range_span)
        if n.var in _RESERVED or n.var in self.declared_at or n.var in self.loop_vars:
            self.fail(AttnNameError, f"the loop variable '{n.var}' hides another name",
                      n.var_span, "choose another name")
        self.loop_vars.append(n.var)
        try:
            body = self.expr(n.body, stage)
        finally:
            self.loop_vars.pop()
        if any(isinstance(e, (ir.Reduce, ir.Rope)) for e in ir.walk(body)):
            self.fail(AttnTypeError, "a reduction over dim or a rope cannot be inside a "
                      "reduction over a range", n.body.span,
                      "compute it outside, e.g. in a let")
        if n.func in ("any", "all"):
            self.need(body, BOOL, n.body.span, f"{n.func}()")
        else:
            self.need_number(body, n.body.span, f"{n.func}()")
        return ir.Loop(n.func, n.var, start, stop, body, body.type, n.span)

    def vector_stage_only(self, n: ast.Call, stage):
        if stage not in ir.VECTOR_STAGES and stage != _ANY_STAGE:
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


def _index_hint(p: ir.ParamSpec) -> str:
    """How to index p: its named extents' variables, `i` for a fixed extent."""
    return ", ".join(ir.EXTENT_INDEX[e] if isinstance(e, str) else "i" for e in p.extents)


def _bitwise_hint(a: ir.Expr, b: ir.Expr) -> str | None:
    if BOOL in (a.type, b.type):
        return ("'&', '|' and '^' bind tighter than comparisons, as in Python: write "
                "(a < b) & (c < d), or use 'and' / 'or'")
    if FLOAT in (a.type, b.type):
        return "convert a float with int(x)"
    return None
