"""Distance terms (attnlang.codegen.distance_terms): which part of the logits the prefill
kernel tabulates per tile, and the hooks it gets. The kernels' use of them is checked by the
emulated prefill kernel (test_prefill_emulated.py: T5, Sandwich, an int term, a table too
large) and on the GPU."""

from __future__ import annotations

import pytest

import attnlang
from attnlang import ir
from attnlang.codegen.distance_terms import distance_term, reads_head
from attnlang.codegen.lower import lower
from tests.variant_files import VARIANT_FILES, VARIANT_IDS


def _logits(text: str) -> ir.Expr:
    return attnlang.parse("variant v\nparam b: float[heads, 32]\nparam s: float[heads]\n"
                          f"logits = {text}\nmask = causal").logits


def test_t5_bias_tabulates_its_bias_read_per_head():
    term = distance_term(attnlang.load(VARIANT_FILES[VARIANT_IDS.index("t5_bias")]).logits)
    assert isinstance(term, ir.ParamIndex) and term.name == "bias" and reads_head(term)


def test_sandwich_tabulates_its_sum_without_heads():
    term = distance_term(attnlang.load(VARIANT_FILES[VARIANT_IDS.index("sandwich")]).logits)
    assert isinstance(term, ir.Binary) and not reads_head(term)  # scale * sum(...)


@pytest.mark.parametrize("text, expected", [
    # The maximal term: the whole log, not its argument.
    ("logits + log(float(max(q_pos - kv_pos, 1)))", "log"),
    ("logits - 0.5 * float(kv_pos - q_pos) / 3.0", None),  # one FMA per score: not worth it
    ("logits + s[head] * float(kv_pos - q_pos)", None),  # ALiBi: a row's slope, an FMA
    ("logits + b[head, min((q_pos - kv_pos) // 8, 31)]", None),  # a read: cheaper per score
    ("logits + b[head, min(int(log(float(max(q_pos - kv_pos, 1)))), 31)]", "b"),
    ("logits + float((q_pos - kv_pos) // 8)", None),  # integer operators are cheap
    ("logits + log(float(q_pos + 1)) - log(float(kv_pos + 1))", None),  # not the distance
    ("logits * log(float(max(q_pos - kv_pos, 1)) + logits)", None),  # reads the score
    ("logits + float(q_row - kv_pos) * exp(-1.0)", None),  # q_row is not q_pos
])
def test_which_term(text, expected):
    term = distance_term(_logits(text))
    if expected is None:
        assert term is None
    else:
        assert term is not None and (getattr(term, "fn", None) or term.name) == expected


def test_a_loop_variable_bound_outside_is_not_a_term():
    # The sum reads the score, so the term would be its body, which reads i: not tabulable;
    # the cosine alone (no i) is not either, since it reads i through its argument.
    v = attnlang.parse("variant v\nlogits = sum(logits * cos(float(q_pos - kv_pos) * float(i))"
                       " for i in range(1, 4))")
    assert distance_term(v.logits) is None


def test_hooks():
    h = lower(attnlang.parse("variant v\nmask = causal\nlogits = logits + 0.3 * "
                             "float(int(log2(float(max(q_pos - kv_pos, 1)))) + q_pos % 3)"))
    assert "inline constexpr bool kDistanceTerm = true;" in h.distance
    assert "inline constexpr bool kDistanceByHead = false;" in h.distance
    assert "return __int_as_float(" in h.distance  # an int term travels as its bits
    assert "__float_as_int(t)" in h.distance.split("logits_distance", 1)[1]
    h = lower(attnlang.parse("variant v\nmask = causal"))
    assert "inline constexpr bool kDistanceTerm = false;" in h.distance
