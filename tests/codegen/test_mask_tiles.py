"""Mask analysis: tile classes are sound (EMPTY => every pair masked, FULL => every pair
visible, checked against the reference's per-element mask) and precise on the known forms.

The C++ version (kernels_templates/mask_tiles.cuh + the lowered expression) is compiled for
the host with a C++ compiler and checked the same way, with the params known.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

import attnlang as al
from attnlang import interpret, ir
from attnlang.codegen.mask_tiles import (
    EMPTY,
    FULL,
    PARTIAL,
    TileEnv,
    classify_tiles,
    lower_mask_tile,
)
from attnlang.paths import templates_dir
from tests.variant_files import VARIANT_FILES

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 64

EXTRA_MASKS = {
    "window_128": "mask = causal and q_pos - kv_pos < 128",
    "sinks_or_window": "mask = kv_pos < 4 or (causal and q_pos - kv_pos <= 100)",
    "not_band": "mask = not (kv_pos > q_pos + 3)",
    "strided": "mask = kv_pos % 64 == 0 or kv_pos / 64 == q_pos / 64",
    "checker": "mask = ((q_pos // 64) + (kv_pos // 64)) % 2 == 0",
    "mod_columns": "mask = mod(kv_pos - 16, 64) < 32 and causal",
    "float_dist": "mask = 0.5 * (q_pos - kv_pos) < 40.0 and causal",
    "kv_len_tail": "mask = kv_len - kv_pos <= 200",
    "where_bool": "mask = where(q_pos > 300, causal, kv_pos < 50)",
    "clamped": "mask = min(q_pos, 500) >= kv_pos and abs(q_pos - kv_pos) < 300",
    "bool_eq": "mask = (kv_pos < 100) == (q_pos < 100)",
    "param_window": "param w: int = 90\nmask = causal and q_pos - kv_pos < w",
    "head_dependent": "param lim: int[heads]\nmask = kv_pos < lim[head] and causal",
    "floor_blocks": "mask = (q_pos - 40) // 16 >= kv_pos // -16 * -1 - 2 and causal",
    "floor_mod": "mask = mod(kv_pos - 30, 7) < 3 or mod(q_pos, -5) == -1 or q_row < 9",
    "bitwise": "mask = ((kv_pos & 12) ^ (q_pos | 1)) > 5 and ~kv_pos < -3 and kv_pos >> 2 < 99",
    "loops": "mask = causal and not any(kv_pos == 9 * j + 4 for j in range(5))"
             " and min(q_pos - kv_pos + j for j in range(3)) < 300",
    "lets_table": "param seen: bool[batch, 50]\nlet d = q_pos - kv_pos\n"
                  "mask = (d >= 0) & (d // 8 < 3) | seen[batch, kv_pos]",
}


def _variants():
    out = {p.stem: al.load(p) for p in VARIANT_FILES}
    out.update({k: al.parse(f"variant {k}\n{src}") for k, src in EXTRA_MASKS.items()})
    # A per-pair mask's tiles are classed by the block summary plan() builds from the bits
    # (tests/runtime/test_pairmask.py, the emulated and GPU kernels); here it is PARTIAL.
    return {k: v for k, v in out.items() if not any(p.is_pair for p in v.params)}


VARIANTS = _variants()


def random_params(v: ir.Variant, rng, extents: dict[str, int], int_high: int = 50) -> dict:
    """Run-time params for v: defaults where declared, else random; tensors of the extents."""
    params = {}
    for p in v.params:
        if p.is_tensor:
            n = p.shape(extents)
            params[p.name] = (rng.integers(0, 700, n) if p.type is ir.INT
                              else rng.random(n) < 0.5 if p.type is ir.BOOL
                              else rng.uniform(0.1, 2.0, n))
        else:
            params[p.name] = p.default if p.default is not None else (
                int(rng.integers(1, int_high)) if p.type is ir.INT else float(rng.uniform(0.5, 2)))
    return params


def _params(v: ir.Variant, rng, batch_size: int) -> dict:
    return random_params(v, rng, {"heads": NUM_HEADS, "kv_heads": NUM_KV_HEADS,
                                  "batch": batch_size, "dim": HEAD_DIM})


def _random_tiles(rng, n: int):
    kv_len = rng.integers(1, 5000, n)
    qo_len = np.minimum(rng.integers(1, 5000, n), kv_len)
    q_first = kv_len - qo_len
    q_lo = q_first + rng.integers(0, qo_len)
    q_hi = np.minimum(q_lo + rng.integers(0, 130, n), kv_len - 1)
    kv_lo = rng.integers(0, kv_len)
    kv_hi = np.minimum(kv_lo + rng.integers(0, 130, n), kv_len - 1)
    return dict(q_lo=q_lo, q_hi=q_hi, kv_lo=kv_lo, kv_hi=kv_hi, batch=rng.integers(0, 3, n),
                kv_head=rng.integers(0, NUM_KV_HEADS, n), qo_len=qo_len, kv_len=kv_len)


def _truth(v: ir.Variant, tile: dict, params: dict) -> tuple[bool, bool]:
    """(any pair visible, every pair visible) by evaluating the mask per element."""
    group = NUM_HEADS // NUM_KV_HEADS
    heads = np.arange(tile["kv_head"] * group, (tile["kv_head"] + 1) * group)[:, None, None]
    q_pos = np.arange(tile["q_lo"], tile["q_hi"] + 1)[None, :, None]
    kv_pos = np.arange(tile["kv_lo"], tile["kv_hi"] + 1)[None, None, :]
    shape = (len(heads), q_pos.shape[1], kv_pos.shape[2])
    names = {"q_pos": q_pos, "kv_pos": kv_pos, "head": heads, "batch": np.asarray(tile["batch"]),
             "kv_head": np.asarray(tile["kv_head"]), "qo_len": np.asarray(tile["qo_len"]),
             "kv_len": np.asarray(tile["kv_len"]), "num_heads": np.asarray(NUM_HEADS),
             "num_kv_heads": np.asarray(NUM_KV_HEADS), "head_dim": np.asarray(HEAD_DIM),
             "sm_scale": np.asarray(0.125), "causal": kv_pos <= q_pos}
    scope = interpret.Scope("mask", shape, names, {k: np.asarray(x) for k, x in params.items()},
                             np.float32)
    visible = np.broadcast_to(interpret.evaluate(v.mask, scope), shape)
    return bool(visible.any()), bool(visible.all())


def _check_sound(name, classes, tiles, v, params):
    for i, cls in enumerate(classes):
        tile = {k: int(a[i]) for k, a in tiles.items()}
        any_visible, all_visible = _truth(v, tile, params)
        assert not (cls == EMPTY and any_visible), (name, tile, "EMPTY but a pair is visible")
        assert not (cls == FULL and not all_visible), (name, tile, "FULL but a pair is masked")


def _env(tiles: dict) -> TileEnv:
    return TileEnv(**tiles, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)


@pytest.mark.parametrize("name", [k for k, v in VARIANTS.items() if v.mask is not None])
def test_numpy_classes_are_sound(name):
    v, rng = VARIANTS[name], np.random.default_rng(7)
    tiles = _random_tiles(rng, 300)
    classes = classify_tiles(v.mask, _env(tiles))
    _check_sound(name, classes, tiles, v, _params(v, rng, 3))


def test_known_forms_are_precise():
    a = np.array
    # causal: a tile above the diagonal is EMPTY, one below it FULL, one across it PARTIAL
    tiles = dict(q_lo=a([0, 64, 0]), q_hi=a([63, 127, 63]), kv_lo=a([64, 0, 0]),
                 kv_hi=a([127, 63, 63]), batch=a([0, 0, 0]), kv_head=a([0, 0, 0]),
                 qo_len=a([128] * 3), kv_len=a([128] * 3))
    assert classify_tiles(VARIANTS["causal"].mask, _env(tiles)).tolist() == [EMPTY, FULL, PARTIAL]
    # window 128: keys far behind the queries are EMPTY
    far = dict(tiles, q_lo=a([1000]), q_hi=a([1063]), kv_lo=a([0]), kv_hi=a([63]),
               batch=a([0]), kv_head=a([0]), qo_len=a([2000]), kv_len=a([2000]))
    assert classify_tiles(VARIANTS["window_128"].mask, _env(far)).tolist() == [EMPTY]
    # sinks stay FULL however far behind
    sinks = dict(far, kv_lo=a([0]), kv_hi=a([3]))
    assert classify_tiles(VARIANTS["sinks_or_window"].mask, _env(sinks)).tolist() == [FULL]
    assert classify_tiles(None, _env(far)).tolist() == [FULL]
    # params are unknown at plan time: a param-bounded window is only PARTIAL there
    assert classify_tiles(VARIANTS["param_window"].mask, _env(far)).tolist() == [PARTIAL]
    # % and mod() within one period are exact: a 64 x 64 checkerboard's blocks are decided,
    # and so are the 32-key column blocks of a periodic mask (the kernels' column masking)
    blocks = dict(far, q_lo=a([0, 64, 0]), q_hi=a([63, 127, 63]), kv_lo=a([0, 0, 64]),
                  kv_hi=a([63, 63, 127]), batch=a([0] * 3), kv_head=a([0] * 3),
                  qo_len=a([2000] * 3), kv_len=a([2000] * 3))
    assert classify_tiles(VARIANTS["checker"].mask, _env(blocks)).tolist() == [FULL, EMPTY,
                                                                                 EMPTY]
    cols = dict(far, kv_lo=a([16, 48, 40]), kv_hi=a([47, 79, 71]))
    assert classify_tiles(VARIANTS["mod_columns"].mask, _env(cols)).tolist() == [FULL, EMPTY,
                                                                                  PARTIAL]


def _literal(c: ir.Const) -> str:
    if c.type is ir.BOOL:
        return "true" if c.value else "false"
    return repr(float(c.value)) + "f" if c.type is ir.FLOAT else f"{int(c.value)}LL"


_HARNESS = """
#include <cmath>
#include <cstdio>
#define ATTNLANG_HD inline
#include "{header}"
struct Index {{ int batch, head, kv_head, qo_len, kv_len, q_pos, kv_pos, num_heads, num_kv_heads;
               float sm_scale; }};
constexpr int kHeadDim = {head_dim};
{functions}
int main() {{
  int which, q_lo, q_hi, kv_lo, kv_hi;
  Index ix{{}};
  ix.num_heads = {num_heads}; ix.num_kv_heads = {num_kv_heads}; ix.sm_scale = 0.125f;
  while (std::scanf("%d %d %d %d %d %d %d %d %d", &which, &q_lo, &q_hi, &kv_lo, &kv_hi,
                    &ix.batch, &ix.kv_head, &ix.qo_len, &ix.kv_len) == 9) {{
    int c = -1;
    switch (which) {{ {cases} }}
    std::printf("%d\\n", c);
  }}
}}
"""


def _cpp_function(i: int, v: ir.Variant, params: dict) -> str:
    fields, values = [], []
    for p in v.params:
        ctype = "long long" if p.type is ir.INT else "float"
        if p.is_tensor:
            data = ", ".join(str(int(x)) if p.type is ir.INT else f"{float(x)!r}f"
                             for x in np.ravel(params[p.name]))
            values.append(f"static const {ctype} {p.name}_data[] = {{{data}}};")
            fields.append((f"const {ctype}* {p.name};", f"{p.name}_data"))
        else:
            x = params[p.name]
            fields.append((f"{ctype} {p.name};", str(int(x)) if p.type is ir.INT else f"{x!r}f"))
    struct = " ".join(f for f, _ in fields) or "int unused_;"
    init = ", ".join(val for _, val in fields) or "0"
    body = lower_mask_tile(v.mask, _literal, lambda name: f"p.{name}",
                           lambda e: f"p.{e.name}[ix.{e.indices[0].name}]")  # 1-D tables here
    return (f"namespace v{i} {{ {' '.join(values)} struct Params {{ {struct} }};\n"
            f"int mask_tile(int q_lo, int q_hi, int kv_lo, int kv_hi, const Index& ix) {{\n"
            f"  using namespace attnlang::mask_tiles; const Params p{{{init}}};\n"
            f"  return {body};\n}} }}\n")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler")
def test_cpp_classes_are_sound_and_agree(tmp_path):
    rng = np.random.default_rng(11)
    names = [k for k, v in VARIANTS.items() if v.mask is not None]
    params = {k: _params(VARIANTS[k], rng, 3) for k in names}
    functions = "".join(_cpp_function(i, VARIANTS[k], params[k]) for i, k in enumerate(names))
    cases = " ".join(f"case {i}: c = v{i}::mask_tile(q_lo, q_hi, kv_lo, kv_hi, ix); break;"
                     for i in range(len(names)))
    src = tmp_path / "harness.cpp"
    src.write_text(_HARNESS.format(header=templates_dir() / "mask_tiles.cuh", functions=functions,
                                   cases=cases, head_dim=HEAD_DIM, num_heads=NUM_HEADS,
                                   num_kv_heads=NUM_KV_HEADS))
    exe = tmp_path / "harness"
    subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(exe), str(src)], check=True,
                   capture_output=True, text=True)
    tiles = {k: _random_tiles(rng, 150) for k in names}
    lines = []
    for i, k in enumerate(names):
        t = tiles[k]
        for j in range(150):
            lines.append(" ".join(str(int(x)) for x in (
                i, t["q_lo"][j], t["q_hi"][j], t["kv_lo"][j], t["kv_hi"][j], t["batch"][j],
                t["kv_head"][j], t["qo_len"][j], t["kv_len"][j])))
    out = subprocess.run([str(exe)], input="\n".join(lines), check=True, capture_output=True,
                         text=True).stdout.split()
    classes = np.array(out, dtype=int).reshape(len(names), 150)
    for i, k in enumerate(names):
        v = VARIANTS[k]
        _check_sound(k, classes[i], tiles[k], v, params[k])
        if not v.params:  # nothing the planner lacks: both analyses see the same facts
            py = classify_tiles(v.mask, _env(tiles[k]))
            np.testing.assert_array_equal(classes[i], py, err_msg=k)
