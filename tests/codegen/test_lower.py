"""The lower pass: typed IR -> C++ hooks (docs/INTERNALS.md, "The hook interface").

Hand-built IR for each node kind, checked against the C text it must produce; then the
example zoo through the real front end (flags, params, #line directives).
"""

from __future__ import annotations

import re

import pytest

import attnlang
from attnlang import ir
from attnlang.codegen.c_expr import Env, expr_c
from attnlang.codegen.lower import LINE_RESET, KernelParam, lower
from attnlang.errors import Span
from attnlang.ir import BOOL, FLOAT, INT
from tests.variant_files import VARIANT_FILES, VARIANT_IDS

F, N = FLOAT, INT  # short names for the hand-built IR below


def C(v, t=None):
    t = t or (BOOL if isinstance(v, bool) else INT if isinstance(v, int) else FLOAT)
    return ir.Const(v, t)


def V(name, t=INT):
    return ir.Var(name, t)


def B(op, a, b, t=None):
    return ir.Binary(op, a, b, t or (BOOL if op in ("<", "<=", ">", ">=", "==", "!=", "and",
                                                    "or") else a.type))


def call(fn, *args, t=FLOAT):
    return ir.Call(fn, tuple(args), t)


def scalar(e, stage="logits"):
    return expr_c(e, Env(stage))


def elem(e, stage="query"):
    return expr_c(e, Env(stage, elem=True, input=ir.STAGE_INPUT[stage]))


# ---------------------------------------------------------------------------- literals


@pytest.mark.parametrize("const, text", [
    (C(1.5), "1.5f"),
    (C(50.0), "50.0f"),
    (C(1e-6), "1e-06f"),
    (C(-2.0), "(-2.0f)"),
    (C(1e20), "1e+20f"),
    (C(4096), "4096"),
    (C(-3), "(-3)"),
    (C(True), "true"),
    (C(False), "false"),
])
def test_literals(const, text):
    assert scalar(const) == text


def test_int_promoted_to_float_is_a_float_literal():
    assert scalar(ir.Cast(C(4096))) == "4096.0f"
    assert scalar(ir.Cast(V("q_pos"))) == "((float)(ix.q_pos))"


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e39])
def test_non_float32_constants_are_rejected(bad):
    with pytest.raises(ValueError, match="float32"):
        scalar(C(bad, FLOAT))


def test_int_constant_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="32-bit"):
        scalar(C(2**31))


# ---------------------------------------------------------------------------- names


@pytest.mark.parametrize("name, text", [
    ("batch", "ix.batch"), ("head", "ix.head"), ("kv_head", "ix.kv_head"),
    ("qo_len", "ix.qo_len"), ("kv_len", "ix.kv_len"), ("q_pos", "ix.q_pos"),
    ("kv_pos", "ix.kv_pos"), ("num_heads", "ix.num_heads"),
    ("num_kv_heads", "ix.num_kv_heads"), ("head_dim", "attnlang::kHeadDim"),
    ("causal", "(ix.kv_pos <= ix.q_pos)"),
])
def test_index_names(name, text):
    assert scalar(V(name, BOOL if name == "causal" else INT)) == text


def test_float_names():
    assert scalar(V("sm_scale", F)) == "ix.sm_scale"
    assert scalar(V("logits", F)) == "s"


def test_stage_input_and_dim_are_per_element():
    assert elem(V("q", F)) == "x[i]"
    assert elem(V("k", F), "key") == "x[i]"
    assert elem(V("dim")) == "dim"
    with pytest.raises(ValueError, match="per-element"):
        scalar(V("dim"), "query")


def test_params():
    assert scalar(ir.Param("cap", F)) == "p.u_cap"
    def table(name, ty, *axes):
        return ir.ParamIndex(name, tuple(i for i, _ in axes), tuple(n for _, n in axes), ty)

    # A named extent's index is the kernel's own variable: Known, no bound test.
    assert (scalar(table("slopes", F, (V("head"), "heads")))
            == "attnlang::table_at(p.u_slopes, attnlang::Known{ix.head}, ix.num_heads)")
    assert (scalar(table("kvw", F, (V("kv_head"), "kv_heads")))
            == "attnlang::table_at(p.u_kvw, attnlang::Known{ix.kv_head}, ix.num_kv_heads)")
    assert (scalar(table("prefix", N, (V("batch"), "batch")))
            == "attnlang::table_at(p.u_prefix, attnlang::Known{ix.batch}, 0)")
    assert (elem(table("w", F, (V("dim"), "dim")))
            == "attnlang::table_at(p.u_w, attnlang::Known{dim}, (VEC * TX))")
    # A computed index on a fixed extent is bound-tested; a bool table reads bytes.
    rel = B("-", V("q_pos"), V("kv_pos"))
    assert (scalar(table("bias", F, (V("head"), "heads"), (rel, 32)))
            == "attnlang::table_at(p.u_bias, attnlang::Known{ix.head}, ix.num_heads, "
               "(ix.q_pos - ix.kv_pos), 32)")
    assert (scalar(table("g", ir.BOOL, (V("batch"), "batch"), (V("kv_pos"), 64)))
            == "(attnlang::table_at(p.u_g, attnlang::Known{ix.batch}, 0, ix.kv_pos, 64) != 0)")


def test_param_names_are_prefixed_in_cpp():
    """A param named like a C++ keyword or a CUDA macro stays clear of it."""
    v = ir.Variant("kw", params=(ir.ParamSpec("class", F, default=1.0),),
                   logits=B("*", V("logits", F), ir.Param("class", F)))
    h = lower(v)
    assert "float u_class;" in h.params_struct
    assert "(s * p.u_class)" in h.logits
    assert h.kernel_params == (KernelParam("param_class", "float", "u_class"),)


# ---------------------------------------------------------------------------- operators


@pytest.mark.parametrize("e, text", [
    (B("+", C(1.5), ir.Param("a", F)), "(1.5f + p.u_a)"),
    (B("-", V("q_pos"), V("kv_pos")), "(ix.q_pos - ix.kv_pos)"),
    (B("*", C(2.0), V("logits", F)), "(2.0f * s)"),
    (B("/", V("q_pos"), C(3)), "(ix.q_pos / 3)"),  # int: C's truncation toward zero
    (B("%", V("q_pos"), C(7)), "(ix.q_pos % 7)"),
    # A constant divisor: its (folded) reciprocal, corrected to IEEE's quotient where an ulp
    # could flip a comparison or truncation; a power of two's reciprocal is exact.
    (B("/", V("logits", F), C(3.0)), "(s * (1.0f / 3.0f))"),
    (B("<", B("/", V("logits", F), C(3.0)), C(1.0)), "(attnlang::div_invariant(s, 3.0f) < 1.0f)"),
    (B("<", B("/", V("logits", F), C(4.0)), C(1.0)), "((s * (1.0f / 4.0f)) < 1.0f)"),
    (B("//", V("logits", F), C(3.0)), "floorf(s / 3.0f)"),
    (B("%", V("logits", F), C(3.0)), "fmodf(s, 3.0f)"),
    (B("**", V("logits", F), C(2.0)), "powf(s, 2.0f)"),
    (B("<", V("kv_pos"), V("q_pos")), "(ix.kv_pos < ix.q_pos)"),
    (B("!=", V("kv_pos"), C(0)), "(ix.kv_pos != 0)"),
    (B(">=", V("logits", F), C(0.0)), "(s >= 0.0f)"),
    (B("and", C(True), V("causal", BOOL)), "(true && (ix.kv_pos <= ix.q_pos))"),
    (B("or", C(False), C(True)), "(false || true)"),
    (ir.Unary("-", V("logits", F), F), "(-s)"),
    (ir.Unary("-", V("q_pos"), N), "(-ix.q_pos)"),
    (ir.Unary("not", C(True), BOOL), "(!true)"),
])
def test_operators(e, text):
    assert scalar(e) == text


@pytest.mark.parametrize("fn, args, t, text", [
    ("exp", ("s",), F, "__expf(s)"),
    ("exp2", ("s",), F, "attnlang::ex2_approx(s)"),
    ("log", ("s",), F, "__logf(s)"),
    ("log2", ("s",), F, "__log2f(s)"),
    ("sqrt", ("s",), F, "sqrtf(s)"),
    ("rsqrt", ("s",), F, "rsqrtf(s)"),
    ("tanh", ("s",), F, "attnlang::tanh_approx(s)"),
    ("sigmoid", ("s",), F, "attnlang::sigmoid(s)"),
    ("softplus", ("s",), F, "attnlang::softplus(s)"),
    ("abs", ("s",), F, "fabsf(s)"),
    ("abs", ("q",), N, "attnlang::iabs(ix.q_pos)"),
    ("floor", ("s",), F, "floorf(s)"),
    ("ceil", ("s",), F, "ceilf(s)"),
    ("min", ("s", "s"), F, "fminf(s, s)"),
    ("max", ("s", "s"), F, "fmaxf(s, s)"),
    ("min", ("q", "q"), N, "attnlang::imin(ix.q_pos, ix.q_pos)"),
    ("max", ("q", "q"), N, "attnlang::imax(ix.q_pos, ix.q_pos)"),
    ("pow", ("s", "s"), F, "powf(s, s)"),
    ("clamp", ("s", "s", "s"), F, "fminf(fmaxf(s, s), s)"),
    ("clamp", ("q", "q", "q"), N, "attnlang::imin(attnlang::imax(ix.q_pos, ix.q_pos), ix.q_pos)"),
    ("where", ("c", "s", "s"), F, "((ix.kv_pos <= ix.q_pos) ? s : s)"),
    ("where", ("c", "q", "q"), N, "((ix.kv_pos <= ix.q_pos) ? ix.q_pos : ix.q_pos)"),
])
def test_calls(fn, args, t, text):
    operands = {"s": V("logits", F), "q": V("q_pos"), "c": V("causal", BOOL)}
    assert scalar(call(fn, *(operands[a] for a in args), t=t)) == text


def test_every_scalar_function_has_a_c_form():
    from attnlang.codegen.c_expr import _CALLS

    # float() is a Cast by the time it reaches the lowering; int() yields an int.
    for fn in set(ir.SCALAR_FUNCS) - {"float", "int"}:
        assert (fn, FLOAT) in _CALLS, fn
    assert ("int", INT) in _CALLS


# ---------------------------------------------------------------------------- scalar stages


def test_logits_and_mask_hooks():
    v = ir.Variant(
        "softcap", params=(ir.ParamSpec("cap", F, default=30.0),),
        logits=B("*", ir.Param("cap", F),
                 call("tanh", B("/", V("logits", F), ir.Param("cap", F)))),
        mask=B("<=", V("kv_pos"), V("q_pos")))
    h = lower(v)
    assert h.logits == (
        "__device__ __forceinline__ float logits(const float s, const Params& p, "
        "const Index& ix) {\n  return (p.u_cap * attnlang::tanh_approx((s * (1.0f / "
        "p.u_cap))));\n}")
    assert "return (ix.kv_pos <= ix.q_pos);" in h.mask
    assert h.has_logits and h.has_mask and not h.has_query


def test_identity_defaults_and_flags():
    h = lower(ir.Variant("full"))
    assert h.logits.endswith("{ return s; }  // identity")
    assert h.mask.endswith("{ return true; }  // identity")
    for stage in ("query", "key", "value", "output"):
        text = getattr(h, stage)
        assert text.startswith("template <int VEC, int TX>\n__device__ __forceinline__ void "
                               f"{stage}(float (&x)[VEC], const int dim0, const Params& p, "
                               "const Index& ix) {}  // identity")
    for flag in ("kHasQuery", "kHasKey", "kHasValue", "kHasLogits", "kHasMask", "kHasOutput"):
        assert f"inline constexpr bool {flag} = false;" in h.flags
    assert "inline constexpr bool kSoftmax = true;" in h.flags
    assert "#line" not in h.source and LINE_RESET not in h.source
    assert h.params_struct == "struct Params {};"
    assert h.params_init == "const variant::Params params{};"
    assert h.kernel_params == () and h.kernel_params_decl == ""


def test_softmax_off_flag():
    h = lower(ir.Variant("sig", logits=call("sigmoid", V("logits", F)), softmax=False))
    assert "inline constexpr bool kSoftmax = false;" in h.flags
    assert not h.softmax


@pytest.mark.parametrize("name, scans", [("causal", False), ("full", False),
                                         ("sliding_window", False), ("longformer", True)])
def test_mask_tile_scans_flag(name, scans):
    # longformer's tile class scans is_global over the tile's keys (span_tri): the tensor-core
    # decode kernel must not class a whole item's keys at once there.
    h = lower(attnlang.load(VARIANT_FILES[VARIANT_IDS.index(name)]))
    assert f"inline constexpr bool kMaskTileScans = {'true' if scans else 'false'};" in h.flags
    assert ("span_tri(" in h.mask_tile) == scans


def test_params_struct_and_kernel_params_keep_declaration_order():
    v = ir.Variant("p", params=(
        ir.ParamSpec("cap", F, default=50.0), ir.ParamSpec("slopes", F, "heads"),
        ir.ParamSpec("window", N, default=4), ir.ParamSpec("prefix", N, "batch")))
    h = lower(v)
    members = re.findall(r"^  (.+?);", h.params_struct, re.M)
    assert members == ["float u_cap", "const float* u_slopes", "int u_window",
                       "const int* u_prefix"]
    assert [(p.name, p.ctype) for p in h.kernel_params] == [
        ("param_cap", "float"), ("param_slopes", "const float*"), ("param_window", "int"),
        ("param_prefix", "const int*")]
    assert h.kernel_params_decl == (",\n    float param_cap,\n    const float* param_slopes,"
                                    "\n    int param_window,\n    const int* param_prefix")
    assert h.params_init == ("const variant::Params params{param_cap, param_slopes, "
                             "param_window, param_prefix};")


# ---------------------------------------------------------------------------- vector stages


def test_elementwise_vector_stage():
    w = ir.ParamIndex("w", (V("dim"),), ("dim",), F)
    h = lower(ir.Variant("scale", params=(ir.ParamSpec("w", F, ("dim",)),),
                         value=B("*", V("v", F), w)))
    assert "for (int i = 0; i < VEC; ++i) {" in h.value
    assert "const int dim = dim0 + i;" in h.value
    assert ("x[i] = (x[i] * attnlang::table_at(p.u_w, attnlang::Known{dim}, (VEC * TX)));"
            in h.value)
    assert h.has_value


def test_dim_is_defined_only_when_read():
    h = lower(ir.Variant("neg", output=ir.Unary("-", V("o", F), F)))
    assert "const int dim =" not in h.output
    assert "x[i] = (-x[i]);" in h.output


def test_reductions_are_hoisted_inner_first_and_shared():
    q = V("q", F)
    inner = ir.Reduce("mean", B("*", q, q))
    outer = ir.Reduce("max", B("*", q, call("rsqrt", B("+", inner, C(1e-6)))))
    # inner appears twice: once inside outer, once at top level; it is computed once.
    e = B("-", B("*", q, call("rsqrt", B("+", inner, C(1e-6)))), outer)
    h = lower(ir.Variant("norm", query=e))
    body = h.query
    assert body.count("attnlang::group_mean<VEC, TX>(t)") == 1
    assert body.count("attnlang::group_max<VEC, TX>(t)") == 1
    assert body.index("red0 = attnlang::group_mean") < body.index("red1 = attnlang::group_max")
    assert "t[i] = (x[i] * rsqrtf((red0 + 1e-06f)));" in body
    assert "x[i] = ((x[i] * rsqrtf((red0 + 1e-06f))) - red1);" in body


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_each_reduction(op):
    h = lower(ir.Variant("r", key=B("-", V("k", F), ir.Reduce(op, V("k", F)))))
    assert f"red0 = attnlang::group_{op}<VEC, TX>(t);" in h.key
    assert "x[i] = (x[i] - red0);" in h.key


@pytest.mark.parametrize("interleaved, helper", [(False, "rope_rotate_half"),
                                                  (True, "rope_interleaved")])
def test_rope(interleaved, helper):
    rope = ir.Rope(V("k", F), V("kv_pos"), ir.Param("theta", F), interleaved)
    h = lower(ir.Variant("r", params=(ir.ParamSpec("theta", F, default=1e4),), key=rope))
    assert "float rope0[VEC];" in h.key
    assert "t[i] = x[i];" in h.key
    assert f"attnlang::{helper}<VEC, TX>(rope0, t, dim0, ix.kv_pos, p.u_theta);" in h.key
    assert "x[i] = rope0[i];" in h.key


def test_rope_of_a_reduction_and_position_expression():
    q = V("q", F)
    normed = B("/", q, call("sqrt", B("+", ir.Reduce("mean", B("*", q, q)), C(1e-5))))
    pos = B("+", V("q_pos"), ir.ParamIndex("offset", (V("batch"),), ("batch",), N))
    e = B("*", ir.Rope(normed, pos, C(500.0), False), C(2.0))
    h = lower(ir.Variant("r", params=(ir.ParamSpec("offset", N, ("batch",)),), query=e))
    body = h.query
    assert body.index("red0 =") < body.index("float rope0[VEC];")
    assert "t[i] = (x[i] / sqrtf((red0 + 1e-05f)));" in body
    assert ("attnlang::rope_rotate_half<VEC, TX>(rope0, t, dim0, "
            "(ix.q_pos + attnlang::table_at(p.u_offset, attnlang::Known{ix.batch}, 0)), "
            "500.0f);") in body
    assert "x[i] = (rope0[i] * 2.0f);" in body


# ---------------------------------------------------------------------------- #line


def test_line_directives_point_into_the_attn_file():
    span = Span("v.attn", 7, 10, 7, 30)
    e = ir.Binary("*", ir.Param("cap", F), ir.Var("logits", F), F, span=span)
    v = ir.Variant("v", params=(ir.ParamSpec("cap", F, default=1.0),), logits=e,
                   filename="dir/v.attn")
    h = lower(v)
    lines = h.logits.splitlines()
    assert lines[1] == '#line 7 "dir/v.attn"'
    assert lines[2] == "  return (p.u_cap * s);"
    assert h.logits.endswith("\n" + LINE_RESET)
    assert h.stage_lines == (("logits", 7),)


def test_line_directive_file_names_are_escaped():
    e = ir.Var("logits", F, span=Span("x", 3, 1, 3, 2))
    h = lower(ir.Variant("v", logits=e, filename='C:\\a "b".attn'))
    assert '#line 3 "C:\\\\a \\"b\\".attn"' in h.logits


def test_examples_carry_line_directives_to_their_stage_lines():
    path = next(p for p in VARIANT_FILES if p.stem == "qk_norm")
    v = attnlang.parse(path.read_text(), filename="examples/qk_norm.attn")
    h = lower(v)
    text = path.read_text().splitlines()
    for stage, line in h.stage_lines:
        assert text[line - 1].startswith(stage), (stage, line)
        assert f'#line {line} "examples/qk_norm.attn"' in getattr(h, stage)


# ---------------------------------------------------------------------------- the zoo


@pytest.mark.parametrize("path", VARIANT_FILES, ids=VARIANT_IDS)
def test_every_variant_lowers(path):
    v = attnlang.load(path)
    h = lower(v)
    for stage in ir.STAGES:
        present = v.stage(stage) is not None
        assert getattr(h, f"has_{stage}") is present
        flag = {"query": "kHasQuery", "key": "kHasKey", "value": "kHasValue",
                "logits": "kHasLogits", "mask": "kHasMask", "output": "kHasOutput"}[stage]
        assert f"inline constexpr bool {flag} = {'true' if present else 'false'};" in h.flags
    assert h.softmax is v.softmax
    assert [p.member for p in h.kernel_params] == ["u_" + p.name for p in v.params]
    # consts are folded into literals: no const name survives as an identifier
    for name, _ in v.consts:
        assert not re.search(rf"\b{name}\b", h.query + h.key + h.value + h.logits + h.mask
                             + h.output)
    assert h.source.startswith("// ---- variant")
    assert h.source.rstrip().endswith("}  // namespace variant")


def test_const_is_a_literal_in_the_hook():
    path = next(p for p in VARIANT_FILES if p.stem == "sliding_window")
    h = lower(attnlang.load(path))
    assert "((ix.q_pos - ix.kv_pos) < 4096)" in h.mask


def test_lowering_is_pure_and_span_independent():
    a = attnlang.parse("variant s\nparam cap: float = 30.0\nlogits = cap * tanh(logits / cap)")
    b = attnlang.parse("variant s\n\n\nparam cap: float = 30.0\n\nlogits = cap * "
                       "tanh(logits / cap)")
    strip = lambda h: re.sub(r"#line \d+ .*\n", "", h.source)  # noqa: E731
    assert strip(lower(a)) == strip(lower(b))
    assert lower(a) == lower(a)


def test_bounded_reductions_are_loops_long_ones_rolled():
    v = attnlang.parse("variant r\nlogits = logits + sum(float(i) for i in range(64))\n"
                 "mask = any(kv_pos == j for j in range(2, 5))")
    h = lower(v)
    # 64 terms stay a loop (NVRTC took minutes unrolling them inside the unrolled elements).
    assert ('_Pragma("unroll 1") for (int loop_i = 0; loop_i < 64; ++loop_i) '
            'acc = acc + (((float)(loop_i)));') in h.logits
    assert "for (int loop_j = 2; loop_j < 5; ++loop_j) acc = acc || (" in h.mask
    assert "_Pragma" not in h.mask


def test_per_token_bool_tables_class_tiles_by_their_stretch():
    # is_global[batch, kv_pos] and [batch, q_pos]: scanned under the tile's keys / queries
    tile = lower(attnlang.load(VARIANT_FILES[VARIANT_IDS.index("longformer")])).mask_tile
    assert "attnlang::span_tri(p.u_is_global, kv_lo, kv_hi, 16384, attnlang::Known{ix.batch}, 0)" \
        in tile
    assert "attnlang::span_tri(p.u_is_global, q_lo, q_hi, 16384, attnlang::Known{ix.batch}, 0)" \
        in tile
    # read at a computed position, the table leaves the tile to the per-element mask
    v = attnlang.parse("variant t\nparam g: bool[batch, 64]\nmask = g[batch, kv_pos + 1]")
    assert "span_tri" not in lower(v).mask_tile
