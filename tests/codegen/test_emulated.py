"""The rendered decode and merge kernels, run on the CPU (tests/codegen/emulator.py) and
compared with the NumPy reference: kernel logic is checked on every machine, GPU or not.

Tolerances are LANGUAGE.md section 7's (relative L2 error of out: 1e-2 bf16, 2e-3 fp16); lse
is compared where finite and must be -inf exactly where the reference's is. Nothing may be
NaN (out, lse and the partial buffers start as NaN).
"""

from __future__ import annotations

import numpy as np
import pytest

import attnlang
from tests.codegen import emulator
from tests.random_variants import random_variant
from tests.variant_files import CPU_HEAVY_FILES, CPU_HEAVY_IDS, VARIANT_FILES, VARIANT_IDS

_PROBLEM = emulator.available()
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=f"emulator: {_PROBLEM}")

TOL = {"bfloat16": 1e-2, "float16": 2e-3}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("emulator")


def check(result: emulator.Result, dtype: str) -> None:
    assert not result.has_nan
    assert result.rel_err <= TOL[dtype], result
    if result.lse_err is not None:
        assert result.lse_finite_matches, result
        assert result.lse_err <= 5e-3, result


# softcap and sliding_window are gemma2_local's two halves: its case runs both constructs.
_SPLIT_CASES = [(p, i) for p, i in zip(CPU_HEAVY_FILES, CPU_HEAVY_IDS, strict=True)
                if i not in ("softcap", "sliding_window")]


@pytest.mark.parametrize("path", [p for p, _ in _SPLIT_CASES], ids=[i for _, i in _SPLIT_CASES])
def test_variant_split_and_merged(path, workdir):
    # GQA 8/2 (R = 4, TZ = 2), ragged queries, KV split into chunks of 24 (partial states,
    # merge kernel), chunks not aligned to tiles or pages, pages shuffled in memory.
    r = emulator.run_case(attnlang.load(path), workdir, dtype="bfloat16", head_dim=64,
                          kv_chunk_size=24, num_ctas=4, seed=1)
    assert r.merge_rows > 0
    check(r, "bfloat16")


@pytest.mark.parametrize("case", [
    # fp16, MHA (R = 1, TZ = 8), page size 7, whole requests, copies performed at issue
    dict(dtype="float16", head_dim=128, num_heads=4, num_kv_heads=4, qo_lens=(2, 1),
         kv_lens=(70, 33), page_size=7, eager=True),
    # head_dim 256, group 3 (R = 4 with an idle row), page size 1, 5-key chunks, sm_scale
    dict(head_dim=256, num_heads=6, num_kv_heads=2, page_size=1, kv_chunk_size=5,
         num_ctas=7, sm_scale=0.3),
    # group 32: R = 16, two row tiles per query; a request with no queries
    dict(num_heads=32, num_kv_heads=1, qo_lens=(1, 2, 0), kv_lens=(40, 77, 3),
         kv_chunk_size=30, num_ctas=5),
    # a long query block (20 queries x group 2 = 40 rows over 10 row tiles... of R = 2)
    dict(dtype="float16", head_dim=128, num_heads=4, num_kv_heads=2, qo_lens=(20, 1),
         kv_lens=(90, 50), page_size=3, kv_chunk_size=40, num_ctas=3),
], ids=["fp16-mha-ps7", "d256-group3-ps1", "group32", "long-query"])
def test_causal_layouts(case, workdir):
    v = attnlang.load(VARIANT_FILES[VARIANT_IDS.index("causal")])
    check(emulator.run_case(v, workdir, **case), case.get("dtype", "bfloat16"))


def test_value_head_dim_differs(workdir):
    # MLA's shape: queries and keys of 192 (TX = 8 lanes of 24), values and outputs of 128
    # (8 lanes of 16); dim tables and rope on the 192, a value hook and an output hook with
    # reductions on the 128, split rows through the merge kernel's 128-wide rows.
    for name in ("qk_norm", "kitchen_sink"):
        v = attnlang.load(VARIANT_FILES[VARIANT_IDS.index(name)])
        r = emulator.run_case(v, workdir, head_dim=192, head_dim_vo=128, kv_chunk_size=32,
                              num_ctas=3, seed=4)
        assert r.merge_rows > 0
        check(r, "bfloat16")


@pytest.mark.parametrize("split", [None, 16])
def test_fully_masked_rows(split, workdir):
    # Every key masked: o = 0 before the output stage (here output = o + 1), lse = -inf.
    v = attnlang.parse("variant none\nmask = kv_pos < 0\noutput = o + 1.0")
    check(emulator.run_case(v, workdir, kv_chunk_size=split), "bfloat16")


def test_rows_whose_first_tiles_are_masked(workdir):
    # The first 40 keys of every row are masked: whole tiles and chunks see nothing.
    v = attnlang.parse("variant late\nmask = kv_pos >= 40")
    check(emulator.run_case(v, workdir, kv_lens=(37, 100, 64), page_size=1, kv_chunk_size=16),
          "bfloat16")


@pytest.mark.parametrize("split", [None, 48])
@pytest.mark.parametrize("text", [
    # A short window: the early tiles are entirely masked (skipped: never loaded), the window's
    # edge tile is partial, the last ones entirely visible (no per-key mask).
    "variant win\nconst window: int = 40\nmask = causal and q_pos - kv_pos < window",
    # Sinks + window: a partial first tile, skipped middle tiles, then the window.
    "variant sink\nmask = causal and (kv_pos < 3 or q_pos - kv_pos < 50)",
    # A parameterised window over several query rows: per-item query ranges.
    "variant pwin\nparam w: int = 70\nmask = kv_pos <= q_pos and q_pos - kv_pos < w",
])
def test_mask_tile_skipping(text, split, workdir):
    v = attnlang.parse(text)
    check(emulator.run_case(v, workdir, qo_lens=(1, 6, 2), kv_lens=(300, 260, 9),
                            kv_chunk_size=split, num_ctas=3), "bfloat16")


@pytest.mark.parametrize("split", [None, 96])
def test_tile_uniform_logits(split, workdir):
    # T5's bucket is one value on every tile 128 keys or more behind the queries: those tiles
    # take variant::logits_uniform, the others the per-key hook; both must match the reference.
    v = attnlang.load(VARIANT_FILES[VARIANT_IDS.index("t5_bias")])
    check(emulator.run_case(v, workdir, qo_lens=(1, 5, 2), kv_lens=(420, 300, 9),
                            kv_chunk_size=split, num_ctas=3), "bfloat16")


@pytest.mark.parametrize("text", [
    "variant blocks\nmask = int(float(kv_pos) / 41.0) <= int(float(q_pos) / 41.0)",
    "variant pblocks\nparam block: float = 41.0\n"
    "mask = floor(float(kv_pos) / block) <= floor(float(q_pos) / block)",
])
def test_exact_quotients_under_truncation(text, workdir):
    # Block-causal attention over blocks of 41 positions: x / 41 through a reciprocal is
    # 0.99999994 at x = 41 (1 / 41 rounds down), which int() and floor() would truncate to 0.
    # The kernels correct such quotients to IEEE's (attnlang::div_invariant).
    v = attnlang.parse(text)
    check(emulator.run_case(v, workdir, qo_lens=(1, 50, 3), kv_lens=(170, 130, 84),
                          num_ctas=3), "bfloat16")


@pytest.mark.parametrize("split", [None, 160])
def test_per_token_tables_skip_tiles(split, workdir):
    # Longformer in decode: tiles far behind the window whose keys hold no global token are
    # skipped (is_global[batch, kv_pos] scanned per tile), the rest computed.
    v = attnlang.load(VARIANT_FILES[VARIANT_IDS.index("longformer")])
    g = np.zeros((3, 16384), bool)
    g[0, [5, 700]] = True
    g[1, 300] = True
    check(emulator.run_case(v, workdir, qo_lens=(1, 2, 1), kv_lens=(1000, 800, 9),
                            kv_chunk_size=split, num_ctas=3, params={"is_global": g}),
          "bfloat16")


def _runs_of_keys(rng, rows: int, length: int) -> np.ndarray:
    """Keys kept in long runs (tiles all true or all false), single keys at odd offsets in
    false runs, and a noisy stretch: every class of a tile's stretch, 16-byte chunks and
    unaligned heads and tails included."""
    g = np.zeros((rows, length), bool)
    for r in range(rows):
        pos = int(rng.integers(0, 7))
        while pos < length:
            run = int(rng.integers(20, 300))
            g[r, pos:pos + run] = bool(rng.integers(0, 2))
            pos += run
        g[r, rng.integers(0, length, 6)] = True
        noisy = int(rng.integers(0, length - 100))
        g[r, noisy:noisy + 100] = rng.random(100) < 0.5
    return g


@pytest.mark.parametrize("seed", [0, 1])
def test_bool_table_stretches(seed, workdir):
    # A mask that is a per-token table only: each KV tile is classed by scanning its stretch
    # of the table (common.cuh bytes_tri, 16 bytes to a load); a stretch called all true
    # that is not, or all false that is not, drops or keeps keys and fails the reference.
    v = attnlang.parse("variant keep\nparam keep: bool[batch, 4096]\nmask = keep[batch, kv_pos]")
    g = _runs_of_keys(np.random.default_rng(seed), 3, 4096)
    check(emulator.run_case(v, workdir, qo_lens=(1, 1, 1), kv_lens=(1500, 777, 61),
                            num_ctas=3, params={"keep": g}), "bfloat16")


@pytest.mark.parametrize("offset", [100_000, 3_000_000])
def test_rope_at_large_positions(offset, workdir):
    # rope_norm_window adds offset[batch] to the positions of its rope (query) and
    # interleaved rope (key): angles of 1e5..3e6 rad must stay accurate.
    v = attnlang.load(VARIANT_FILES[VARIANT_IDS.index("rope_norm_window")])
    offsets = np.array([offset, offset + 7, offset - 5], np.int32)
    check(emulator.run_case(v, workdir, dtype="float16", head_dim=128,
                            params={"offset": offsets}, kv_chunk_size=32), "float16")


def test_fp8_codes_decode_exactly(workdir):
    # machine.cuh's fp8x4_to_float off sm_89 (the bit path the emulator runs; sm_89+ converts
    # in hardware, which the GPU tests check): all 256 codes, NaN for S.1111.111.
    main = r"""
#include <cstdio>
int main() {
  for (unsigned w = 0; w < 256; w += 4) {
    float x[4];
    fp8x4_to_float(w | (w + 1) << 8 | (w + 2) << 16 | (w + 3) << 24, x);
    for (int i = 0; i < 4; ++i) printf("%a\n", x[i]);
  }
}
"""
    exe = emulator.compile_cached(emulator.common_program(main), "fp8_codes", workdir / "bin",
                                  (emulator.SHIM,))
    out = emulator.subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    got = np.array([float.fromhex(t) for t in out.stdout.split()])
    want = attnlang.fp8.from_e4m3(np.arange(256, dtype=np.uint8))
    np.testing.assert_array_equal(got, want)  # NaN where both are NaN


def test_fp8_codes_to_half_exactly(workdir):
    # machine.cuh's e4m3x4_to_half2x2 off sm_89 (bit placement, an f16 multiply by 2^8, NaN
    # patched; the tensor-core decode kernel's conversion): all 256 codes, NaN for S.1111.111.
    main = r"""
#include <cstdio>
int main() {
  for (unsigned w = 0; w < 256; w += 4) {
    unsigned lo, hi;
    e4m3x4_to_half2x2(w | (w + 1) << 8 | (w + 2) << 16 | (w + 3) << 24, lo, hi);
    for (unsigned x : {lo & 0xffffu, lo >> 16, hi & 0xffffu, hi >> 16}) printf("%u\n", x);
  }
}
"""
    exe = emulator.compile_cached(emulator.common_program(main), "fp8_half", workdir / "bin",
                                  (emulator.SHIM,))
    out = emulator.subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    got = np.array([int(t) for t in out.stdout.split()], np.uint16).view(np.float16)
    want = attnlang.fp8.from_e4m3(np.arange(256, dtype=np.uint8))
    np.testing.assert_array_equal(got.astype(np.float64), want)  # NaN where both are NaN


@pytest.mark.parametrize("case", [
    # causal, MHA d128, split + merged (the merge sees only float partials)
    dict(name="causal", head_dim=128, num_heads=4, num_kv_heads=4, kv_chunk_size=40),
    # fp16 output, GQA, the key hook (norm + rope) sees the dequantised keys, page size 5
    dict(name="qk_norm", dtype="float16", num_heads=8, num_kv_heads=2, page_size=5),
    # a value hook and an output hook, MLA's head dims
    dict(name="kitchen_sink", head_dim=192, head_dim_vo=128, kv_chunk_size=32),
], ids=["causal-d128-split", "qk_norm-fp16", "kitchen_sink-192"])
def test_fp8_cache(case, workdir):
    # K and V as e4m3 bytes with a scale per KV head, dequantised in shared memory; the
    # reference computes with the dequantised values (tolerances of the output dtype).
    case = dict(case)
    v = attnlang.load(VARIANT_FILES[VARIANT_IDS.index(case.pop("name"))])
    r = emulator.run_case(v, workdir, kv_dtype="float8_e4m3fn", seed=7, **case)
    check(r, case.get("dtype", "bfloat16"))


@pytest.mark.parametrize("seed", range(4))
def test_random_variant(seed, workdir):
    # Programs nobody wrote (tests/random_variants.py; the GPU runs more of them in
    # tests/runtime/test_gpu_random_variants.py): both dtypes, GQA groups 1, 4 and 8, head dims
    # 64 and 128, split and merged every other seed, an fp8 cache every third.
    dtype = ("bfloat16", "float16")[seed % 2]
    v = attnlang.parse(random_variant(seed), f"random_{seed}.attn")
    group = (1, 4, 8)[seed % 3]
    r = emulator.run_case(v, workdir, dtype=dtype, head_dim=(64, 128)[seed // 2 % 2],
                          num_heads=2 * group, num_kv_heads=2, qo_lens=(1, 3, 2, 1),
                          kv_lens=(37, 100, 5, 260), kv_chunk_size=(24, None)[seed % 2],
                          kv_dtype="float8_e4m3fn" if seed % 3 == 0 else None, seed=seed)
    assert not r.has_nan and r.rel_err <= TOL[dtype], r
    if r.lse_err is not None:  # LANGUAGE.md section 7: bf16 scores keep q' and k' rounded
        assert r.lse_finite_matches and r.lse_err <= (1e-2 if dtype == "bfloat16" else 5e-3), r
