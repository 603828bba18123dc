"""Tile-uniform terms: integer parts of the logits that one interval test proves constant
over a whole tile, so the kernels evaluate them once per tile instead of once per score.

T5's bucket of the distance `q_pos - kv_pos` is the model case: past `max_distance` every
distance falls in the last bucket, so on every tile more than 128 + the tile's extent below
the diagonal the bucket is one number, and the logits reduce to `logits + bias[head, 31]`.
Clipped relative positions (`clamp(q_pos - kv_pos, -k, k)`) and banded ids (`q_pos / 64`)
behave the same way.

A *term* is a maximal int sub-expression of the logits stage that reads `q_pos` or `kv_pos`,
costs something per score (a call, a conversion, a division or a table read), reads no
bounded-reduction variable, and is one value over some 64 x 64 tile of a long causal prompt
(the planner's NumPy intervals over a grid of such tiles decide, params unknown): a term
that never is one value, such as `(q_pos - kv_pos) // 8`, would only cost code and
registers. Per tile the kernels call

    bool uniform_tile(q_lo, q_hi, kv_lo, kv_hi, p, ix, Uniform& u)

which bounds every term over the box with the mask analysis's interval arithmetic
(`attnlang.codegen.mask_tiles`, kernels_templates/mask_tiles.cuh) and stores its lower bound
in u.v[k]; when every bound is a single value it returns true and the kernel applies

    float logits_uniform(s, p, ix, u)

the logits with each term replaced by u.v[k]. The intervals are sound (int arithmetic exact,
float bounds widened by the kernels' float32 error before int() truncates them), so a tile
either gets the very values the per-score hook would compute, or the per-score hook.
"""

from __future__ import annotations

import numpy as np

from attnlang import ir
from attnlang.codegen.c_expr import CHEAP_CALLS, CTYPE, Env, children, expr_c, reads, reads_only
from attnlang.codegen.mask_tiles import TileEnv, interval_of, lower_interval

__all__ = ["uniform_terms", "lower_uniform"]

# More terms than this are left per score (each costs an interval evaluation per tile).
MAX_TERMS = 4

_POSITIONS = ("q_pos", "kv_pos")


def _reads_position(e: ir.Expr) -> bool:
    return reads(e, lambda n: isinstance(n, ir.Var) and n.name in _POSITIONS)


def _costly(e: ir.Expr) -> bool:
    """Does evaluating e per score cost more than integer adds and multiplies?"""
    return reads(e, lambda n: isinstance(n, (ir.Call, ir.Cast, ir.ParamIndex, ir.Loop))
                  or (isinstance(n, ir.Binary) and n.op in ("/", "%", "//", "<<", ">>")))


def uniform_terms(logits: ir.Expr | None) -> tuple[ir.Expr, ...]:
    """The logits' tile-uniform candidates, outermost first, each distinct sub-tree once.

    >>> import attnlang as al
    >>> v = al.parse("variant w\\nlet d = clamp(q_pos - kv_pos, 0, 64)\\n"
    ...              "logits = logits + 0.1 * float(d)")
    >>> [t.fn for t in uniform_terms(v.logits)]
    ['clamp']
    """
    found: list[ir.Expr] = []

    def visit(e: ir.Expr) -> None:
        if (e.type is ir.INT and _reads_position(e) and _costly(e)
                and not reads(e, lambda n: isinstance(n, (ir.LoopVar, ir.Loop)))):
            if e not in found and _ever_uniform(e):
                found.append(e)
            return
        for c in children(e):
            visit(c)

    if logits is not None:
        visit(logits)
    return tuple(found[:MAX_TERMS])


def _sample_tiles(side: int = 64, length: int = 8192) -> TileEnv:
    """The side x side tiles on and below the diagonal of one causal prompt."""
    q, kv = np.meshgrid(np.arange(0, length, side), np.arange(0, length, side), indexing="ij")
    keep = kv <= q
    q, kv = q[keep], kv[keep]
    zero = np.zeros_like(q)
    return TileEnv(q, q + side - 1, kv, kv + side - 1, zero, zero, zero + length, zero + length,
                   num_heads=32, num_kv_heads=8, head_dim=128)


_SAMPLE = _sample_tiles()


def _ever_uniform(term: ir.Expr) -> bool:
    lo, hi = interval_of(term, _SAMPLE)
    return bool(np.any(np.asarray(lo) == np.asarray(hi)))


# A row's values are kept in registers through a tile: a few at most.
MAX_ROW_PARTS = 2


def uniform_row_parts(logits: ir.Expr | None, terms: tuple[ir.Expr, ...]) -> tuple[ir.Expr, ...]:
    """The parts of logits_uniform that are one value per query row over a uniform tile:
    maximal sub-expressions that read neither kv_pos (outside a term), the score nor a loop
    variable bound outside them, and cost a table read or a call. T5's `bias[head, bucket]`
    is one (its bucket a term). The prefill kernel evaluates them before it waits for the
    tile's scores, so their reads are in flight under the matmul.

    >>> import attnlang as al
    >>> v = al.load("examples/t5_bias.attn")
    >>> [p.name for p in uniform_row_parts(v.logits, uniform_terms(v.logits))]
    ['bias']
    """
    def row_only(e: ir.Expr) -> bool:
        return reads_only(e, ("kv_pos", "logits"), lambda n: n in terms)

    def costly(e: ir.Expr) -> bool:
        if e in terms:
            return False
        if isinstance(e, (ir.ParamIndex, ir.Loop)):
            return True
        if isinstance(e, ir.Call) and e.fn not in CHEAP_CALLS:
            return True
        return any(costly(c) for c in children(e))

    found: list[ir.Expr] = []

    def visit(e: ir.Expr) -> None:
        if e in terms:
            return
        if e.type is not ir.BOOL and row_only(e) and costly(e):
            if e not in found:
                found.append(e)
            return
        for c in children(e):
            visit(c)

    if logits is not None and terms:
        visit(logits)
    return tuple(found[:MAX_ROW_PARTS])


def additive_offset(logits: ir.Expr | None, terms: tuple[ir.Expr, ...]) -> ir.Expr | None:
    """E where the logits are `logits + E` (either order) and E is one value per query row
    over a uniform tile (it reads neither the score nor kv_pos outside a term); else None.
    There the prefill kernel never evaluates the logits per score on uniform tiles: a row's
    scores are `s * sm_scale + E`, so E joins the softmax's per-row offset and sm_scale its
    exp2 factor (kUniformAdditive), as if the variant had no logits hook. T5's bias is one.

    >>> import attnlang as al
    >>> v = al.load("examples/t5_bias.attn")
    >>> additive_offset(v.logits, uniform_terms(v.logits)).name
    'bias'
    """
    if not terms or not isinstance(logits, ir.Binary) or logits.op != "+":
        return None
    for score, rest in ((logits.a, logits.b), (logits.b, logits.a)):
        if (isinstance(score, ir.Var) and score.name == "logits"
                and reads_only(rest, ("kv_pos", "logits"), lambda n: n in terms)):
            return rest
    return None


_TILE_SIG = ("__device__ __forceinline__ bool uniform_tile(const int q_lo, const int q_hi, "
             "const int kv_lo, const int kv_hi, const Params& p, const Index& ix, Uniform& u)")
_LOGITS_SIG = ("__device__ __forceinline__ float logits_uniform(const float s, const Params& p, "
               "const Index& ix, const Uniform& u)")
_ROWS_SIG = ("__device__ __forceinline__ UniformRows uniform_rows(const Params& p, "
             "const Index& ix, const Uniform& u)")
_WITH_ROWS = "return logits_uniform_rows(s, p, ix, u, uniform_rows(p, ix, u));"
_LOGITS_ROWS_SIG = ("__device__ __forceinline__ float logits_uniform_rows(const float s, "
                    "const Params& p, const Index& ix, const Uniform& u, const UniformRows& r)")
_OFFSET_SIG = ("__device__ __forceinline__ float logits_uniform_offset(const Params& p, "
               "const Index& ix, const Uniform& u, const UniformRows& r)")


def lower_uniform(logits: ir.Expr | None, literal, param, table, lines) -> str:
    """The C++ of `kUniformTerms`, `kUniformAdditive`, `Uniform`, `uniform_tile`,
    `UniformRows`, `uniform_rows`, `logits_uniform_rows`, `logits_uniform` (the last two with
    the row parts given and evaluated in place) and `logits_uniform_offset` (additive_offset's
    E, where kUniformAdditive).

    literal, param and table render the interval leaves as for `mask_tile`; `lines()` returns
    a fresh statement collector (lower._Lines) whose `user` lines carry `#line` directives.
    """
    terms = uniform_terms(logits)
    offset = additive_offset(logits, terms)
    additive = "true" if offset is not None else "false"
    head = [f"inline constexpr int kUniformTerms = {len(terms)};",
            f"inline constexpr bool kUniformAdditive = {additive};",
            f"struct Uniform {{ int v[{max(len(terms), 1)}]; }};"]
    if not terms:
        return "\n".join(head + [
            "struct UniformRows {};",
            f"{_TILE_SIG} {{ return false; }}  // no tile-uniform term",
            f"{_ROWS_SIG} {{ return {{}}; }}  // unused: kUniformTerms is 0",
            f"{_LOGITS_ROWS_SIG} {{ return logits(s, p, ix); }}  // unused",
            f"{_LOGITS_SIG} {{ return logits(s, p, ix); }}  // unused",
            f"{_OFFSET_SIG} {{ return 0.0f; }}  // unused: kUniformAdditive is false"])
    tile = lines()
    tile.add("using namespace ::attnlang::mask_tiles;")
    tests = []
    for k, term in enumerate(terms):
        tile.user(f"const IvI t{k} = {lower_interval(term, literal, param, table)};", term)
        tile.add(f"u.v[{k}] = static_cast<int>(t{k}.lo);")
        tests.append(f"t{k}.lo == t{k}.hi")
    tile.add(f"return {' && '.join(tests)};")
    hoisted = tuple((t, f"u.v[{k}]") for k, t in enumerate(terms))
    parts = uniform_row_parts(logits, terms)
    members = " ".join(f"{CTYPE[p.type]} r{j};" for j, p in enumerate(parts))
    rows = lines()
    rows.add("UniformRows r;")
    for j, part in enumerate(parts):
        rows.user(f"r.r{j} = {expr_c(part, Env('logits', hoisted=hoisted))};", part)
    rows.add("return r;")
    body = lines()
    env = Env("logits", hoisted=hoisted + tuple((p, f"r.r{j}") for j, p in enumerate(parts)))
    body.user(f"return {expr_c(logits, env)};", logits)
    if offset is not None:
        off = lines()
        off.user(f"return {expr_c(offset, env)};", offset)
        offset_fn = f"{_OFFSET_SIG} {{\n{off.text()}\n}}"
    else:
        offset_fn = f"{_OFFSET_SIG} {{ return 0.0f; }}  // unused: kUniformAdditive is false"
    return "\n".join(head + [
        f"struct UniformRows {{ {members} }};",
        f"{_TILE_SIG} {{\n{tile.text()}\n}}",
        f"{_ROWS_SIG} {{\n{rows.text()}\n}}",
        f"{_LOGITS_ROWS_SIG} {{\n{body.text()}\n}}",
        f"{_LOGITS_SIG} {{\n  {_WITH_ROWS}\n}}",
        offset_fn])
