"""Parser: the syntax tree of every variant, spans, and syntax errors."""

import lark
import pytest

import attnlang as al
from attnlang.grammar import ast
from attnlang.grammar.parser import parse_ast
from tests.variant_files import VARIANT_FILES, VARIANT_IDS


@pytest.mark.parametrize("path", VARIANT_FILES, ids=VARIANT_IDS)
def test_every_variant_parses_and_checks(path):
    v = al.load(path)
    assert v.name == path.stem


def test_precedence():
    m = parse_ast("variant p\nlogits = -a ** 2 * b + c < d and not e or f")
    e = m.items[0].expr
    assert isinstance(e, ast.BinOp) and e.op == "or"
    conj = e.a
    assert conj.op == "and" and isinstance(conj.b, ast.UnaryOp) and conj.b.op == "not"
    cmp = conj.a
    assert cmp.op == "<" and cmp.a.op == "+"
    mul = cmp.a.a
    assert mul.op == "*" and isinstance(mul.a, ast.UnaryOp) and mul.a.op == "-"
    assert mul.a.x.op == "**"  # unary minus binds looser than **


def test_literals():
    m = parse_ast("variant l\nlogits = 4096 + 30. + 1e-6 + .5")
    nums = []

    def collect(n):
        if isinstance(n, ast.Number):
            nums.append((n.value, n.is_int))
        elif isinstance(n, ast.BinOp):
            collect(n.a)
            collect(n.b)

    collect(m.items[0].expr)
    assert nums == [(4096, True), (30.0, False), (1e-6, False), (0.5, False)]


def test_spans_point_at_tokens():
    src = "variant s\n\nlogits   = cap * x\n"
    m = parse_ast(src, "s.attn")
    stage = m.items[0]
    assert (stage.stage_span.line, stage.stage_span.col) == (3, 1)
    assert (stage.expr.span.line, stage.expr.span.col) == (3, 12)
    assert stage.expr.b.span.col == 18 and stage.expr.b.span.file == "s.attn"


def test_spans_do_not_affect_equality():
    a = al.parse("variant x\nlogits = tanh(logits)")
    b = al.parse("variant x\n\n\n   logits   =   tanh( logits )  # same variant\n")
    assert a == b and hash(a) == hash(b)


def test_keywords_are_not_prefixes_of_names():
    v = al.parse("variant x\nparam android: float = 1.0\nparam whereas: float = 2.0\n"
                 "logits = android * whereas * logits")
    assert [p.name for p in v.params] == ["android", "whereas"]


def test_syntax_error_never_leaks_lark():
    with pytest.raises(al.AttnSyntaxError) as info:
        al.parse("variant x\nlogits = (logits", "x.attn")
    assert not isinstance(info.value, lark.exceptions.LarkError)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert str(info.value).startswith("x.attn:")
