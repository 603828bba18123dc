"""Pass 3, lower: typed IR (`attnlang.ir.Variant`) -> CUDA C++ hook functions (`Hooks`).

The hook interface is docs/INTERNALS.md ("The hook interface"): inside ``namespace variant``
a ``Params`` struct (one member per param, declaration order), the ``kHas*`` / ``kSoftmax``
flags, and one function per stage. An omitted stage lowers to its identity (mask: ``true``)
and its flag is false, so a kernel can skip the work with ``if constexpr``.

Expressions are rendered by one recursive function over format tables (``_BINARY``,
``_UNARY``, ``_CALLS``, ``REDUCE``): op -> C text, no visitor per node. Vector stages
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

from dataclasses import dataclass

from attnlang import ir
from attnlang.codegen.c_expr import (
    CTYPE,
    REDUCE,
    ROPE,
    TENSOR_CTYPE,
    VARS,
    Env,
    c_string,
    children,
    expr_c,
    literal,
    member_name,
    reads,
    span_c,
    table_c,
    uses_dim,
)
from attnlang.codegen.config import fine_tiles
from attnlang.codegen.distance_terms import distance_term, lower_distance
from attnlang.codegen.mask_tiles import lower_mask_tile
from attnlang.codegen.tile_uniform import lower_uniform

__all__ = ["Hooks", "KernelParam", "lower", "LINE_RESET", "expr_c", "reads_request"]

# A line render() replaces by `#line <n> "<generated file>"`: after a hook whose statements
# carried `#line` directives into the .attn file, errors point back into the generated code.
LINE_RESET = "// attnlang: #line reset"


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
    uniform: str
    distance: str
    pair_window: str
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
    # The key or value hook reads its request (batch, qo_len, kv_len): keys shared by several
    # requests (a cascade's shared prefix) are then not one tensor, and the cascade kernel
    # is refused.
    kv_reads_request: bool = False
    # The variant has a per-pair mask (`bool[q, kv]`): the prefill kernel then takes finer
    # KV tiles (config.template_shape's fine_tiles).
    pair_masks: bool = False
    # The logits have a distance term (attnlang.codegen.distance_terms): the prefill kernel's
    # table then takes a K stage's shared memory where it can (template_shape's distance_table).
    distance_table: bool = False

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
            self.output, "", self.mask_tile, "", self.uniform, "", self.distance, "",
            self.pair_window,
            "",
            "}  // namespace variant",
        ]
        return "\n".join(parts) + "\n"

    @property
    def kernel_params_decl(self) -> str:
        """The kernel arguments as C text to append after the fixed ones: ``""`` or
        ``",\\n    float param_cap, ..."``."""
        return "".join(f",\n    {p.decl}" for p in self.kernel_params)


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
            self.lines.append(f"#line {line} {c_string(self.filename)}")
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
        for c in children(n):
            visit(c)
        if isinstance(n, (ir.Reduce, ir.Rope)) and n not in order:
            order.append(n)

    visit(e)
    return order


def _elem_loop(out: _Lines, assign: str, e: ir.Expr, env: Env, indent: int) -> None:
    """`for i < VEC: <assign> = e at element dim0 + i` (fully unrolled: registers only)."""
    out.add("#pragma unroll", indent)
    out.add("for (int i = 0; i < VEC; ++i) {", indent)
    if uses_dim(e, env):
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
        env = Env(stage, elem=True, input=ir.STAGE_INPUT[stage], hoisted=tuple(hoisted))
        if isinstance(node, ir.Reduce):
            name = f"red{n_red}"
            n_red += 1
            out.add(f"float {name};  // {node.op}(...) over dim")
            out.add("{")
            out.add("float t[VEC];", 2)
            _elem_loop(out, "t[i]", node.x, env, 2)
            out.user(f"{name} = {REDUCE[node.op].format('t')};", node, 2)
            out.add("}")
        else:
            name = f"rope{n_rope}"
            n_rope += 1
            kind = "rope_interleaved" if node.interleaved else "rope"
            scalar = Env(stage, hoisted=tuple(hoisted))
            out.add(f"float {name}[VEC];  // {kind}(...)")
            out.add("{")
            out.add("float t[VEC];", 2)
            _elem_loop(out, "t[i]", node.x, env, 2)
            call = ROPE[node.interleaved].format(
                out=name, x="t", pos=expr_c(node.pos, scalar), theta=expr_c(node.theta, scalar))
            out.user(f"{call};", node, 2)
            out.add("}")
        hoisted.append((node, name))
    env = Env(stage, elem=True, input=ir.STAGE_INPUT[stage], hoisted=tuple(hoisted))
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
    out.user(f"return {expr_c(e, Env(stage))};", e)
    return f"{sig} {{\n{out.text()}\n}}", out.used_line


# How interval analyses render a scalar param and a table read at tile-invariant indices.
_TILE_LEAVES = (lambda name: f"p.{member_name(name)}",
                lambda e: table_c(e, lambda i: VARS[i.name]))


def _logits_tile_hook(lower_fn, logits: ir.Expr | None, filename: str) -> str:
    """A hook group of the logits evaluated per tile: lower_fn(logits, lines) with `lines()`
    a fresh statement collector whose `#line` directives point into the .attn file. The
    tile-uniform terms (`attnlang.codegen.tile_uniform`: found by interval tests per tile,
    applied by logits_uniform) and the distance term (`attnlang.codegen.distance_terms`:
    tabulated per tile by the prefill kernel, read back by logits_distance)."""
    made: list[_Lines] = []

    def lines() -> _Lines:
        made.append(_Lines(filename, _line_of(logits)))
        return made[-1]

    text = lower_fn(logits, lines)
    return text + ("\n" + LINE_RESET if any(m.used_line for m in made) else "")


_MASK_TILE_SIG = ("__device__ __forceinline__ int mask_tile(const int q_lo, const int q_hi, "
                  "const int kv_lo, const int kv_hi, const Params& p, const Index& ix)")


def _mask_tile_hook(mask: ir.Expr | None, filename: str) -> tuple[str, bool, bool]:
    """The tile classifier: q_pos in [q_lo, q_hi] x kv_pos in [kv_lo, kv_hi], the query heads
    of ix.kv_head; 0 every pair masked, 1 unknown, 2 every pair visible. Also whether it
    scans a bool table over a span of positions (common.cuh's span_tri), so that its cost
    grows with the span: kMaskTileScans, under which kernels class tiles, never whole items."""
    if mask is None:
        return f"{_MASK_TILE_SIG} {{ return 2; }}  // no mask: every pair visible", False, False
    spans = []

    def span(e):
        spans.append(e)
        return span_c(e, lambda i: expr_c(i, Env("mask")))

    body = lower_mask_tile(mask, literal, *_TILE_LEAVES, span)
    out = _Lines(filename, _line_of(mask))
    out.add("using namespace ::attnlang::mask_tiles;")
    out.user(f"return {body};", mask)
    return f"{_MASK_TILE_SIG} {{\n{out.text()}\n}}", out.used_line, bool(spans)


def _pair_window_hook(pairs: list[ir.ParamSpec]) -> str:
    """Where the variant has exactly one per-pair mask (kPairWindow), the kernels load the
    bits of a tile row once per masked tile (pair_window; pair_bit reads them) and find the
    request's block summary once per work item (pair_blocks; pair_tile reads it)."""
    window = ("template <int kKeys>\n__device__ __forceinline__ ::attnlang::PairWindow "
              "pair_window(const Params& p, const Index& ix, const int kv_lo)")
    blocks = ("__device__ __forceinline__ const unsigned char* pair_blocks(const Params& p, "
              "const Index& ix)")
    if len(pairs) != 1:
        return (f"{window} {{ return {{}}; }}  // unused: kPairWindow is false\n"
                f"{blocks} {{ return nullptr; }}  // unused")
    member = member_name(pairs[0].name)
    return (f"{window} {{\n  return ::attnlang::make_pair_window<kKeys>(p.{member}, ix, kv_lo);"
            f"\n}}\n{blocks} {{\n  return ::attnlang::pair_blocks_of(p.{member}, ix);\n}}")


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
      return (p.u_cap * attnlang::tanh_approx((s * (1.0f / p.u_cap))));
    }
    """
    members = []
    kernel_params = []
    for spec in variant.params:
        ctype = TENSOR_CTYPE[spec.type] if spec.is_tensor else CTYPE[spec.type]
        member = member_name(spec.name)
        members.append(f"  {ctype} {member};  // param {spec.name}: {spec.declared}")
        kernel_params.append(KernelParam(f"param_{spec.name}", ctype, member))
    params_struct = "struct Params {" + ("\n" + "\n".join(members) + "\n" if members else "") + "};"
    params_init = ("const variant::Params params{"
                   + ", ".join(p.name for p in kernel_params) + "};")

    has = {stage: variant.stage(stage) is not None for stage in ir.STAGES}
    # `mask = true` (or a mask that folds to it) hides nothing: the kernels take the path of
    # no mask, where no tile is partial but the last one.
    if isinstance(variant.mask, ir.Const) and variant.mask.value is True:
        has["mask"] = False
    flag_names = {"query": "kHasQuery", "key": "kHasKey", "value": "kHasValue",
                  "logits": "kHasLogits", "mask": "kHasMask", "output": "kHasOutput"}
    def flag(name: str, value: bool) -> str:
        return f"inline constexpr bool {name} = {'true' if value else 'false'};"

    pairs = [p for p in variant.params if p.is_pair]
    mask_tile, used_line, mask_tile_scans = _mask_tile_hook(variant.mask, variant.filename)
    flags = "\n".join([flag(flag_names[s], has[s]) for s in ir.STAGES]
                      + [flag("kSoftmax", variant.softmax),
                         flag("kMaskTileScans", mask_tile_scans),
                         flag("kPairWindow", len(pairs) == 1),
                         flag("kMaskReadsRequest", reads_request(variant.mask)),
                         flag("kLogitsReadsRequest", reads_request(variant.logits))])

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
    if used_line:
        mask_tile += "\n" + LINE_RESET

    return Hooks(
        variant=variant.name,
        filename=variant.filename,
        params_struct=params_struct,
        flags=flags,
        **fns,
        mask_tile=mask_tile,
        uniform=_logits_tile_hook(lambda e, lines: lower_uniform(e, literal, *_TILE_LEAVES, lines),
                                  variant.logits, variant.filename),
        distance=_logits_tile_hook(lower_distance, variant.logits, variant.filename),
        pair_window=_pair_window_hook(pairs),
        kernel_params=tuple(kernel_params),
        params_init=params_init,
        has_query=has["query"], has_key=has["key"], has_value=has["value"],
        has_logits=has["logits"], has_mask=has["mask"], has_output=has["output"],
        softmax=variant.softmax,
        stage_lines=tuple(stage_lines),
        kv_reads_request=reads_request(variant.key) or reads_request(variant.value),
        pair_masks=fine_tiles(variant.params),
        distance_table=distance_term(variant.logits) is not None,
    )


# What differs between the requests of a cascade item's rows (q_row reads qo_len, kv_len).
_REQUEST_VARS = frozenset({"batch", "qo_len", "kv_len", "q_row"})


def reads_request(e: ir.Expr | None) -> bool:
    """Does the stage read its request's index or lengths (a per-pair mask's row too)? The
    cascade kernel's rows span requests, so its per-tile work cannot assume one request."""
    return e is not None and reads(e, lambda x: isinstance(x, ir.Var) and x.name in _REQUEST_VARS)
