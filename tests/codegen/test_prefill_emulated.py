"""The rendered prefill kernel run on the CPU (tests/codegen/emulator_prefill.py) against the
NumPy reference, in mixed plans with the decode and merge kernels. A few small cases, so CI
stays quick; each runs a kernel whose every mma is a warp-wide exchange between threads.

Tolerances are LANGUAGE.md section 7's (relative L2 error: 1e-2 bf16, 2e-3 fp16); lse is
compared where finite and must be -inf exactly where the reference's is; nothing may be NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnlang
from tests.codegen import emulator_prefill
from tests.random_variants import random_variant
from tests.variant_files import ROOT, ROW_HOOKS

_PROBLEM = emulator_prefill.available()
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=f"emulator: {_PROBLEM}")

TOL = {"bfloat16": 1e-2, "float16": 2e-3}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("emulator_prefill")


CASES = {
    # A decode request ahead of split prefill requests: two work lists, shared partial rows,
    # one merge (the merge tokens must use the batch's numbering).
    "mixed-split": ("examples/gemma2_local.attn",
                    dict(qo_lens=(37, 1, 70), kv_lens=(101, 50, 70), kv_chunk_size=40)),
    # GQA 8, fp16, page size 1, logits + mask hooks with tensor params, copies at issue.
    "alibi-gqa8": ("examples/alibi.attn",
                   dict(dtype="float16", num_heads=16, num_kv_heads=2, qo_lens=(9, 3),
                        kv_lens=(150, 9), page_size=1, eager=True)),
    # head_dim 128: two 16-row blocks per warp with Q re-read from shared memory, many KV
    # tiles (the o rescale skipped when no row max moves), a logits hook, split rows.
    "softcap-128": ("examples/softcap.attn",
                    dict(head_dim=128, num_heads=4, num_kv_heads=2, qo_lens=(70, 5),
                         kv_lens=(330, 40), kv_chunk_size=192)),
    # head_dim 256 (Q re-read from shared memory), query/key hooks, an output hook: rope +
    # reductions, softmax off.
    "rope-norm-256": ("tests/variants/rope_norm_window.attn",
                      dict(head_dim=256, num_heads=2, num_kv_heads=2, qo_lens=(20,),
                           kv_lens=(90,), page_size=7)),
    # MLA's head dims (queries and keys 192, values 128): three K chunks and two V chunks per
    # lane, V and the output staging in rows of their own length, value and output hooks on
    # the 128, split rows.
    # A per-pair mask of random 16 x 32 blocks (all true, all false, mixed): the warps' 32-key
    # sub-tiles are skipped, unmasked or masked per element by its block summary.
    "spec-tree": ("examples/spec_tree.attn",
                  dict(qo_lens=(70, 1), kv_lens=(200, 50), kv_chunk_size=96)),
    # T5's bucket: tiles 128 + 32 keys behind their queries see one bucket (the tile-uniform
    # logits, variant::logits_uniform), the rest compute it per score; a decode request too.
    "t5-uniform-tiles": ("examples/t5_bias.attn",
                         dict(qo_lens=(40, 1), kv_lens=(400, 300), kv_chunk_size=224)),
    # Distance terms (attnlang.codegen.distance_terms): T5's bias per head and Sandwich's sum
    # of cosines (no head, never tile-uniform: every tile) read from the tile's table; at 16
    # query heads per KV head T5's table does not fit (16 x 71 entries) and stays per score.
    "sandwich-table": ("examples/sandwich.attn",
                       dict(qo_lens=(40, 1), kv_lens=(300, 200), kv_chunk_size=96)),
    "t5-gqa16-per-score": ("examples/t5_bias.attn",
                           dict(num_heads=16, num_kv_heads=1, qo_lens=(20, 1),
                                kv_lens=(300, 150))),
    "kitchen-sink-192-128": ("tests/variants/kitchen_sink.attn",
                             dict(head_dim=192, head_dim_vo=128, qo_lens=(40, 1),
                                  kv_lens=(90, 33), kv_chunk_size=48)),
}


def _few_globals() -> dict:
    g = np.zeros((2, 16384), bool)
    g[0, [5, 700]] = True  # request 0: two global tokens, one a query
    g[1, 300] = True
    return {"is_global": g}


@pytest.mark.parametrize("split", [None, 256])
def test_per_token_tables_skip_tiles(split, workdir):
    # Longformer: a 256 window either side, global tokens read from is_global[batch, kv_pos]
    # and [batch, q_pos]. Tiles far from the window whose keys and queries hold no global
    # token are skipped (the table's stretch scanned per tile), the others computed.
    v = attnlang.load(ROOT / "examples/longformer.attn")
    r = emulator_prefill.run_case(v, workdir / f"longformer-{split}", qo_lens=(40, 1),
                                  kv_lens=(1000, 700), kv_chunk_size=split,
                                  params=_few_globals())
    assert r.prefill_items > 0 and not r.has_nan, r
    assert r.rel_err <= TOL["bfloat16"], r


def test_bool_table_stretches(workdir):
    # Prefill over a per-token table mask: the tile cursor and the warps' refinement class
    # each tile by its stretch of the table (bytes_tri), as in the decode test of that name.
    from tests.codegen.test_emulated import _runs_of_keys

    v = attnlang.parse("variant keep\nparam keep: bool[batch, 4096]\nmask = keep[batch, kv_pos]")
    g = _runs_of_keys(np.random.default_rng(2), 2, 4096)
    r = emulator_prefill.run_case(v, workdir / "keep", qo_lens=(40, 3), kv_lens=(1300, 500),
                                  params={"keep": g})
    assert r.prefill_items > 0 and not r.has_nan, r
    assert r.rel_err <= TOL["bfloat16"], r


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_emulated(name, workdir):
    path, kwargs = CASES[name]
    r = emulator_prefill.run_case(attnlang.load(ROOT / path), workdir / name, **kwargs)
    assert r.prefill_items > 0
    assert not r.has_nan, r
    assert r.rel_err <= TOL[kwargs.get("dtype", "bfloat16")], r
    if r.lse_err is not None:
        assert r.lse_finite_matches and r.lse_err <= 5e-3, r


def test_int_distance_term(workdir):
    # An int distance term under a float conversion that also reads q_pos: the table holds
    # the int's bits (logits_distance reads them back with __float_as_int).
    v = attnlang.parse("variant ilog\nmask = causal\nlogits = logits + 0.3 * float("
                       "int(log2(float(max(q_pos - kv_pos, 1)))) + q_pos % 3)",
                       filename="ilog.attn")
    r = emulator_prefill.run_case(v, workdir / "ilog", qo_lens=(70, 1), kv_lens=(260, 90),
                                  num_heads=8, num_kv_heads=2)
    assert r.prefill_items > 0 and not r.has_nan, r
    assert r.rel_err <= TOL["bfloat16"], r


def test_rows_that_see_no_key(workdir):
    # The last query of a prompt sees no key, every row of the second request none at all:
    # o = 0, lse = -inf, never NaN.
    v = attnlang.parse("variant future\nmask = kv_pos > q_pos and kv_pos < 60\n",
                       filename="future.attn")
    r = emulator_prefill.run_case(v, workdir / "future", qo_lens=(40, 20), kv_lens=(40, 90),
                                  sm_scale=-0.3)
    assert not r.has_nan and r.lse_finite_matches and r.rel_err <= TOL["bfloat16"], r


@pytest.mark.parametrize("case", [
    # plain causal, a decode request beside the prefill ones, split rows
    dict(name="examples/causal.attn", qo_lens=(70, 1), kv_lens=(200, 50), kv_chunk_size=96),
    # fp16 output, head_dim 128: the key hook (norm, rope) sees the dequantised keys
    dict(name="examples/qk_norm.attn", dtype="float16", head_dim=128, qo_lens=(40,),
         kv_lens=(150,), page_size=5),
], ids=["causal-mixed", "qk_norm-fp16-128"])
def test_fp8_cache(case, workdir):
    # K and V as e4m3 bytes with a scale per KV head: each loading thread dequantises its own
    # chunks in place before the hooks and the mmas (the mma.sync path; the producer's
    # dequantisation on the wgmma path is checked on the GPU).
    case = dict(case)
    v = attnlang.load(ROOT / case.pop("name"))
    r = emulator_prefill.run_case(v, workdir / "fp8", kv_dtype="float8_e4m3fn", seed=3, **case)
    assert r.prefill_items > 0 and not r.has_nan, r
    assert r.rel_err <= TOL[case.get("dtype", "bfloat16")], r
    assert r.lse_finite_matches and r.lse_err <= 5e-3, r


@pytest.mark.parametrize("case", [
    # GQA 4: decode steps and a two-query step (8 rows in one item) in the tensor-core decode
    # kernel beside a prompt, split into KV chunks off the warps' 32-key tiles
    dict(name="examples/causal.attn", num_heads=8, num_kv_heads=2, qo_lens=(1, 2, 30, 1),
         kv_lens=(300, 77, 30, 1), kv_chunk_size=72),
    # fp16, a logits hook, a group of 6 (two idle columns), pages of 7 keys
    dict(name="examples/softcap.attn", dtype="float16", num_heads=12, num_kv_heads=2,
         qo_lens=(1, 1), kv_lens=(150, 33), page_size=7),
    # a window with global tokens (tiles skipped, partly visible; a table per key), MHA,
    # pages of one key
    dict(name="examples/longformer.attn", num_heads=2, num_kv_heads=2, qo_lens=(1,),
         kv_lens=(1500,), page_size=1),
    # head dim 64 (8-byte value reads) and 256 (4 chunks of a key per lane; a group of 8 over
    # 4 row groups of 32 lanes), split
    dict(name="examples/alibi.attn", head_dim=64, num_heads=8, num_kv_heads=2,
         qo_lens=(1, 1), kv_lens=(200, 65), kv_chunk_size=96),
    dict(name="examples/causal.attn", head_dim=256, num_heads=8, num_kv_heads=1,
         qo_lens=(1, 1), kv_lens=(150, 40), page_size=5, kv_chunk_size=64),
], ids=["causal-gqa4-split", "softcap-fp16-g6", "longformer-mha", "alibi-d64", "causal-d256"])
def test_fp8_decode_on_tensor_cores(case, workdir):
    # decode_mma.cu.j2: e4m3 fragments converted in registers, keys as the mma's M side,
    # each warp's own ring and softmax state, merged at the item's end
    case = dict(case)
    v = attnlang.load(ROOT / case.pop("name"))
    case.setdefault("head_dim", 128)
    r = emulator_prefill.run_case(v, workdir / "fp8mma", kv_dtype="float8_e4m3fn", seed=5,
                                  **case)
    assert r.decode_items > 0 and not r.has_nan, r
    assert r.rel_err <= TOL[case.get("dtype", "bfloat16")], r
    assert r.lse_finite_matches and r.lse_err <= 5e-3, r


# Query and output hooks with row reductions and no key or value hook (variant_files.ROW_HOOKS):
# the tensor-core decode kernel's q and output stages, whose TX-lane row groups take rows ty,
# ty + 128 / TX, ...


@pytest.mark.parametrize("case", [
    dict(head_dim=128, num_heads=8, num_kv_heads=2, qo_lens=(1, 2, 1), kv_lens=(120, 70, 9),
         kv_chunk_size=48),
    dict(head_dim=256, num_heads=16, num_kv_heads=2, qo_lens=(1,), kv_lens=(90,)),
    dict(head_dim=64, num_heads=3, num_kv_heads=3, qo_lens=(1, 1), kv_lens=(64, 200),
         page_size=3),
], ids=["d128-gqa4-split", "d256-g8", "d64-mha"])
def test_fp8_decode_on_tensor_cores_row_hooks(case, workdir):
    v = attnlang.parse(ROW_HOOKS, filename="row_hooks.attn")
    r = emulator_prefill.run_case(v, workdir / "fp8rows", kv_dtype="float8_e4m3fn", seed=9,
                                  **case)
    assert r.decode_items > 0 and r.prefill_items == 0 and not r.has_nan, r
    assert r.rel_err <= TOL["bfloat16"], r
    assert r.lse_finite_matches and r.lse_err <= 5e-3, r


@pytest.mark.parametrize("case", [
    # Nested levels (requests 0..3 share 12 pages, 0..1 four more), decode steps and a
    # prompt among them, a request of its own; the shared levels split over KV chunks, the
    # grouped requests' own tensor-core items in the cascade kernel's list too.
    dict(name="examples/gptj_rope.attn", qo_lens=(1, 2, 1, 20, 1), kv_lens=(300, 275, 250,
                                                                            290, 33),
         shared_pages=((0, 4, 12), (0, 2, 16)), kv_chunk_size=96, own_in_cascade=True),
    # T5's distance table and uniform tiles over a cascade item's q_pos range (the logits
    # read no request), GQA 4.
    dict(name="examples/t5_bias.attn", num_heads=8, num_kv_heads=2, qo_lens=(1, 1, 30, 1),
         kv_lens=(400, 420, 390, 100), shared_pages=((0, 3, 20),)),
    # A per-pair mask reads each row's request: every shared tile partial, the per-element
    # mask on each row's own Index; softmax on, fp16.
    dict(name="examples/spec_tree.attn", dtype="float16", qo_lens=(5, 1, 9),
         kv_lens=(260, 250, 300), shared_pages=((0, 3, 10),)),
], ids=["gptj-rope-nested", "t5-tables", "spec-tree-fp16"])
def test_cascade(case, workdir):
    # Shared-prefix levels in the cascade kernel (a prefill kernel with kCascade: an item's rows
    # are several requests', each with its own Index), each request's own positions in the
    # decode / prefill kernels, every row merged.
    case = dict(case)
    name = case.pop("name")
    r = emulator_prefill.run_case(attnlang.load(ROOT / name), workdir / f"cascade-{name[9:]}",
                                  seed=4, **case)
    assert r.cascade_items > 0 and not r.has_nan, r
    assert r.rel_err <= TOL[case.get("dtype", "bfloat16")], r
    assert r.lse_finite_matches and r.lse_err <= 5e-3, r


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_random_variant(seed, workdir):
    # Programs nobody wrote (tests/random_variants.py): prompts beside decode steps, split
    # and merged (seed 0), an fp8 cache (seed 1), a shared-prefix cascade (seed 3).
    dtype = ("bfloat16", "float16")[seed % 2]
    cascade = seed == 3
    v = attnlang.parse(random_variant(seed, cascade=cascade), f"random_{seed}.attn")
    shape = (dict(shared_pages=((0, 3, 3),), qo_lens=(1, 1, 20, 9), kv_lens=(90, 70, 80, 40))
             if cascade else dict(qo_lens=(37, 1, 20), kv_lens=(101, 50, 60)))
    r = emulator_prefill.run_case(v, workdir / f"random-{seed}", dtype=dtype, num_heads=4,
                                  num_kv_heads=2, kv_chunk_size=40 if seed == 0 else None,
                                  kv_dtype="float8_e4m3fn" if seed == 1 else None, seed=seed,
                                  **shape)
    assert not r.has_nan, r
    assert r.rel_err <= TOL[dtype], r
    if r.lse_err is not None:  # LANGUAGE.md section 7: bf16 scores keep q' and k' rounded
        assert r.lse_finite_matches and r.lse_err <= (1e-2 if dtype == "bfloat16" else 5e-3), r
    assert r.cascade_items > 0 or not cascade, r
