"""Per-pair masks (bool[q, kv]) on the GPU against the reference: speculative decoding's token
trees over a long context, random block-sparse layouts, a per-pair mask combined with another
mask, and a CUDA graph replayed after a plan() with new masks (the buffer never moves)."""

from __future__ import annotations

import numpy as np
import pytest

import attnlang
from attnlang.reference import attention_paged
from attnlang.runtime import pairmask
from attnlang.runtime.planner import CapacityError
from tests.runtime.test_gpu_attention import (
    SHORT,
    TOLERANCE,
    VARIANT_PATHS,
    check_lse,
    from_device,
    make_batch,
    poisoned,
    rel_l2,
    to_device,
)

pytestmark = pytest.mark.gpu


def token_tree(rng, context: int, nodes: int) -> np.ndarray:
    """A random tree's mask (each node's parent an earlier node, or the context's last
    token), as pairmask.tree_mask builds it."""
    return pairmask.tree_mask([-1] + [int(rng.integers(-1, i)) for i in range(1, nodes)],
                              context)


def block_sparse(rng, q: int, k: int, block: int, density: float) -> np.ndarray:
    blocks = rng.random((-(-q // block), -(-k // block))) < density
    return np.repeat(np.repeat(blocks, block, 0), block, 1)[:q, :k]


def check(cp, variant, masks, qo, kv, *, dtype="bfloat16", head_dim=128, group=4,
          page_size=16, chunk=None, error_log=None, where=""):
    rng = np.random.default_rng(len(where))
    qo, kv = np.asarray(qo), np.asarray(kv)
    batch = make_batch(rng, qo, kv, 2 * group, 2, head_dim, page_size, dtype)
    ref_o, ref_lse = attention_paged(variant, batch.q, batch.k_cache, batch.v_cache,
                                     *batch.table, params={"allowed": masks})
    attn = attnlang.BatchAttention(variant, 2 * group, 2, head_dim, dtype=dtype,
                                   page_size=page_size, max_total_q=int(qo.sum()) + 16,
                                   max_work_items=1 << 16, max_partial_rows=1 << 18,
                                   max_merge_rows=1 << 17)
    plan = attn.plan(*batch.table, kv_chunk_size=chunk, params={"allowed": masks})
    q = to_device(cp, batch.q, dtype)
    kc, vc = to_device(cp, batch.k_cache, dtype), to_device(cp, batch.v_cache, dtype)
    out = poisoned(cp, q.shape, dtype)
    got, lse = attn.run(q, (kc, vc), out=out, return_lse=True)
    host = from_device(cp, got, dtype)
    assert not np.isnan(host).any(), "rows left unwritten"
    err = rel_l2(host, ref_o)
    error_log(dtype, err, where)
    assert err <= TOLERANCE[dtype], f"relative L2 error {err:.2e}"
    check_lse(cp.asnumpy(lse), ref_lse, dtype)
    return plan


@pytest.mark.parametrize("dtype, head_dim, group, chunk", [
    ("bfloat16", 128, 4, None), ("float16", 64, 1, 1024), ("bfloat16", 256, 8, None)])
def test_token_tree_over_a_long_context(cp, error_log, dtype, head_dim, group, chunk):
    """64-node trees over a 4096-token context (the issue's case), two requests."""
    rng = np.random.default_rng(head_dim)
    masks = [token_tree(rng, 4096, 64), token_tree(rng, 4000, 64)]
    qo, kv = [64, 64], [4096 + 64, 4000 + 64]
    variant = attnlang.load(VARIANT_PATHS["spec_tree"])
    check(cp, variant, masks, qo, kv, dtype=dtype, head_dim=head_dim, group=group,
          chunk=chunk, error_log=error_log,
          where=f"tree 64/4096 {SHORT[dtype]} d{head_dim} g{group}")


@pytest.mark.parametrize("block, density", [(64, 0.3), (128, 0.5), (16, 0.5)])
def test_block_sparse_layouts(cp, error_log, block, density):
    rng = np.random.default_rng(block)
    qo, kv = [1500, 700, 1], [1500, 1200, 900]
    masks = [block_sparse(rng, q, k, block, density) for q, k in zip(qo, kv, strict=True)]
    variant = attnlang.load(VARIANT_PATHS["spec_tree"])
    check(cp, variant, masks, qo, kv, group=2, error_log=error_log,
          where=f"block-sparse {block} {density}")


def test_a_pair_mask_and_a_window(cp, error_log):
    """Combined with another mask: the tile classes meet (and), per element too."""
    variant = attnlang.parse("variant tw\nparam allowed: bool[q, kv]\n"
                             "mask = allowed[q_row, kv_pos] and q_pos - kv_pos < 300 and causal\n")
    rng = np.random.default_rng(3)
    qo, kv = [900, 40], [1300, 600]
    masks = [block_sparse(rng, q, k, 32, 0.7) for q, k in zip(qo, kv, strict=True)]
    check(cp, variant, masks, qo, kv, group=1, chunk=256, error_log=error_log,
          where="pair mask and window")


def test_graph_replays_a_new_plans_masks(cp):
    """Capture run() once; plan() again with other masks; the replay uses them."""
    variant = attnlang.load(VARIANT_PATHS["spec_tree"])
    rng = np.random.default_rng(9)
    qo, kv = np.array([64, 64]), np.array([1000, 700])
    batch = make_batch(rng, qo, kv, 8, 2, 128, 16, "bfloat16")
    attn = attnlang.BatchAttention(variant, 8, 2, 128, page_size=16)
    q = to_device(cp, batch.q, "bfloat16")
    kc, vc = to_device(cp, batch.k_cache, "bfloat16"), to_device(cp, batch.v_cache, "bfloat16")
    out = poisoned(cp, q.shape, "bfloat16")
    first = [token_tree(rng, k - 64, 64) for k in kv]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        attn.plan(*batch.table, params={"allowed": first})
        attn.run(q, (kc, vc), out=out)  # warm-up outside capture
        stream.synchronize()
        stream.begin_capture()
        attn.run(q, (kc, vc), out=out)
        graph = stream.end_capture()
        for masks in ([block_sparse(rng, 64, k, 32, 0.5) for k in kv], first):
            attn.plan(*batch.table, params={"allowed": masks})
            out[...] = poisoned(cp, out.shape, "bfloat16")
            graph.launch(stream)
            stream.synchronize()
            ref, _ = attention_paged(variant, batch.q, batch.k_cache, batch.v_cache,
                                     *batch.table, params={"allowed": masks})
            got = from_device(cp, out, "bfloat16")
            assert not np.isnan(got).any() and rel_l2(got, ref) <= TOLERANCE["bfloat16"]


def test_plan_errors_name_the_mask(cp):
    variant = attnlang.load(VARIANT_PATHS["spec_tree"])
    attn = attnlang.BatchAttention(variant, 8, 2, 128, page_size=16, max_pair_mask_bytes=1024)
    table = ([0, 4], [0, 1], [0], [16])  # one request: 4 queries over 16 keys
    with pytest.raises(ValueError, match=r"missing param 'allowed' \(bool\[q, kv\]\): pass "
                                         r"params=\{'allowed': ...\} to plan\(\)"):
        attn.plan(*table)
    with pytest.raises(ValueError, match=r"plan\(\) takes only per-pair masks"):
        attn.plan(*table, params={"allowed": [np.ones((4, 16), bool)], "cap": 1.0})
    big = ([0, 64], [0, 64], list(range(64)), [16])  # 64 x 1024 bits: past 1024 bytes
    with pytest.raises(CapacityError, match="max_pair_mask_bytes"):
        attn.plan(*big, params={"allowed": [np.ones((64, 1024), bool)]})
