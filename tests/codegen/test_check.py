"""Checker: typed IR, promotions, const folding, scoping."""

import pytest

import attnlang as al
from attnlang import ir
from attnlang.ir import BOOL, FLOAT, INT


def stage(src: str, name: str):
    return al.parse("variant t\n" + src).stage(name)


def test_causal_expands_to_a_comparison():
    assert stage("mask = causal", "mask") == ir.Binary(
        "<=", ir.Var("kv_pos", INT), ir.Var("q_pos", INT), BOOL)


def test_int_promotes_to_float_with_explicit_cast():
    e = stage("logits = logits + q_pos", "logits")
    assert e == ir.Binary("+", ir.Var("logits", FLOAT), ir.Cast(ir.Var("q_pos", INT)), FLOAT)


def test_int_stage_result_is_cast_to_float():
    assert stage("logits = q_pos", "logits") == ir.Cast(ir.Var("q_pos", INT))


def test_consts_fold_with_c_semantics():
    v = al.parse("variant t\nconst a: int = -7 / 2\nconst b: int = -7 % 3\n"
                 "const c: float = 2 ** 3\nconst d: bool = 1 < 2 and not false\n"
                 "const e: float = a")
    assert dict(v.consts) == {"a": -3, "b": -1, "c": 8.0, "d": True, "e": -3.0}


def test_consts_become_literals_in_stages():
    e = stage("const w: int = 128\nmask = q_pos - kv_pos < w * 2", "mask")
    assert e.b == ir.Const(256, INT)


def test_constant_subexpressions_fold():
    assert stage("logits = logits * (2.0 * 3)", "logits").b == ir.Const(6.0, FLOAT)


def test_int_keeping_functions():
    assert stage("mask = max(q_pos, 3) > 0", "mask").a.type is INT
    assert stage("logits = min(logits, 3)", "logits").type is FLOAT


def test_reductions_and_rope():
    e = stage("query = rope(q * rsqrt(mean(q * q) + 1e-6), q_pos, theta=500.0)", "query")
    assert isinstance(e, ir.Rope) and not e.interleaved and e.theta == ir.Const(500.0, FLOAT)
    assert any(isinstance(n, ir.Reduce) and n.op == "mean" for n in ir.walk(e))
    assert stage("key = rope_interleaved(k, kv_pos)", "key").theta == ir.Const(10000.0, FLOAT)


def test_one_argument_max_is_a_reduction_two_arguments_a_scalar():
    assert isinstance(stage("value = max(v)", "value"), ir.Reduce)
    assert isinstance(stage("value = max(v, 0.0)", "value"), ir.Call)


def test_tensor_param_index():
    e = stage("param s: float[heads]\nlogits = logits * s[head]", "logits")
    assert e.b == ir.ParamIndex("s", (ir.Var("head", INT),), ("heads",), FLOAT)


def test_params_keep_order_and_defaults():
    v = al.parse("variant t\nparam b: int = -3\nparam a: float\nparam w: float[dim]")
    assert [(p.name, p.type, p.extents, p.default) for p in v.params] == [
        ("b", INT, (), -3), ("a", FLOAT, (), None), ("w", FLOAT, ("dim",), None)]


def test_softmax_flag():
    assert al.parse("variant t\nsoftmax = off").softmax is False
    assert al.parse("variant t").softmax is True


def test_varies_with_dim():
    assert ir.varies_with_dim(stage("query = q * 2.0", "query"))
    assert not ir.varies_with_dim(stage("query = sum(q) + 0.0 * q_pos", "query"))


@pytest.mark.parametrize("src, fragment", [
    ("mask = logits > 0", "'logits' is not visible in the mask stage"),
    ("logits = logits / 0", None),
    ("mask = q_pos / 0 > 1", "integer division by zero"),
    ("logits = exp(logits, 2.0)", "exp() takes 1 argument, found 2"),
    ("query = rope(q, q_pos, gamma=1.0)", "unexpected keyword argument 'gamma'"),
    ("query = rope(q, dim)", "position must be the same for the whole vector"),
    ("logits = sum", "'sum' is a function; call it"),
    ("mask = not q_pos", "'not' expects bool, found int"),
])
def test_type_errors(src, fragment):
    if fragment is None:  # float division by a literal zero is allowed (gives inf)
        al.parse("variant t\n" + src)
        return
    with pytest.raises(al.AttnError) as info:
        al.parse("variant t\n" + src)
    assert fragment in str(info.value)


def test_one_expression_reports_all_its_independent_errors():
    src = ("variant v\n"
           "logits = exp(logits, 1.0) + log(2.0, 3.0) * pow(abs(1.0, 2.0))\n")
    with pytest.raises(al.AttnError) as info:
        al.parse(src, filename="v.attn")
    found = [(e.span.line, e.span.col, e.message) for e in info.value.errors]
    assert found == [(2, 10, "exp() takes 1 argument, found 2"),
                     (2, 29, "log() takes 1 argument, found 2"),
                     (2, 45, "pow() takes 2 arguments, found 1"),
                     (2, 49, "abs() takes 1 argument, found 2")]
