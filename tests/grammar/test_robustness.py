"""Inputs that used to crash the compiler (issue "No input crashes the compiler"): each is now
an AttnError with a position inside the file, or is accepted and compiles."""

import pytest

import attnlang
from attnlang.codegen.lower import lower
from attnlang.codegen.render import render
from attnlang.grammar.parser import MAX_NESTING
from attnlang.pipeline import decode_source


def rejected(source: str, match: str, line: int, col: int | None = None) -> attnlang.AttnError:
    with pytest.raises(attnlang.AttnError) as info:
        attnlang.parse(source, "x.attn")
    err = info.value.errors[0]
    assert match in err.message, err.message
    assert err.span is not None and err.span.line == line, str(err)
    if col is not None:
        assert err.span.col == col, str(err)
    shown = source.split("\n")[line - 1]
    assert f"\n  {shown}\n" in str(err)
    return err


@pytest.mark.parametrize("source, match, col", [
    ("mask = kv_pos < 2147483648", "literal 2147483648 does not fit in a 32-bit int", 17),
    ("mask = kv_pos < 99999999999999999999999", "does not fit in a 32-bit int", 17),
    ("const c: int = 2147483647 + 1\nmask = kv_pos < c", "does not fit in a 32-bit int", 16),
    ("logits = logits * 1e39", "literal 1e+39 is not a finite 32-bit float", 19),
    ("logits = logits * 1e400", "literal overflows to infinity", 19),
    ("logits = logits * exp(100.0)", "is not a finite 32-bit float", 19),
    ("logits = logits * (-1.0) ** 0.5", "is not a real number", 19),
    ("logits = logits * pow(-2, 0.5)", "is not a real number", 19),
    ("logits = logits * (1.0 / 0.0)", "divides by zero", 20),
    ("logits = logits * log(-1.0)", "has no finite value", 19),
    ("param n: int = 9223372036854775808\nmask = kv_pos < n", "default of param 'n'", 16),
    ("param x: float = 1e39\nlogits = logits * x", "default of param 'x'", 18),
])
def test_out_of_range_constants_are_checker_errors(source, match, col):
    rejected("variant a\n" + source, match, 2, col)


def test_float32_max_is_a_float():
    v = attnlang.parse("variant a\nlogits = logits * 3.4028235e38")
    render(lower(v), "decode", "bfloat16", 64, "sm_90a")


@pytest.mark.parametrize("body", [
    "logits = logits" + " + 1.0" * 500,
    "logits = " + "- " * 600 + "logits",
    "mask = " + " and ".join(["causal"] * 500),
    "logits = " + "abs(" * 330 + "logits" + ")" * 330,
])
def test_deep_nesting_is_an_error_past_the_limit(body):
    rejected("variant a\n" + body, f"more than {MAX_NESTING} levels", 2)


def test_nesting_just_under_the_limit_runs_every_pass():
    v = attnlang.parse("variant a\nlogits = logits" + " + 1.0" * (MAX_NESTING - 4))
    for kind in ("decode", "prefill"):
        render(lower(v), kind, "bfloat16", 64, "sm_90a")


def test_a_huge_integer_literal():
    rejected("variant a\nmask = kv_pos < " + "9" * 4301, "is too long (4301 characters)", 2, 17)


def test_bytes_that_are_not_utf8():
    with pytest.raises(attnlang.AttnSyntaxError) as info:
        decode_source(b"variant a\nmask = causal \xff\n", "x.attn")
    err = info.value
    assert "not UTF-8 text (byte 0xff)" in err.message
    assert (err.span.line, err.span.col) == (2, 15)


@pytest.mark.parametrize("sep", ["\x0c", "\x0b", "\u2028"])
def test_odd_line_breaks_show_the_right_line(sep):
    source = f"variant a\nlogits = logits{sep}\nmask = cuasal"
    with pytest.raises(attnlang.AttnError) as info:
        attnlang.parse(source, "x.attn")
    err = info.value.errors[0]
    shown = source.split("\n")[err.span.line - 1]
    assert f"\n  {shown}\n" in str(err)


def test_tabs_keep_the_caret_under_the_name():
    err = rejected("variant a\n\tmask =\tcuasal", "unknown name 'cuasal'", 2, 9)
    assert "\n  \t      \t^^^^^^" in str(err)


@pytest.mark.parametrize("source, match", [
    ("variantfoo\nmask = causal", "expected 'variant', found 'variantfoo'"),
    ("variant a\nsoftmax = onlogits = logits", "found 'onlogits'"),
])
def test_keywords_end_at_a_word_boundary(source, match):
    with pytest.raises(attnlang.AttnSyntaxError, match=match):
        attnlang.parse(source, "x.attn")


@pytest.mark.parametrize("name", ["__shared__", "NULL", "__LINE__", "__CUDA_ARCH__",
                                  "__device__", "__restrict__", "__func__", "ATTNLANG_HD"])
def test_param_names_never_reach_cpp_unprefixed(name):
    v = attnlang.parse(f"variant a\nparam {name}: float = 1.0\nlogits = logits * {name}")
    src = render(lower(v), "decode", "bfloat16", 64, "sm_90a")
    assert f"u_{name}" in src and f"param_{name}" in src
    assert f" {name};" not in src and f"p.{name}" not in src


def test_sm75_says_what_is_needed():
    from attnlang.runtime.compiler import resolve_arch

    with pytest.raises(ValueError, match="need compute capability 8.0 or newer"):
        resolve_arch("sm_75")


def test_a_missing_right_hand_side_is_reported_on_its_line():
    err = rejected("variant a\nlogits =\nmask = causal", "expected an expression after '='",
                   2, 9)
    assert err.hint == "the right-hand side is missing"


@pytest.mark.parametrize("source, hint", [
    ("variant a\nconst flag: bool = 1\nmask = causal", "a bool const is true, false"),
    ("variant a\nconst a: int = b\nconst b: int = 2\nmask = causal",
     "a const sees only the consts declared above it; 'b' is declared at line 3"),
    ("variant a\nmask = causal && causal", "write 'and'"),
    ("variant a\nparam w: float[heads]\nlogits = logits * w[0]",
     "write head there; a computed index needs a fixed extent"),
    ("variant a\nparam x: float = -(30.0)\nmask = causal", "a number literal such as -30.0"),
])
def test_new_users_mistakes_get_hints(source, hint):
    with pytest.raises(attnlang.AttnError) as info:
        attnlang.parse(source, "x.attn")
    assert hint in (info.value.errors[0].hint or ""), str(info.value)
