"""Pass 1, parse: .attn text -> syntax tree (`attnlang.grammar.ast`) with source spans.

Lark's exceptions never escape: a syntax error becomes an `AttnSyntaxError` saying what was
expected and what was found, at the offending token.
"""

from __future__ import annotations

import functools

import lark
from lark import Token, Transformer, v_args
from lark.exceptions import (
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedInput,
    UnexpectedToken,
    VisitError,
)

from attnlang.errors import AttnError, AttnSyntaxError, Span
from attnlang.grammar import ast
from attnlang.paths import grammar_file

__all__ = ["parse_ast"]

# How each terminal reads in "expected ..." messages.
_TERMINAL_WORDS = {
    "NAME": "a name",
    "NUMBER": "a number",
    "MINUS": "'-'",
    "PLUS": "'+'",
    "MULOP": "'*', '/', '//' or '%'",
    "FLOORDIV": "'//'",
    "SHIFT": "'<<' or '>>'",
    "TILDE": "'~'",
    "AMP": "'&'",
    "BAR": "'|'",
    "CARET": "'^'",
    "POW": "'**'",
    "CMP": "a comparison",
    "OR": "'or'",
    "AND": "'and'",
    "NOT": "'not'",
    "TRUE": "'true'",
    "FALSE": "'false'",
    "WHERE": "'where'",
    "_VARIANT": "'variant'",
    "_PARAM": "'param'",
    "_CONST": "'const'",
    "_LET": "'let'",
    "_FOR": "'for'",
    "_IN": "'in'",
    "SOFTMAX": "'softmax'",
    "ON": "'on'",
    "OFF": "'off'",
    "$END": "end of file",
}


@functools.lru_cache(maxsize=1)
def _lark() -> lark.Lark:
    # cache=True keeps the LALR tables in the temp directory, keyed on the grammar and lark's
    # version: building them takes ~0.15 s, most of a front-end call's time.
    return lark.Lark(
        grammar_file().read_text(),
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=False,
        cache=True,
    )


def parse_ast(text: str, filename: str = "<string>") -> ast.Module:
    """Parse .attn source text into an `ast.Module`.

    >>> parse_ast("variant causal\\nmask = causal").name
    'causal'

    Raises AttnSyntaxError (with span and hint) on malformed input.
    """
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, text, filename) from None
    _check_nesting(tree, text, filename)
    try:
        return _ToAst(filename).transform(tree)
    except VisitError as e:  # an AttnError raised while building the AST
        if isinstance(e.orig_exc, AttnError):
            err = e.orig_exc
            err.source = err.source if err.source is not None else text
            raise err from None
        raise


# Deepest expression tree accepted (LANGUAGE.md section "Limits"). Every later pass walks
# expressions recursively, a few Python frames per level: this keeps them all far inside
# Python's recursion limit. A chain `a + b + c ...` is one level per operator.
MAX_NESTING = 128


def _check_nesting(tree: lark.Tree, text: str, filename: str) -> None:
    """Raise AttnSyntaxError at the first node nested deeper than MAX_NESTING (iterative)."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            meta = node.meta
            span = Span(filename, meta.line, meta.column, meta.end_line, meta.end_column) \
                if not meta.empty else None
            raise AttnSyntaxError(
                f"expression nested too deeply (more than {MAX_NESTING} levels of operators, "
                "calls and parentheses)", span,
                "split it into consts, or into simpler sub-expressions", text)
        stack.extend((c, depth + 1) for c in node.children if isinstance(c, lark.Tree))


def _describe_expected(expected: set[str]) -> str:
    parser = _lark()
    words = []
    for name in sorted(expected):
        if name in _TERMINAL_WORDS:
            words.append(_TERMINAL_WORDS[name])
            continue
        try:
            pattern = parser.get_terminal(name).pattern
            words.append(f"'{pattern.value}'" if pattern.type == "str" else name.lower())
        except KeyError:
            words.append(name.lower())
    words = sorted(set(words))
    if "NUMBER" in expected:
        return "an expression"
    if len(words) > 6:
        return "an operator or the next declaration"
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _syntax_error(e: UnexpectedInput, text: str, filename: str) -> AttnSyntaxError:
    line, col = getattr(e, "line", 1) or 1, getattr(e, "column", 1) or 1
    width = 1
    missing = _missing_right_hand_side(e, text)
    if missing is not None:
        line, col = missing
        message = "expected an expression after '=', found the end of the line"
        hint = "the right-hand side is missing"
    elif isinstance(e, UnexpectedToken) and e.token.type != "$END":
        found = f"'{e.token.value}'"
        width = max(1, len(str(e.token.value)))
        message = f"expected {_describe_expected(e.expected)}, found {found}"
        hint = _hint_for(e)
    elif isinstance(e, (UnexpectedEOF, UnexpectedToken)):
        # Just after the last token: the line a missing right-hand side belongs to.
        lines = text.rstrip().split("\n")
        line, col = len(lines), len(lines[-1]) + 1
        expected = getattr(e, "expected", None) or set()
        message = "unexpected end of file" + (
            f": expected {_describe_expected(set(expected))}" if expected else ""
        )
        hint = None
    elif isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else "?"
        message = f"unexpected character '{ch}'"
        hint = {"/": "comments start with '#'", ";": "comments start with '#'",
                "!": "write 'not' (or '!=' to compare)"}.get(ch)
    else:  # pragma: no cover - lark has no other UnexpectedInput kinds today
        message, hint = str(e).splitlines()[0], None
    span = Span(filename, line, col, line, col + width)
    return AttnSyntaxError(message, span, hint, text)


def _missing_right_hand_side(e: UnexpectedInput, text: str) -> tuple[int, int] | None:
    """(line, col) just after a trailing '=' when `e` comes from the statement below it:
    ``logits =`` then ``mask = causal`` parses as ``logits = mask`` and fails at the second
    '=', one line too late."""
    if not isinstance(e, UnexpectedToken) or e.token.value != "=":
        return None
    lines = text.split("\n")
    for prev in range(e.line - 2, -1, -1):  # the last non-blank line above the error
        stripped = lines[prev].split("#", 1)[0].rstrip()
        if stripped:
            if stripped.endswith("=") and not stripped.endswith(("==", "<=", ">=", "!=")):
                return prev + 1, len(stripped) + 1
            return None
    return None


def _hint_for(e: UnexpectedToken) -> str | None:
    if e.token.type == "AMP" and "NUMBER" in e.expected:  # a && b
        return "write 'and' ('&&' is C)"
    if e.token.type == "BAR" and "NUMBER" in e.expected:  # a || b
        return "write 'or' ('||' is C)"
    if e.token.value == "(" and e.expected <= {"NUMBER", "MINUS"}:  # param x: float = -(30.0)
        return "a param default is a number literal such as -30.0"
    if e.token.type == "NAME" and e.token.value in ("float", "int", "bool"):
        return None
    if e.token.type == "$END":
        return None
    if "NAME" in e.expected and e.token.type in ("SOFTMAX", "WHERE", "ON", "OFF", "TRUE",
                                                  "FALSE", "OR", "AND", "NOT"):
        return f"'{e.token.value}' is a keyword and cannot be used as a name"
    if e.token.type == "CMP":  # a < b < c, or a < b & c < d read as a < (b & c) < d
        return ("comparisons do not chain: write 'a < b and b < c'; '&' and '|' bind tighter "
                "than comparisons, as in Python: write (a < b) & (c < d)")
    if e.token.value == "=" and "CMP" in e.expected:
        return "use '==' to compare"
    return None


def _tok_span(filename: str, tok: Token) -> Span:
    return Span(filename, tok.line, tok.column, tok.end_line, tok.end_column)


class _ToAst(Transformer):
    """Lark tree -> ast nodes; every node gets the span of its text."""

    def __init__(self, filename: str):
        super().__init__(visit_tokens=False)
        self.filename = filename

    def _span(self, meta) -> Span:
        return Span(self.filename, meta.line, meta.column, meta.end_line, meta.end_column)

    def _tspan(self, tok: Token) -> Span:
        return _tok_span(self.filename, tok)

    @v_args(meta=True)
    def start(self, meta, children):
        (name_tok,), items = children[0], children[1:]
        return ast.Module(str(name_tok), tuple(items), self._span(meta), self._tspan(name_tok))

    def header(self, children):
        return children

    @v_args(meta=True)
    def param_decl(self, meta, children):
        name, type_name, rest = children[0], children[1], children[2:]
        extents, extent_spans, default = (), (), None
        for r in rest:
            if isinstance(r, tuple) and r[0] == "extent":
                extents = tuple(int(t) if t.type == "NUMBER" else str(t) for t in r[1])
                extent_spans = tuple(self._tspan(t) for t in r[1])
            elif isinstance(r, ast.Number):
                default = r
        return ast.ParamDecl(str(name), str(type_name), extents, default, self._span(meta),
                             self._tspan(name), self._tspan(type_name), extent_spans)

    def extent(self, children):
        for tok in children:
            if tok.type == "NUMBER" and not tok.isdigit():
                raise AttnSyntaxError(f"an extent is a whole number or a name, found {tok}",
                                      self._tspan(tok), "e.g. float[heads, 32]", None)
            if tok.type == "NUMBER" and len(tok) > 10:
                raise AttnSyntaxError(f"extent {tok[:12]}... is too large", self._tspan(tok),
                                      None, None)
        return ("extent", children)

    def default(self, children):
        return children[0]

    @v_args(meta=True)
    def signed_number(self, meta, children):
        num = self._number(children[-1])
        if len(children) == 2:  # leading minus
            num = ast.Number(-num.value, num.is_int, self._span(meta))
        return num

    @v_args(meta=True)
    def const_decl(self, meta, children):
        name, type_name, expr = children
        return ast.ConstDecl(str(name), str(type_name), expr, self._span(meta),
                             self._tspan(name), self._tspan(type_name))

    @v_args(meta=True)
    def let_decl(self, meta, children):
        name, expr = children
        return ast.LetDecl(str(name), expr, self._span(meta), self._tspan(name))

    @v_args(meta=True)
    def softmax_decl(self, meta, children):
        tok, onoff = children
        flag = ast.Boolean(str(onoff) == "on", self._tspan(onoff))
        return ast.StageDecl("softmax", flag, self._span(meta), self._tspan(tok))

    @v_args(meta=True)
    def stage_decl(self, meta, children):
        name, expr = children
        return ast.StageDecl(str(name), expr, self._span(meta), self._tspan(name))

    # ---- expressions ----

    def _number(self, tok: Token) -> ast.Number:
        text = str(tok)
        if len(text) > 64:  # beyond any int32 / float32 (and Python's int parsing limit)
            raise AttnSyntaxError(f"number literal {text[:12]}...{text[-4:]} is too long "
                                  f"({len(text)} characters)", self._tspan(tok),
                                  "ints are 32-bit and floats 32-bit: at most 64 characters "
                                  "reach no further", None)
        if any(c in text for c in ".eE"):
            return ast.Number(float(text), False, self._tspan(tok))
        return ast.Number(int(text), True, self._tspan(tok))

    def number(self, children):
        return self._number(children[0])

    def boolean(self, children):
        tok = children[0]
        return ast.Boolean(str(tok) == "true", self._tspan(tok))

    def name(self, children):
        tok = children[0]
        return ast.Name(str(tok), self._tspan(tok))

    @v_args(meta=True)
    def index(self, meta, children):
        name, indices = children[0], tuple(children[1:])
        return ast.Index(str(name), indices, self._span(meta), self._tspan(name))

    def callee(self, children):
        return children[0]

    @v_args(meta=True)
    def call(self, meta, children):
        func, rest = children[0], children[1:]
        args = tuple(a for a in rest if not isinstance(a, ast.Keyword))
        kwargs = tuple(a for a in rest if isinstance(a, ast.Keyword))
        return ast.Call(str(func), args, kwargs, self._span(meta), self._tspan(func))

    @v_args(meta=True)
    def comprehension(self, meta, children):
        func, body, var, range_func, *args = children
        return ast.Comprehension(str(func), body, str(var), str(range_func), tuple(args),
                                 self._span(meta), self._tspan(func), self._tspan(var),
                                 self._tspan(range_func))

    @v_args(meta=True)
    def kwarg(self, meta, children):
        name, value = children
        return ast.Keyword(str(name), value, self._span(meta))

    @v_args(meta=True)
    def binop(self, meta, children):
        a, op, b = children
        return ast.BinOp(str(op), a, b, self._span(meta), self._tspan(op))

    @v_args(meta=True)
    def unop(self, meta, children):
        op, x = children
        return ast.UnaryOp(str(op), x, self._span(meta))
