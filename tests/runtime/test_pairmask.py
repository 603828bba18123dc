"""Per-pair masks (bool[q, kv]) on the host: the forms plan() accepts, and the packed buffer
the kernels read (bits and block summary), decoded here independently of the packer."""

import numpy as np
import pytest

from attnlang.runtime import pairmask
from attnlang.runtime.pairmask import BLOCK_KV, BLOCK_Q


def masks_for(rng, qo, kv, density=0.5):
    return [rng.random((q, k)) < density for q, k in zip(qo, kv, strict=True)]


def unpack(buf: np.ndarray, qo, kv):
    """The buffer read back the way common.cuh's pair_bit / pair_tile read it."""
    head = buf[:32].view(np.int64)
    batch, bits_at, blocks_at = (int(x) for x in head[:3])
    block_q, block_kv = (int(x) for x in buf[24:32].view(np.int32))
    starts = buf[32:32 + 16 * batch].view(np.int64)
    words = buf[bits_at:blocks_at].view(np.uint32)
    out, summaries = [], []
    for b, (q, k) in enumerate(zip(qo, kv, strict=True)):
        first = int(starts[b]) * 32
        idx = first + np.arange(q * k)
        bits = (words[idx >> 5] >> (idx & 31).astype(np.uint32)) & 1
        out.append(bits.reshape(q, k).astype(bool))
        nb = -(-q // block_q) * -(-k // block_kv)
        at = blocks_at + int(starts[batch + b])
        summaries.append(buf[at:at + nb].reshape(-(-q // block_q), -(-k // block_kv)))
    return batch, (block_q, block_kv), out, summaries


def test_bits_and_summary_round_trip():
    rng = np.random.default_rng(0)
    qo, kv = (1, 17, 64, 0, 33), (5, 40, 4160, 3, 33)
    masks = masks_for(rng, qo, kv)
    masks[2][:, :4096] = True  # a token tree: every node sees the whole context
    masks[2][16:32, 4096:] = False
    buf = pairmask.pack(masks)
    assert buf.shape[0] == pairmask.packed_size(qo, kv)
    # plan() computes the summaries once for the buffer and the planner: the same bytes
    assert np.array_equal(pairmask.pack(masks, pairmask.summaries(masks)), buf)
    batch, blocks, got, summaries = unpack(buf, qo, kv)
    assert batch == 5 and blocks == (BLOCK_Q, BLOCK_KV)
    for m, g, s in zip(masks, got, summaries, strict=True):
        np.testing.assert_array_equal(g, m)
        for (i, j), byte in np.ndenumerate(s):  # bit 0: some true, bit 1: some false
            block = m[i * BLOCK_Q:(i + 1) * BLOCK_Q, j * BLOCK_KV:(j + 1) * BLOCK_KV]
            assert byte == int(block.any()) | (int((~block).any()) << 1)
    assert (summaries[2][:, :4096 // BLOCK_KV] == 1).all()  # the context: all true
    assert (summaries[2][1, 4096 // BLOCK_KV:] == 2).all()  # rows 16..31 of the tree: none


def test_flat_list_and_torch_forms_agree():
    rng = np.random.default_rng(1)
    qo, kv = (3, 2), (7, 9)
    masks = masks_for(rng, qo, kv)
    flat = np.concatenate([m.reshape(-1) for m in masks])  # FlashInfer's custom_mask
    for value in (masks, flat, list(flat)):
        got = pairmask.normalize(value, qo, kv, "allowed")
        assert all(np.array_equal(g, m) for g, m in zip(got, masks, strict=True))
    torch = pytest.importorskip("torch")
    got = pairmask.normalize(torch.from_numpy(flat), qo, kv, "allowed")
    assert all(np.array_equal(g, m) for g, m in zip(got, masks, strict=True))


@pytest.mark.parametrize("value, error, match", [
    (np.ones(40, bool), ValueError, r"param 'allowed' \(bool\[q, kv\]\) must be a list of 2 "
                                    r"\[qo_len, kv_len\] bool arrays or one flat bool array "
                                    r"of sum\(qo_len \* kv_len\) = 39 elements, got shape "
                                    r"\(40,\)"),
    ([np.ones((3, 7), bool), np.ones((2, 8), bool)], ValueError,
     r"request 1's matrix must be \[qo_len, kv_len\] = \(2, 9\), got \(2, 8\)"),
    (np.ones(39, np.int32), TypeError, r"must hold bools, got dtype int32"),
])
def test_wrong_forms_are_named(value, error, match):
    with pytest.raises(error, match=match):
        pairmask.normalize(value, (3, 2), (7, 9), "allowed")


def test_planner_blocks_are_sound():
    """PairBlocks.classify (the planner's view) against every box's elements: never 0 with a
    true inside, never 2 with a false inside; all three classes occur."""
    rng = np.random.default_rng(2)
    qo, kv = (40, 300, 5, 1), (100, 300, 900, 1)
    masks = [np.repeat(np.repeat(rng.random((-(-q // 32), -(-k // 64))) < 0.5, 32, 0), 64,
                       1)[:q, :k] for q, k in zip(qo, kv, strict=True)]
    masks[2] = rng.random((5, 900)) < 0.5
    blocks = pairmask.PairBlocks(masks)
    n = 3000
    b = rng.integers(0, len(qo), n)
    q, k = np.array(qo)[b], np.array(kv)[b]
    r0 = rng.integers(0, q)
    r1 = np.minimum(r0 + rng.integers(0, 40, n), q - 1)
    c0 = rng.integers(0, k)
    c1 = np.minimum(c0 + rng.integers(0, 200, n), k - 1)
    classes = blocks.classify(b, r0, r1, c0, c1)
    for i in range(n):
        box = masks[b[i]][r0[i]:r1[i] + 1, c0[i]:c1[i] + 1]
        assert not (classes[i] == 0 and box.any()) and not (classes[i] == 2 and not box.all())
    assert set(np.unique(classes)) == {0, 1, 2}
    assert blocks.classify(0, 50, 60, 0, 10) == 1  # rows past the request: unknown


def test_tree_mask_sees_ancestors_only():
    parents = [-1, 0, 0, 1, 3, -1]
    m = pairmask.tree_mask(parents, context=3)
    assert m.shape == (6, 9) and m[:, :3].all()
    ancestors = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 3, 4}, 5: {5}}
    for i, seen in ancestors.items():
        assert set(np.flatnonzero(m[i, 3:])) == seen
    with pytest.raises(ValueError, match=r"parents\[1\] = 1: a parent is an earlier node"):
        pairmask.tree_mask([-1, 1], context=0)


def test_block_sizes_match_the_kernels():
    """common.cuh's pair_tile reads blocks of the sizes the packer writes."""
    from tests.variant_files import ROOT

    text = (ROOT / "kernels_templates" / "common.cuh").read_text()
    assert (f"kPairBlockQ = {pairmask.BLOCK_Q}, kPairBlockKV = {pairmask.BLOCK_KV};"
            in text)
