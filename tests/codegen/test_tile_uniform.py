"""Tile-uniform logits terms (attnlang.codegen.tile_uniform): which sub-expressions become
terms, and their intervals are sound (every pair's value inside) and a single value where
the kernels need it (T5's far tiles). The C++ intervals are compiled for the host and checked
against the per-pair values too; the emulated kernels run the terms end to end
(test_emulated.py, test_prefill_emulated.py).
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

import attnlang as al
from attnlang import interpret, ir
from attnlang.codegen.c_expr import literal
from attnlang.codegen.lower import lower
from attnlang.codegen.mask_tiles import interval_of, lower_interval
from attnlang.codegen.tile_uniform import additive_offset, uniform_terms
from attnlang.paths import templates_dir
from tests.codegen.test_mask_tiles import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, _env, _random_tiles
from tests.variant_files import ROOT

T5 = al.load(ROOT / "examples/t5_bias.attn")

LOGITS = {
    # int() of a log, a where and a min: T5's bucket written another way
    "log_bucket": "let d = max(q_pos - kv_pos, 1)\n"
                  "logits = logits + 0.1 * float(min(int(log2(float(d)) * 4.0), 40))",
    "clipped": "logits = logits + 0.01 * float(clamp(q_pos - kv_pos, -64, 64))",
    "blocks": "logits = logits + 0.1 * float(q_pos // 128 - kv_pos // 128)",
    "abs_where": "logits = logits + 0.2 * float(where(abs(kv_pos - q_pos) > 300, 3, 1))",
}
NOT_TERMS = {
    # never one value over a 64 x 64 tile: left per score
    "fine_buckets": "logits = logits + 0.1 * float((q_pos - kv_pos) // 8)",
    "query_phase": "logits = logits + 0.1 * float(mod(q_pos, 4))",
    # float arithmetic on positions, no int term
    "alibi": "param slope: float = 0.5\nlogits = logits + slope * float(kv_pos - q_pos)",
    # a bounded reduction's variable: not hoistable
    "loop": "logits = logits + 0.1 * float(sum(min(q_pos - kv_pos, j) for j in range(3)))",
    # the bound is a run-time param: unknown when the terms are chosen
    "param_clip": "param w: int = 64\nlogits = logits + 0.01 * float(min(q_pos - kv_pos, w))",
}


def _parse(name: str, src: str) -> ir.Variant:
    return al.parse(f"variant {name}\n{src}")


def test_terms_are_the_uniform_int_parts():
    (bucket,) = uniform_terms(T5.logits)
    assert isinstance(bucket, ir.Call) and bucket.fn == "where" and bucket.type is ir.INT
    for name, src in LOGITS.items():
        assert len(uniform_terms(_parse(name, src).logits)) == 1, name
    for name, src in NOT_TERMS.items():
        assert uniform_terms(_parse(name, src).logits) == (), name
    assert uniform_terms(None) == ()


def test_lowered_hooks():
    h = lower(T5)
    assert "inline constexpr int kUniformTerms = 1;" in h.uniform
    # the logits with the bucket replaced by its tile value: one table read per row (a row
    # part, evaluated ahead by the prefill kernel), no log
    rows = h.uniform.split("uniform_rows(", 1)[1].split("logits_uniform_rows", 1)[0]
    assert "u.v[0]" in rows and "__logf" not in rows and "r.r0 = attnlang::table_at" in rows
    body = h.uniform.split("float logits_uniform_rows", 1)[1].split("float logits_uniform(", 1)[0]
    assert "(s + r.r0)" in body and "__logf" not in body
    none = lower(_parse("fine", NOT_TERMS["fine_buckets"])).uniform
    assert "kUniformTerms = 0;" in none and "return false;" in none


def test_additive_offset():
    # `logits + E`, E one value per row over a uniform tile: the softmax takes E as a row
    # offset (kUniformAdditive) and no logits are evaluated per score there.
    (bias,) = [additive_offset(T5.logits, uniform_terms(T5.logits))]
    assert isinstance(bias, ir.ParamIndex) and bias.name == "bias"
    assert "inline constexpr bool kUniformAdditive = true;" in lower(T5).uniform
    offset = lower(T5).uniform.split("float logits_uniform_offset", 1)[1]
    assert "return r.r0;" in offset
    for name, src in LOGITS.items():  # additive terms whose E is one value per row
        v = _parse(name, src)
        assert additive_offset(v.logits, uniform_terms(v.logits)) is not None, name
    not_additive = {
        "scaled": "logits = 2.0 * logits + 0.1 * float(clamp(q_pos - kv_pos, -64, 64))",
        "per_key": "logits = logits + 0.1 * float(clamp(q_pos - kv_pos, -64, 64)) "
                   "+ 0.01 * float(kv_pos)",
        "capped": "logits = 30.0 * tanh((logits + 0.1 * float(clamp(q_pos - kv_pos, -64, 64)))"
                  " / 30.0)",
    }
    for name, src in not_additive.items():
        v = _parse(name, src)
        assert additive_offset(v.logits, uniform_terms(v.logits)) is None, name
        assert "kUniformAdditive = false;" in lower(v).uniform, name
    for name, src in NOT_TERMS.items():  # no terms: never additive
        v = _parse(name, src)
        assert additive_offset(v.logits, uniform_terms(v.logits)) is None, name


def _pair_values(term: ir.Expr, tile: dict) -> np.ndarray:
    """The term at every (head, q_pos, kv_pos) of the tile, as the reference computes it."""
    group = NUM_HEADS // NUM_KV_HEADS
    heads = np.arange(tile["kv_head"] * group, (tile["kv_head"] + 1) * group)[:, None, None]
    q_pos = np.arange(tile["q_lo"], tile["q_hi"] + 1)[None, :, None]
    kv_pos = np.arange(tile["kv_lo"], tile["kv_hi"] + 1)[None, None, :]
    shape = (len(heads), q_pos.shape[1], kv_pos.shape[2])
    names = {"q_pos": q_pos, "kv_pos": kv_pos, "head": heads,
             **{k: np.asarray(tile[k]) for k in ("batch", "kv_head", "qo_len", "kv_len")},
             "num_heads": np.asarray(NUM_HEADS), "num_kv_heads": np.asarray(NUM_KV_HEADS),
             "head_dim": np.asarray(HEAD_DIM), "sm_scale": np.asarray(0.125)}
    scope = interpret.Scope("logits", shape, names, {}, np.float32)
    with np.errstate(divide="ignore"):  # T5's log(0) at distance 0, outside its where()
        return np.broadcast_to(interpret.evaluate(term, scope), shape)


def _terms():
    out = {"t5": uniform_terms(T5.logits)[0]}
    out.update({k: uniform_terms(_parse(k, src).logits)[0] for k, src in LOGITS.items()})
    return out


def _far_tiles(rng, n: int) -> dict:
    """Tiles 128 to 600 keys behind their queries, where T5's bucket is the last one."""
    q_lo = rng.integers(700, 4000, n)
    gap = rng.integers(128, 600, n)
    kv_hi = q_lo - gap
    return dict(q_lo=q_lo, q_hi=q_lo + rng.integers(0, 64, n), kv_lo=kv_hi - rng.integers(0, 64, n),
                kv_hi=kv_hi, batch=np.zeros(n, int), kv_head=rng.integers(0, NUM_KV_HEADS, n),
                qo_len=np.full(n, 4096), kv_len=np.full(n, 4096))


def _tiles(rng) -> dict:
    a, b = _random_tiles(rng, 150), _far_tiles(rng, 50)
    return {k: np.concatenate([a[k], b[k]]) for k in a}


@pytest.mark.parametrize("name", list(_terms()))
def test_numpy_intervals_are_sound(name):
    term, rng = _terms()[name], np.random.default_rng(3)
    tiles = _tiles(rng)
    lo, hi = (np.broadcast_to(x, tiles["q_lo"].shape) for x in interval_of(term, _env(tiles)))
    for i in range(len(lo)):
        values = _pair_values(term, {k: int(t[i]) for k, t in tiles.items()})
        assert lo[i] <= values.min() and values.max() <= hi[i], (name, i, lo[i], hi[i])
    if name == "t5":  # the far tiles are one bucket, the last
        assert (lo[-50:] == 31).all() and (hi[-50:] == 31).all()


_HARNESS = """
#include <cmath>
#include <cstdio>
#define ATTNLANG_HD inline
#include "{header}"
struct Index {{ int batch, head, kv_head, qo_len, kv_len, q_pos, kv_pos, num_heads, num_kv_heads;
               float sm_scale; }};
constexpr int kHeadDim = {head_dim};
int main() {{
  using namespace attnlang::mask_tiles;
  int which, q_lo, q_hi, kv_lo, kv_hi;
  Index ix{{}};
  ix.num_heads = {num_heads}; ix.num_kv_heads = {num_kv_heads}; ix.sm_scale = 0.125f;
  while (std::scanf("%d %d %d %d %d %d %d %d %d", &which, &q_lo, &q_hi, &kv_lo, &kv_hi,
                    &ix.batch, &ix.kv_head, &ix.qo_len, &ix.kv_len) == 9) {{
    IvI t{{0, 0}};
    switch (which) {{ {cases} }}
    std::printf("%lld %lld\\n", t.lo, t.hi);
  }}
}}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler")
def test_cpp_intervals_are_sound_and_agree(tmp_path):
    terms = _terms()
    cases = " ".join(
        f"case {i}: t = {lower_interval(term, literal, None, None)}; break;"
        for i, term in enumerate(terms.values()))
    src = tmp_path / "harness.cpp"
    src.write_text(_HARNESS.format(header=templates_dir() / "mask_tiles.cuh", cases=cases,
                                   head_dim=HEAD_DIM, num_heads=NUM_HEADS,
                                   num_kv_heads=NUM_KV_HEADS))
    exe = tmp_path / "harness"
    subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(exe), str(src)], check=True,
                   capture_output=True, text=True)
    rng = np.random.default_rng(5)
    tiles = _tiles(rng)
    n = len(tiles["q_lo"])
    lines = [" ".join(str(int(x)) for x in (i, *(tiles[k][j] for k in (
        "q_lo", "q_hi", "kv_lo", "kv_hi", "batch", "kv_head", "qo_len", "kv_len"))))
        for i in range(len(terms)) for j in range(n)]
    out = subprocess.run([str(exe)], input="\n".join(lines), check=True, capture_output=True,
                         text=True).stdout.split()
    bounds = np.array(out, dtype=np.int64).reshape(len(terms), n, 2)
    for i, (name, term) in enumerate(terms.items()):
        py_lo, py_hi = (np.broadcast_to(x, (n,)) for x in interval_of(term, _env(tiles)))
        for j in range(n):
            values = _pair_values(term, {k: int(t[j]) for k, t in tiles.items()})
            lo, hi = bounds[i, j]
            assert lo <= values.min() and values.max() <= hi, (name, j, lo, hi)
        # the kernels and the term choice see the same single values
        point = bounds[i, :, 0] == bounds[i, :, 1]
        np.testing.assert_array_equal(point, py_lo == py_hi, err_msg=name)
