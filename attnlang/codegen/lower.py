"""Pass 3, lower: typed IR (`attnlang.ir.Variant`) -> CUDA C++ hook functions (`Hooks`).

The hook interface is docs/INTERNALS.md ("The hook interface"): inside ``namespace variant``
a ``Params`` struct (one member per param, declaration order), the ``kHas*`` / ``kSoftmax``
flags, and one function per stage. An omitted stage lowers to its identity (mask: ``true``)
and its flag is false, so a kernel can skip the work with ``if constexpr``.

Expressions are rendered by one recursive function over format tables (``_BINARY``,
``_UNARY``, ``_CALLS``, ``_REDUCE``): op -> C text, no visitor per node. Vector stages
(query, key, value, output) describe one element; they are evaluated per element over the
VEC registers a lane holds (``dim = dim0 + i``), after every reduction over ``dim`` and every
rope has been hoisted into a temporary (inner ones first; equal sub-trees share one):

    mean(q * q)         ->  float red0;  { float t[VEC]; t[i] = x[i] * x[i] ...;
                                           red0 = attnlang::group_mean<VEC, TX>(t); }
    rope(E, q_pos)      ->  float rope0[VEC];  { float t[VEC]; t[i] = E ...;
                                           attnlang::rope_rotate_half<VEC, TX>(rope0, t, ...); }

Besides the stages, ``mask_tile(q_lo, q_hi, kv_lo, kv_hi, p, ix)`` classifies a whole tile of
(query, key) pairs from the mask by interval arithmetic (`attnlang.codegen.mask_tiles`;
helpers in kernels_templates/mask_tiles.cuh, which `render` splices in with the hooks):
0 every pair masked, 1 unknown, 2 every pair visible.

Each statement holding user code is preceded by ``#line N "file.attn"`` so NVRTC errors point
into the .attn file; `LINE_RESET` marks where the generated file's own numbering resumes
(`attnlang.codegen.render` turns it into a real ``#line``). Consts arrive folded by the
checker and are printed as literals (``4096``, ``1e-06f``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnlang import ir
from attnlang.codegen.mask_tiles import lower_mask_tile
from attnlang.ir import BOOL, FLOAT, INT

__all__ = ["Hooks", "KernelParam", "lower", "LINE_RESET", "expr_c"]

# A line render() replaces by `#line <n> "<generated file>"`: after a hook whose statements
# carried `#line` directives into the .attn file, errors point back into the generated code.
LINE_RESET = "// attnlang: #line reset"

_CTYPE = {BOOL: "bool", INT: "int", FLOAT: "float"}
# Bool tables are bytes (torch.bool / numpy bool storage), read as `!= 0`.
_TENSOR_CTYPE = {INT: "const int*", FLOAT: "const float*", BOOL: "const unsigned char*"}
_FLT_MAX = 3.4028234663852886e38
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

# Reductions over dim: lane-local reduce of a float[VEC], then a butterfly over the TX lanes.
_REDUCE = {
    "sum": "attnlang::group_sum<VEC, TX>({0})",
    "mean": "attnlang::group_mean<VEC, TX>({0})",
    "max": "attnlang::group_max<VEC, TX>({0})",
    "min": "attnlang::group_min<VEC, TX>({0})",
}

_ROPE = {
    False: "attnlang::rope_rotate_half<VEC, TX>({out}, {x}, dim0, {pos}, {theta})",
    True: "attnlang::rope_interleaved<VEC, TX>({out}, {x}, dim0, {pos}, {theta})",
}

# Built-in names -> C. Index fields come from the kernel-built `Index ix`; `head_dim` is the
# template's compile-time constant; `causal` is expanded by the checker (kept for hand IR).
_VARS = {
    **{name: f"ix.{name}" for name in (
        "batch", "head", "kv_head", "qo_len", "kv_len", "q_pos", "kv_pos",
        "num_heads", "num_kv_heads", "sm_scale")},
    "head_dim": "attnlang::kHeadDim",
    "causal": "(ix.kv_pos <= ix.q_pos)",
    "logits": "s",
}
# The run-time size of each named extent; a `batch` axis is always the first, whose extent
# only bounds its index, and a request's index is always inside.
_EXTENT_C = {"heads": "ix.num_heads", "kv_heads": "ix.num_kv_heads", "batch": "0x7fffffff",
             "dim": "attnlang::kHeadDim"}
# A literal divisor other than 0 needs no zero test: C's own / and % then.
_LITERAL_DIVISION = {("/", INT): "({a} / {b})", ("%", INT): "({a} % {b})"}



# ------------------------------------------------------------------------------ the artifact


@dataclass(frozen=True)
class KernelParam:
    """One kernel argument carrying a variant param.

    Example: ``param slopes: float[heads]`` -> ``KernelParam("param_slopes", "const float*",
    "slopes")``. Kernel argument names are prefixed so that no param can collide with a
    fixed kernel argument (``out``, ``page_size``...).
    """

    name: str  # the kernel argument's C identifier
    ctype: str  # float | int | const float* | const int*
    member: str  # the variant::Params member it initialises

    @property
    def decl(self) -> str:
        return f"{self.ctype} {self.name}"


@dataclass(frozen=True)
class Hooks:
    """The C++ hooks of one variant, ready to be spliced into a kernel template.

    ``source`` is the whole ``namespace variant { ... }`` block; the other text fields are its
    pieces. ``kernel_params`` lists the arguments every kernel appends after its fixed ones
    (INTERNALS.md "Kernel kinds and arguments"), ``params_init`` is the statement building
    ``variant::Params params`` from them. ``stage_lines`` gives the .attn line each lowered
    stage's ``#line`` points at (stages without a source span have none).

    Example::

        h = lower(attnlang.load("examples/softcap.attn"))
        h.logits   # '__device__ __forceinline__ float logits(const float s, ...) {\\n#line 7 ...'
        h.kernel_params   # (KernelParam('param_cap', 'float', 'cap'),)
        h.params_init     # 'const variant::Params params{param_cap};'
    """

    variant: str
    filename: str
    params_struct: str
    flags: str
    query: str
    key: str
    value: str
    logits: str
    mask: str
    output: str
    mask_tile: str
    kernel_params: tuple[KernelParam, ...]
    params_init: str
    has_query: bool
    has_key: bool
    has_value: bool
    has_logits: bool
    has_mask: bool
    has_output: bool
    softmax: bool
    stage_lines: tuple[tuple[str, int], ...]

    @property
    def source(self) -> str:
        """The complete ``namespace variant { ... }`` block."""
        parts = [
            f"// ---- variant '{self.variant}' (lowered from {self.filename}) ----",
            "namespace variant {",
            "",
            "using ::attnlang::Index;",
            "using ::attnlang::kHeadDim;",
            "",
            self.params_struct,
            "",
            self.flags,
            "",
            self.query, "", self.key, "", self.value, "", self.logits, "", self.mask, "",
            self.output, "", self.mask_tile,
            "",
            "}  // namespace variant",
        ]
        return "\n".join(parts) + "\n"

    @property
    def kernel_params_decl(self) -> str:
        """The kernel arguments as C text to append after the fixed ones: ``""`` or
        ``",\\n    float param_cap, ..."``."""
        return "".join(f",\n    {p.decl}" for p in self.kernel_params)


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


def _literal(e: ir.Const) -> str:
    if e.type is BOOL:
        return "true" if e.value else "false"
    if e.type is INT:
        return _int_literal(e.value)
    return _float_literal(e.value)


def _c_string(s: str) -> str:
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
class _Env:
    """What the names of one expression mean in C.

    elem: inside the per-element loop of a vector stage (``x[i]``, ``dim``); input: the
    stage's element name (q/k/v/o); hoisted: Reduce/Rope sub-trees already in temporaries.
    """

    stage: str
    elem: bool = False
    input: str | None = None
    hoisted: tuple[tuple[ir.Expr, str], ...] = ()

    def temp(self, e: ir.Expr) -> str | None:
        for node, name in self.hoisted:
            if node == e:
                return name
        return None


def _children(e: ir.Expr) -> tuple[ir.Expr, ...]:
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


def expr_c(e: ir.Expr, env: _Env) -> str:
    """C text of an expression in `env` (the one recursive renderer; tables do the rest)."""
    name = env.temp(e)
    if name is not None:  # a hoisted reduction (scalar) or rope (per element)
        return f"{name}[i]" if isinstance(e, ir.Rope) else name
    if isinstance(e, ir.Const):
        return _literal(e)
    if isinstance(e, ir.Var):
        if e.name == env.input or e.name == "dim":
            if not env.elem:
                raise ValueError(f"'{e.name}' used outside a per-element context")
            return "x[i]" if e.name == env.input else "dim"
        if e.name not in _VARS:
            raise ValueError(f"stage '{env.stage}' cannot read '{e.name}'")
        return _VARS[e.name]
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
        if key == ("/", FLOAT) and _is_invariant(e.b) and _has_param(e.b):
            # A divisor of scalar params (and constants) only: multiply by its reciprocal,
            # which the compiler hoists out of the kernel's loops (an IEEE division per key
            # or element costs ~10 instructions and a slow-path branch). Within 1 ulp of
            # a / b, far inside LANGUAGE.md section 7.
            return f"({expr_c(e.a, env)} * (1.0f / {expr_c(e.b, env)}))"
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
    ctype = _CTYPE[e.type]
    step = (_LOOP_STEP_FLOAT if e.type is FLOAT else {}).get(e.op, _LOOP_STEP[e.op])
    # A long loop stays a loop: the kernels already unroll the elements around it (64 per
    # thread in the wgmma path), and 64 x 64 unrolled bodies take NVRTC minutes.
    rolled = '_Pragma("unroll 1") ' if e.stop - e.start > _UNROLLED_LOOP else ""
    return (f"([&]() {{ {ctype} acc = {_LOOP_INIT[e.op][e.type]}; {rolled}"
            f"for (int loop_{e.var} = {e.start}; loop_{e.var} < {e.stop}; ++loop_{e.var}) "
            f"acc = {step.format(v=body)}; return acc; }}())")


def table_c(e: ir.ParamIndex, index_c) -> str:
    """C text of a table read; index_c renders one index expression."""
    axes = ", ".join(f"{index_c(i)}, {_EXTENT_C[n] if isinstance(n, str) else n}"
                     for i, n in zip(e.indices, e.extents, strict=True))
    read = f"attnlang::table_at(p.{member_name(e.name)}, {axes})"
    return f"({read} != 0)" if e.type is BOOL else read


def _has_param(e: ir.Expr) -> bool:
    """Does e read a scalar param (a constant divisor is left to the C compiler)?"""
    if isinstance(e, ir.Param):
        return True
    if isinstance(e, (ir.Cast, ir.Unary)):
        return _has_param(e.x)
    if isinstance(e, ir.Binary):
        return _has_param(e.a) or _has_param(e.b)
    return False


def _is_invariant(e: ir.Expr) -> bool:
    """Is e built from scalar params and constants only (the same value for every key,
    query and element of a launch)?"""
    if isinstance(e, (ir.Const, ir.Param)):
        return True
    if isinstance(e, ir.Cast):
        return _is_invariant(e.x)
    if isinstance(e, ir.Unary):
        return _is_invariant(e.x)
    if isinstance(e, ir.Binary):
        return _is_invariant(e.a) and _is_invariant(e.b)
    return False


def _uses_dim(e: ir.Expr, env: _Env) -> bool:
    """Does the per-element text of e read `dim` (so the loop must define it)?"""
    if env.temp(e) is not None:
        return False
    if isinstance(e, ir.Var) and e.name == "dim":
        return True
    return any(_uses_dim(c, env) for c in _children(e))


# ------------------------------------------------------------------------------ stages


class _Lines:
    """Collects C lines, with `#line` directives pointing into the .attn file."""

    def __init__(self, filename: str, fallback: int | None):
        self.filename = filename
        self.fallback = fallback
        self.lines: list[str] = []
        self.used_line = False

    def add(self, text: str, indent: int = 1) -> None:
        self.lines.append("  " * indent + text)

    def user(self, text: str, node: ir.Expr, indent: int = 1) -> None:
        """A statement holding user code: preceded by `#line` to the node's .attn line."""
        line = node.span.line if getattr(node, "span", None) is not None else self.fallback
        if line is not None:
            self.lines.append(f"#line {line} {_c_string(self.filename)}")
            self.used_line = True
        self.add(text, indent)

    def text(self) -> str:
        return "\n".join(self.lines)


def _line_of(e: ir.Expr | None) -> int | None:
    return e.span.line if e is not None and getattr(e, "span", None) is not None else None


def _hoist_order(e: ir.Expr) -> list[ir.Expr]:
    """Reduce and Rope sub-trees of e, inner first, each distinct sub-tree once."""
    order: list[ir.Expr] = []

    def visit(n: ir.Expr) -> None:
        for c in _children(n):
            visit(c)
        if isinstance(n, (ir.Reduce, ir.Rope)) and n not in order:
            order.append(n)

    visit(e)
    return order


def _elem_loop(out: _Lines, assign: str, e: ir.Expr, env: _Env, indent: int) -> None:
    """`for i < VEC: <assign> = e at element dim0 + i` (fully unrolled: registers only)."""
    out.add("#pragma unroll", indent)
    out.add("for (int i = 0; i < VEC; ++i) {", indent)
    if _uses_dim(e, env):
        out.add("const int dim = dim0 + i;  // this element's index in the head vector",
                indent + 1)
    out.user(f"{assign} = {expr_c(e, env)};", e, indent + 1)
    out.add("}", indent)


def _vector_hook(stage: str, e: ir.Expr | None, filename: str) -> tuple[str, bool]:
    sig = (f"template <int VEC, int TX>\n__device__ __forceinline__ void {stage}("
           f"float (&x)[VEC], const int dim0, const Params& p, const Index& ix)")
    if e is None:
        return f"{sig} {{}}  // identity", False
    out = _Lines(filename, _line_of(e))
    out.add(f"// {ir.STAGE_INPUT[stage]}' = x[i] for element dim0 + i of this lane "
            f"(VEC per lane, TX lanes per row)")
    hoisted: list[tuple[ir.Expr, str]] = []
    n_red = n_rope = 0
    for node in _hoist_order(e):
        env = _Env(stage, elem=True, input=ir.STAGE_INPUT[stage], hoisted=tuple(hoisted))
        if isinstance(node, ir.Reduce):
            name = f"red{n_red}"
            n_red += 1
            out.add(f"float {name};  // {node.op}(...) over dim")
            out.add("{")
            out.add("float t[VEC];", 2)
            _elem_loop(out, "t[i]", node.x, env, 2)
            out.user(f"{name} = {_REDUCE[node.op].format('t')};", node, 2)
            out.add("}")
        else:
            name = f"rope{n_rope}"
            n_rope += 1
            kind = "rope_interleaved" if node.interleaved else "rope"
            scalar = _Env(stage, hoisted=tuple(hoisted))
            out.add(f"float {name}[VEC];  // {kind}(...)")
            out.add("{")
            out.add("float t[VEC];", 2)
            _elem_loop(out, "t[i]", node.x, env, 2)
            call = _ROPE[node.interleaved].format(
                out=name, x="t", pos=expr_c(node.pos, scalar), theta=expr_c(node.theta, scalar))
            out.user(f"{call};", node, 2)
            out.add("}")
        hoisted.append((node, name))
    env = _Env(stage, elem=True, input=ir.STAGE_INPUT[stage], hoisted=tuple(hoisted))
    _elem_loop(out, "x[i]", e, env, 1)
    body = out.text()
    return f"{sig} {{\n{body}\n}}", out.used_line


def _scalar_hook(stage: str, e: ir.Expr | None, filename: str) -> tuple[str, bool]:
    if stage == "logits":
        sig = ("__device__ __forceinline__ float logits("
               "const float s, const Params& p, const Index& ix)")
        identity = "return s;"
    else:
        sig = "__device__ __forceinline__ bool mask(const Params& p, const Index& ix)"
        identity = "return true;"
    if e is None:
        return f"{sig} {{ {identity} }}  // identity", False
    out = _Lines(filename, _line_of(e))
    out.user(f"return {expr_c(e, _Env(stage))};", e)
    return f"{sig} {{\n{out.text()}\n}}", out.used_line


_MASK_TILE_SIG = ("__device__ __forceinline__ int mask_tile(const int q_lo, const int q_hi, "
                  "const int kv_lo, const int kv_hi, const Params& p, const Index& ix)")


def _mask_tile_hook(mask: ir.Expr | None, filename: str) -> tuple[str, bool]:
    """The tile classifier: q_pos in [q_lo, q_hi] x kv_pos in [kv_lo, kv_hi], the query heads
    of ix.kv_head; 0 every pair masked, 1 unknown, 2 every pair visible."""
    if mask is None:
        return f"{_MASK_TILE_SIG} {{ return 2; }}  // no mask: every pair visible", False
    body = lower_mask_tile(mask, _literal, lambda name: f"p.{member_name(name)}",
                           lambda e: table_c(e, lambda i: _VARS[i.name]))
    out = _Lines(filename, _line_of(mask))
    out.add("using namespace ::attnlang::mask_tiles;")
    out.user(f"return {body};", mask)
    return f"{_MASK_TILE_SIG} {{\n{out.text()}\n}}", out.used_line


# ------------------------------------------------------------------------------ entry point


def lower(variant: ir.Variant) -> Hooks:
    """Lower a checked variant to its C++ hooks (pure; the IR is not modified).

    >>> from attnlang import ir
    >>> v = ir.Variant("capped", params=(ir.ParamSpec("cap", ir.FLOAT, default=30.0),),
    ...     logits=ir.Binary("*", ir.Param("cap", ir.FLOAT), ir.Call("tanh", (ir.Binary(
    ...         "/", ir.Var("logits", ir.FLOAT), ir.Param("cap", ir.FLOAT), ir.FLOAT),),
    ...         ir.FLOAT), ir.FLOAT))
    >>> print(lower(v).logits)
    __device__ __forceinline__ float logits(const float s, const Params& p, const Index& ix) {
      return (p.cap * attnlang::tanh_approx((s * (1.0f / p.cap))));
    }
    """
    members = []
    kernel_params = []
    for spec in variant.params:
        ctype = _TENSOR_CTYPE[spec.type] if spec.is_tensor else _CTYPE[spec.type]
        member = member_name(spec.name)
        members.append(f"  {ctype} {member};  // param {spec.name}: {spec.declared}")
        kernel_params.append(KernelParam(f"param_{spec.name}", ctype, member))
    params_struct = "struct Params {" + ("\n" + "\n".join(members) + "\n" if members else "") + "};"
    params_init = ("const variant::Params params{"
                   + ", ".join(p.name for p in kernel_params) + "};")

    has = {stage: variant.stage(stage) is not None for stage in ir.STAGES}
    flag_names = {"query": "kHasQuery", "key": "kHasKey", "value": "kHasValue",
                  "logits": "kHasLogits", "mask": "kHasMask", "output": "kHasOutput"}
    def flag(name: str, value: bool) -> str:
        return f"inline constexpr bool {name} = {'true' if value else 'false'};"

    flags = "\n".join([flag(flag_names[s], has[s]) for s in ir.STAGES]
                      + [flag("kSoftmax", variant.softmax)])

    fns: dict[str, str] = {}
    stage_lines = []
    for stage in ir.STAGES:
        e = variant.stage(stage)
        if stage in ir.VECTOR_STAGES:
            text, used_line = _vector_hook(stage, e, variant.filename)
        else:
            text, used_line = _scalar_hook(stage, e, variant.filename)
        if used_line:
            text += "\n" + LINE_RESET
        fns[stage] = text
        line = _line_of(e)
        if line is not None:
            stage_lines.append((stage, line))
    mask_tile, used_line = _mask_tile_hook(variant.mask, variant.filename)
    if used_line:
        mask_tile += "\n" + LINE_RESET

    return Hooks(
        variant=variant.name,
        filename=variant.filename,
        params_struct=params_struct,
        flags=flags,
        **fns,
        mask_tile=mask_tile,
        kernel_params=tuple(kernel_params),
        params_init=params_init,
        has_query=has["query"], has_key=has["key"], has_value=has["value"],
        has_logits=has["logits"], has_mask=has["mask"], has_output=has["output"],
        softmax=variant.softmax,
        stage_lines=tuple(stage_lines),
    )
