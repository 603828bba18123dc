"""Per-pair masks (`param allowed: bool[q, kv]`): each request's own [qo_len, kv_len] bool
matrix, given to plan(), packed on the host into the one buffer the kernels read
(common.cuh: pair_bit, pair_tile).

Layout (bytes, little-endian; sections 16-byte aligned):

    int64 requests B, bits offset, blocks offset; int32 block_q, block_kv
    int64 word_start[B]     request b's bits start at this 32-bit word of the bits
    int64 block_start[B]    ... and its block summary at this byte of the blocks
    bits                    row-major, element (i, j) is bit i * kv_len + j of the request's
                            words (bit k of a word is its k-th element)
    blocks                  one byte per BLOCK_Q x BLOCK_KV block, row-major over the
                            request's blocks: bit 0 some element is true, bit 1 some is false
    32 zero bytes           what a kernel's tile window may read past the bits

The summary is what plan-time scanning buys: the kernels skip a tile whose covering blocks
are all false and drop the per-element test where they are all true.

    masks = normalize(value, qo_lens, kv_lens, "allowed")   # one 2-D bool array per request
    blocks = summaries(masks)                               # the block summary, once
    buffer = pack(masks, blocks)                            # np.uint8, ready to upload
    planner_view = PairBlocks(masks, blocks)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnlang.runtime.plan_types import CapacityError

__all__ = ["BLOCK_Q", "BLOCK_KV", "PairBlocks", "normalize", "pack", "packed_size",
           "plan_masks", "summaries", "tree_mask"]

BLOCK_Q, BLOCK_KV = 16, 32  # summary granularity: 16 query rows x 32 keys
_HEADER = 32  # bytes before word_start
# Zero bytes after the blocks: a kernel's tile window (common.cuh, make_pair_window) reads up
# to four words past the bits it needs.
_TAIL = 32


def normalize(value: Any, qo_lens: Sequence[int], kv_lens: Sequence[int],
              name: str) -> list[np.ndarray]:
    """A per-pair mask as one bool [qo_len, kv_len] array per request.

    value: a sequence of B 2-D bool arrays, or one flat bool array of sum(qo_len * kv_len)
    elements (FlashInfer's custom_mask layout: each request's matrix row-major, requests in
    order). NumPy arrays, lists or torch tensors (CUDA ones are copied to the host: the plan
    is made there). Raises TypeError / ValueError naming the param.
    """
    qo = [int(n) for n in qo_lens]
    kv = [int(n) for n in kv_lens]
    where = f"param {name!r} (bool[q, kv])"
    if isinstance(value, (list, tuple)) and len(value) == len(qo) and all(
            np.ndim(_host(m)) == 2 for m in value):
        masks = [_bool_array(m, where) for m in value]
        for b, (m, q, k) in enumerate(zip(masks, qo, kv, strict=True)):
            if m.shape != (q, k):
                raise ValueError(f"{where}: request {b}'s matrix must be [qo_len, kv_len] = "
                                 f"({q}, {k}), got {m.shape}")
        return masks
    flat = _bool_array(value, where)
    total = sum(q * k for q, k in zip(qo, kv, strict=True))
    if flat.ndim != 1 or flat.shape[0] != total:
        raise ValueError(f"{where} must be a list of {len(qo)} [qo_len, kv_len] bool arrays "
                         f"or one flat bool array of sum(qo_len * kv_len) = {total} elements, "
                         f"got shape {flat.shape}")
    ends = np.cumsum([q * k for q, k in zip(qo, kv, strict=True)])
    return [seg.reshape(q, k) for seg, q, k in zip(np.split(flat, ends[:-1]), qo, kv,
                                                    strict=True)]


def plan_masks(specs: Sequence[Any], params: Mapping[str, Any] | None,
               qo_lens: Sequence[int], kv_lens: Sequence[int], *, max_bytes: int,
               variant_name: str) -> tuple[dict[str, np.ndarray], dict[str, PairBlocks]]:
    """The per-pair masks of plan()'s params (the module's param `specs` say which are
    bool[q, kv]), packed for the kernels (`pack`) and summarised for the planner
    (`PairBlocks`: it trims and costs the work by them). Raises TypeError for params that are
    not a dict, ValueError for a missing mask or a param plan() does not take, and
    CapacityError for a packed mask over max_bytes."""
    params = {} if params is None else params
    if not isinstance(params, Mapping):
        raise TypeError(f"plan()'s params must be a dict, got {type(params).__name__}")
    pairs = [p.name for p in specs if p.is_pair]
    for name in params:
        if name not in pairs:
            raise ValueError(
                f"plan() takes only per-pair masks (bool[q, kv]) as params; pass {name!r} "
                f"to run()" + ("" if pairs else
                               f" (variant {variant_name} has no per-pair mask)"))
    packed, blocks = {}, {}
    for name in pairs:
        if name not in params:
            raise ValueError(f"missing param {name!r} (bool[q, kv]): pass "
                             f"params={{{name!r}: ...}} to plan(), one [qo_len, kv_len] "
                             "bool matrix per request")
        masks = normalize(params[name], qo_lens, kv_lens, name)
        summary = summaries(masks)  # the costly part: once for both views
        packed[name] = pack(masks, summary)
        if packed[name].nbytes > max_bytes:
            raise CapacityError("max_pair_mask_bytes", packed[name].nbytes, max_bytes,
                                f"bytes of the packed per-pair mask {name!r}")
        blocks[name] = PairBlocks(masks, summary)
    return packed, blocks


def tree_mask(parents: Sequence[int], context: int) -> np.ndarray:
    """A token tree's matrix for speculative decoding: [nodes, context + nodes], node i sees
    the `context` committed tokens and its ancestors (itself included). parents[i] is node
    i's parent, an earlier node, or -1 for a child of the context's last token.

    >>> tree_mask([-1, 0, 0], context=2).astype(int).tolist()
    [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]
    """
    nodes = len(parents)
    mask = np.zeros((nodes, context + nodes), bool)
    mask[:, :context] = True
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a parent is an earlier node or -1")
        mask[i, context + i] = True
        if parent >= 0:
            mask[i, context:] |= mask[parent, context:]
    return mask


def _host(m: Any) -> Any:
    if type(m).__module__.startswith("torch"):
        return m.detach().cpu().numpy()
    return m


def _bool_array(m: Any, where: str) -> np.ndarray:
    a = np.asarray(_host(m))
    if a.dtype != np.bool_:
        raise TypeError(f"{where} must hold bools, got dtype {a.dtype}")
    return a


def packed_size(qo_lens: Sequence[int], kv_lens: Sequence[int]) -> int:
    """Bytes `pack` returns for these lengths (what BatchAttention's buffer must hold)."""
    words, blocks = _starts(qo_lens, kv_lens)
    return _blocks_offset(len(words) - 1, int(words[-1])) + int(blocks[-1]) + _TAIL


def _starts(qo_lens, kv_lens) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative 32-bit words and summary bytes per request ([B + 1] each)."""
    qo = np.asarray(qo_lens, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    words = (qo * kv + 31) // 32
    blocks = -(-qo // BLOCK_Q) * -(-kv // BLOCK_KV)
    return (np.concatenate([[0], np.cumsum(words)]),
            np.concatenate([[0], np.cumsum(blocks)]))


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def _bits_offset(batch: int) -> int:
    return _align16(_HEADER + 16 * batch)


def _blocks_offset(batch: int, words: int) -> int:
    return _align16(_bits_offset(batch) + 4 * words)


def summaries(masks: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each request's block summary (bytes, `_summary`): what pack and PairBlocks both need,
    and most of their cost (about 90 ms for an 8192 x 8192 mask), so computed once."""
    return [_summary(m) for m in masks]


def pack(masks: Sequence[np.ndarray], blocks: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """The kernels' buffer (layout above) of one [qo_len, kv_len] bool array per request;
    blocks: their `summaries` (None: computed here)."""
    if blocks is None:
        blocks = summaries(masks)
    qo = [m.shape[0] for m in masks]
    kv = [m.shape[1] for m in masks]
    words, starts = _starts(qo, kv)
    batch = len(masks)
    bits_at, blocks_at = _bits_offset(batch), _blocks_offset(batch, int(words[-1]))
    out = np.zeros(blocks_at + int(starts[-1]) + _TAIL, np.uint8)
    header = out[:_HEADER].view(np.int64)
    header[:3] = (batch, bits_at, blocks_at)
    out[24:32].view(np.int32)[:] = (BLOCK_Q, BLOCK_KV)
    out[_HEADER:_HEADER + 16 * batch].view(np.int64)[:] = np.concatenate([words[:-1],
                                                                          starts[:-1]])
    bits = out[bits_at:bits_at + 4 * int(words[-1])]
    summary = out[blocks_at:blocks_at + int(starts[-1])]
    for b, m in enumerate(masks):
        n = m.size
        if n == 0:
            continue
        packed = np.packbits(m.reshape(-1), bitorder="little")  # element k: bit k % 8 of byte k/8
        bits[4 * int(words[b]):4 * int(words[b]) + packed.shape[0]] = packed
        summary[int(starts[b]):int(starts[b + 1])] = blocks[b].reshape(-1)
    return out


def _summary(m: np.ndarray) -> np.ndarray:
    """[ceil(q / BLOCK_Q), ceil(kv / BLOCK_KV)] bytes: bit 0 any true, bit 1 any false (the
    padding past the matrix counts as neither)."""
    q, k = m.shape
    nq, nk = -(-q // BLOCK_Q), -(-k // BLOCK_KV)
    true = np.zeros((nq * BLOCK_Q, nk * BLOCK_KV), bool)
    false = np.zeros_like(true)
    true[:q, :k], false[:q, :k] = m, ~m
    blocks = (nq, BLOCK_Q, nk, BLOCK_KV)
    any_true = true.reshape(blocks).any(axis=(1, 3))
    any_false = false.reshape(blocks).any(axis=(1, 3))
    return (any_true.astype(np.uint8) | (any_false.astype(np.uint8) << 1))


class PairBlocks:
    """The block summary of one per-pair mask on the host, for the planner: the class of any
    box of a request's matrix (0 all false, 1 mixed, 2 all true) from the blocks covering it,
    vectorised over many boxes (summed-area tables of the blocks holding a true / a false).

        blocks = PairBlocks(masks)
        blocks.classify(batch, row_lo, row_hi, col_lo, col_hi)   # int8 array
    """

    def __init__(self, masks: Sequence[np.ndarray], blocks: Sequence[np.ndarray] | None = None):
        """blocks: the masks' `summaries` (None: computed here)."""
        if blocks is None:
            blocks = summaries(masks)
        self.qo = np.array([m.shape[0] for m in masks], np.int64)
        self.kv = np.array([m.shape[1] for m in masks], np.int64)
        trues, falses, offsets, widths = [], [], [0], []
        for m, s in zip(masks, blocks, strict=True):
            s = s if m.size else np.zeros((0, 0), np.uint8)
            for bit, tables in ((1, trues), (2, falses)):
                t = np.zeros((s.shape[0] + 1, s.shape[1] + 1), np.int64)
                t[1:, 1:] = ((s & bit) != 0).cumsum(0).cumsum(1)
                tables.append(t.reshape(-1))
            offsets.append(offsets[-1] + trues[-1].shape[0])
            widths.append(s.shape[1] + 1)
        self._true = np.concatenate(trues) if trues else np.zeros(1, np.int64)
        self._false = np.concatenate(falses) if falses else np.zeros(1, np.int64)
        self._offset = np.array(offsets[:-1], np.int64)
        self._width = np.array(widths, np.int64)

    def classify(self, batch, row_lo, row_hi, col_lo, col_hi) -> np.ndarray:
        """Per box: 0 if every element is false, 2 if every one is true, else 1 (also for a
        box outside its request's matrix, which the kernels never ask about)."""
        b, r0, r1, c0, c1 = (np.asarray(x, np.int64) for x in
                             np.broadcast_arrays(batch, row_lo, row_hi, col_lo, col_hi))
        q, k = self.qo[b], self.kv[b]
        r0, r1 = np.maximum(r0, 0), np.minimum(r1, q - 1)
        c0, c1 = np.maximum(c0, 0), np.minimum(c1, k - 1)
        empty = (r0 > r1) | (c0 > c1)
        qb0, qb1 = r0 // BLOCK_Q, np.where(empty, r0 // BLOCK_Q, r1 // BLOCK_Q + 1)
        kb0, kb1 = c0 // BLOCK_KV, np.where(empty, c0 // BLOCK_KV, c1 // BLOCK_KV + 1)
        base, w = self._offset[b], self._width[b]

        def count(table):
            at = lambda i, j: table[np.where(empty, 0, base + i * w + j)]  # noqa: E731
            return at(qb1, kb1) - at(qb0, kb1) - at(qb1, kb0) + at(qb0, kb0)

        trues, falses = count(self._true), count(self._false)
        out = np.where(trues == 0, 0, np.where(falses == 0, 2, 1))
        return np.where(empty, 1, out).astype(np.int8)
