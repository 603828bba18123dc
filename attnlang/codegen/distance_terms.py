"""Distance terms: the part of the logits that sees a score's query and key only through
their distance `q_pos - kv_pos`, tabulated once per KV tile instead of computed per score.

T5's bias `bias[head, bucket(q_pos - kv_pos)]` is the model case: its bucket costs a log, a
division, a conversion and a table read per score, but the 128 x 128 pairs of a CTA's rows
(32 queries x 4 heads at 32/8 heads) and a KV tile make only 4 x 159 (head, distance)
values. Sandwich's sum of 64 cosines of the distance is another. Where a tile is not
tile-uniform (`tile_uniform`), the prefill kernel's threads evaluate the term at each (head,
distance) of the tile into shared memory, and each score reads its value there (one shared
load) in place of the term.

The term is the first maximal sub-expression of the logits stage, outermost first, that
- reads `q_pos` and `kv_pos` only as `q_pos - kv_pos` (or `kv_pos - q_pos`),
- reads neither the score (`logits`) nor a reduction variable bound outside it,
- costs per score more than its table costs per tile (a fill and a barrier): a call (not
  min, max, abs, clamp, where, int, floor, ceil), a float division (by other than constants
  and scalar params) or modulo, or a bounded reduction. Integer operators and table reads
  alone do not: `bias[head, min(q_pos - kv_pos, 31)]` measured 2-4% slower tabulated
  (8429ed7, benchmarks/NOTES.md: a read per score is cheaper than the table's barrier);
  ALiBi's `slopes[head] * ...` is an FMA.
It may read `head` (then it is tabulated per head of the CTA), params, tables and the
request's lengths. The kernels call

    float distance_term(int d, const Params& p, Index ix)   // the term at q_pos - kv_pos = d
    float logits_distance(float s, const Params& p, const Index& ix, float t)

where t is the term's value (an int term's bits in a float). Evaluating the term with
q_pos = d, kv_pos = 0 is exact: it reads them only through their difference.
"""

from __future__ import annotations

from attnlang import ir
from attnlang.codegen.c_expr import (
    CHEAP_CALLS,
    Env,
    children,
    expr_c,
    is_invariant,
    reads,
    reads_only,
)

__all__ = ["distance_term", "reads_head", "lower_distance"]

_POSITIONS = ("q_pos", "kv_pos")


def _is_distance(e: ir.Expr) -> bool:
    return (isinstance(e, ir.Binary) and e.op == "-" and isinstance(e.a, ir.Var)
            and isinstance(e.b, ir.Var) and {e.a.name, e.b.name} == set(_POSITIONS))


def _reads_distance(e: ir.Expr) -> bool:
    return reads(e, _is_distance)


def _only_distance(e: ir.Expr) -> bool:
    """Does e read the positions only as their difference, no score and no loop variable
    bound outside it?"""
    return reads_only(e, (*_POSITIONS, "logits"), _is_distance)


def _costly(e: ir.Expr) -> bool:
    """Does e cost per score more than its table costs per tile (a fill and a barrier)?"""
    if isinstance(e, ir.Loop) or (isinstance(e, ir.Call) and e.fn not in CHEAP_CALLS):
        return True
    if (isinstance(e, ir.Binary) and e.op in ("/", "%", "//") and e.type is ir.FLOAT
            and not (e.op == "/" and is_invariant(e.b))):  # that one is a multiplication
        return True
    return any(_costly(c) for c in children(e))


def distance_term(logits: ir.Expr | None) -> ir.Expr | None:
    """The logits' distance term, or None.

    >>> import attnlang as al
    >>> v = al.parse("variant t\\nparam b: float[heads, 64]\\n"
    ...              "logits = logits + b[head, min(int(log2(float(q_pos - kv_pos + 1))), 63)]")
    >>> distance_term(v.logits).name
    'b'
    """
    def visit(e: ir.Expr) -> ir.Expr | None:
        if (e.type is not ir.BOOL and _reads_distance(e) and _only_distance(e)
                and _costly(e)):
            return e
        for c in children(e):
            found = visit(c)
            if found is not None:
                return found
        return None

    return None if logits is None else visit(logits)


def reads_head(e: ir.Expr) -> bool:
    return reads(e, lambda n: isinstance(n, ir.Var) and n.name == "head")


_TERM_SIG = ("__device__ __forceinline__ float distance_term(const int d, const Params& p, "
             "Index ix)")
_LOGITS_SIG = ("__device__ __forceinline__ float logits_distance(const float s, const Params& p, "
               "const Index& ix, const float t)")


def lower_distance(logits: ir.Expr | None, lines) -> str:
    """The C++ of `kDistanceTerm`, `kDistanceByHead`, `distance_term` and `logits_distance`.
    `lines()` returns a fresh statement collector (lower._Lines)."""
    term = distance_term(logits)
    if term is None:
        return "\n".join([
            "inline constexpr bool kDistanceTerm = false;",
            "inline constexpr bool kDistanceByHead = false;",
            f"{_TERM_SIG} {{ return 0.0f; }}  // unused: kDistanceTerm is false",
            f"{_LOGITS_SIG} {{ return logits(s, p, ix); }}  // unused"])
    # Exact divisions throughout (c_expr.Env.exact): the term may sit under a truncation.
    value = expr_c(term, Env("logits", exact=True))
    evaluate = lines()
    evaluate.add("ix.q_pos = d;  // the term reads the positions only as q_pos - kv_pos")
    evaluate.add("ix.kv_pos = 0;")
    evaluate.user(f"return {value if term.type is ir.FLOAT else f'__int_as_float({value})'};",
                  term)
    stored = "t" if term.type is ir.FLOAT else "__float_as_int(t)"
    body = lines()
    body.user(f"return {expr_c(logits, Env('logits', hoisted=((term, stored),)))};", logits)
    by_head = "true" if reads_head(term) else "false"
    return "\n".join([
        "inline constexpr bool kDistanceTerm = true;",
        f"inline constexpr bool kDistanceByHead = {by_head};",
        f"{_TERM_SIG} {{\n{evaluate.text()}\n}}",
        f"{_LOGITS_SIG} {{\n{body.text()}\n}}"])
