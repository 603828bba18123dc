"""Untyped syntax tree of an .attn file, as the parser builds it.

Every node carries the Span of its text; spans are excluded from equality, so two files
that differ only in layout give equal trees. Names are not resolved here: that is the
checker's job (`attnlang.codegen.check`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnlang.errors import Span


def _span() -> Span:
    return field(default=None, compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class Node:
    """Base of all syntax nodes."""


# ---- expressions -------------------------------------------------------------------------


@dataclass(frozen=True)
class Number(Node):
    """A numeric literal; `is_int` for literals without '.', 'e' (4096, not 4096. or 1e3)."""

    value: int | float
    is_int: bool
    span: Span = _span()


@dataclass(frozen=True)
class Boolean(Node):
    value: bool
    span: Span = _span()


@dataclass(frozen=True)
class Name(Node):
    id: str
    span: Span = _span()


@dataclass(frozen=True)
class Index(Node):
    """`name[i, j, ...]`: an element of a tensor param; each index is an expression."""

    name: str
    indices: tuple[Node, ...]
    span: Span = _span()
    name_span: Span = _span()


@dataclass(frozen=True)
class Keyword(Node):
    """`name=value` inside a call's argument list."""

    name: str
    value: Node
    span: Span = _span()


@dataclass(frozen=True)
class Call(Node):
    func: str
    args: tuple[Node, ...]
    kwargs: tuple[Keyword, ...]
    span: Span = _span()
    func_span: Span = _span()


@dataclass(frozen=True)
class Comprehension(Node):
    """`func(body for var in range(args...))`: a reduction over a bounded integer range."""

    func: str
    body: Node
    var: str
    range_func: str
    range_args: tuple[Node, ...]
    span: Span = _span()
    func_span: Span = _span()
    var_span: Span = _span()
    range_span: Span = _span()


@dataclass(frozen=True)
class BinOp(Node):
    """Binary operators, comparisons and `and`/`or`; `op` is the source spelling."""

    op: str
    a: Node
    b: Node
    span: Span = _span()
    op_span: Span = _span()


@dataclass(frozen=True)
class UnaryOp(Node):
    """`-x`, `~x` or `not x`."""

    op: str
    x: Node
    span: Span = _span()


# ---- declarations and stages -------------------------------------------------------------


@dataclass(frozen=True)
class ParamDecl(Node):
    """`param NAME: TYPE[EXTENT, ...] = DEFAULT` (extents and default optional).

    extents: each a name (`heads`, a const) or an int literal; empty for a scalar param.
    """

    name: str
    type_name: str
    extents: tuple[str | int, ...]
    default: Number | None
    span: Span = _span()
    name_span: Span = _span()
    type_span: Span = _span()
    extent_spans: tuple[Span, ...] = field(default=(), compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class ConstDecl(Node):
    """`const NAME: TYPE = EXPR`."""

    name: str
    type_name: str
    expr: Node
    span: Span = _span()
    name_span: Span = _span()
    type_span: Span = _span()


@dataclass(frozen=True)
class LetDecl(Node):
    """`let NAME = EXPR`: a name for an expression, usable by the stages below it."""

    name: str
    expr: Node
    span: Span = _span()
    name_span: Span = _span()


@dataclass(frozen=True)
class StageDecl(Node):
    """`STAGE = EXPR`; for `softmax = on|off`, expr is a Boolean."""

    stage: str
    expr: Node
    span: Span = _span()
    stage_span: Span = _span()


@dataclass(frozen=True)
class Module(Node):
    """A whole file: `variant NAME` and its declarations and stages, in source order."""

    name: str
    items: tuple[Node, ...]
    span: Span = _span()
    name_span: Span = _span()
