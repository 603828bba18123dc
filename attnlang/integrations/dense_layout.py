"""How transformers' dense attention inputs map onto attnlang's paged batch: pure NumPy.

transformers hands an attention function ``query [B, Hq, Sq, D]`` and ``key``/``value``
``[B, Hkv, Sk, D]`` (the whole cache of the layer, the new tokens last), and a key-padding mask
``[B, Sk]`` (True = a real token) or None. attnlang reads K/V through a page table, so no
K/V copy is needed: with page_size 1 every token of K is one "page" of D elements, found by
its element offset / D. Two layouts:

- ``by_head`` (the default): each (batch row, KV head) pair is one attnlang *unit* with one KV
  head and the group's Hq/Hkv query heads. K's token (b, h, s) starts at element
  b*stride_b + h*stride_h + s*D of the key tensor: as long as those strides are multiples of
  D, K itself (any DynamicCache or StaticCache layout) is the paged cache. q is laid out
  ``[B, Hkv, Sq, group, D]``. A variant that reads `head`, `kv_head` or `batch` (or a tensor
  param indexed by them) would see the unit's numbering instead: those use
- ``by_token``: each batch row is a unit with all heads; K/V are copied once per layer to
  ``[B, Sk, Hkv, D]`` (token-major), q to ``[B, Sq, Hq, D]``.

Padding: a unit's real keys are those the mask keeps, in order, so `kv_pos` counts real tokens
(left padding shifts nothing). Its query rows are the last Sq key positions; the real ones
(mask True) must be one contiguous run (left or right padding) and form one attnlang request.
Each run of padded query rows becomes a request of its own over its own (padded) keys, so its
output rows are finite and never touch the real requests.

Example: B=1, Sk=Sq=4, mask [0, 1, 1, 1] (one left pad): request 0 = query row 0 over key 0
(the pad), request 1 = query rows 1..3 over keys 1..3, with q_pos 0..2 and kv_pos 0..2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DensePlan", "dense_plan", "key_pages"]


@dataclass(frozen=True, eq=False)
class DensePlan:
    """A BatchAttention plan (page_size 1) for one dense call, and its sizes.

    qo_indptr, kv_indptr, kv_indices, kv_last_page_len: plan()'s arguments. num_requests,
    total_q: for sizing the BatchAttention. Rows of q are unit-major, Sq per unit.
    """

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray

    @property
    def num_requests(self) -> int:
        return int(self.qo_indptr.shape[0] - 1)

    @property
    def total_q(self) -> int:
        return int(self.qo_indptr[-1])


def key_pages(strides: tuple[int, ...], head_dim: int, batch: int, heads: int) -> np.ndarray:
    """Page (= token, page_size 1) number of position 0 of each (b, h), for a key tensor
    ``[B, Hkv, Sk, D]`` with these element strides, as ``[B, H]`` int64; a token s further
    along is page + s. Raises ValueError when the layout is not one of D-element tokens
    (the last dim not contiguous, tokens not D apart, or b/h strides not multiples of D).

    Example: ``key_pages((8*10*64, 10*64, 64, 1), 64, 2, 8)[1, 3] == 8*10 + 3*10``.
    """
    sb, sh, ss, sd = strides
    if sd != 1 or ss != head_dim or sb % head_dim or sh % head_dim:
        raise ValueError(
            f"key/value strides {strides} are not whole tokens of head_dim {head_dim} "
            "elements (expected [..., Sk, D] with stride D between tokens)")
    return (np.arange(batch)[:, None] * (sb // head_dim)
            + np.arange(heads)[None, :] * (sh // head_dim)).astype(np.int64)


def dense_plan(unit_pages: np.ndarray, q_len: int, kv_len: int,
               key_mask: np.ndarray | None) -> DensePlan:
    """The page_size-1 plan of a dense call.

    unit_pages [B, U]: page of key position 0 of unit (b, u) (`key_pages`; U = Hkv in the
    by_head layout, 1 by_token). q_len, kv_len: Sq, Sk (queries are the last Sq keys).
    key_mask [B, Sk] bool (True = real token) or None. Units are ordered b-major; each unit
    owns Sq consecutive rows of q. Raises ValueError for a mask whose real query rows are
    not one contiguous run.
    """
    batch, units = unit_pages.shape
    if q_len > kv_len:
        raise ValueError(f"the query ({q_len} tokens) is longer than the keys ({kv_len}): "
                         "queries must be the last tokens of the key sequence")
    start = kv_len - q_len  # key position of query row 0
    if key_mask is not None and key_mask.all():
        key_mask = None  # generate() hands an all-True mask to unpadded batches
    if key_mask is None:  # no padding (every decode step of an unpadded batch): vectorised
        n = batch * units
        kv_indices = (unit_pages.reshape(n, 1) + np.arange(kv_len)).ravel()
        return DensePlan(np.arange(n + 1, dtype=np.int32) * q_len,
                         np.arange(n + 1, dtype=np.int32) * kv_len,
                         kv_indices.astype(np.int32), np.full(n, int(kv_len > 0), np.int32))
    qo_lens, kv_lists = [], []  # one entry per request of one unit, per batch row
    for b in range(batch):
        real = None if key_mask is None else key_mask[b]
        rows = np.ones(q_len, bool) if real is None else real[start:]
        runs = _runs(rows)
        if sum(1 for is_real, _, _ in runs if is_real) > 1:
            raise ValueError(
                f"attention_mask row {b} has padding between real query tokens; attnlang "
                "supports left or right padding (one contiguous run of real tokens)")
        row_qo, row_kv = [], []
        for is_real, lo, hi in runs:
            row_qo.append(hi - lo)
            if is_real:
                keys = np.arange(kv_len) if real is None else np.flatnonzero(real)
            else:  # padded query rows attend to their own (padded) key slots: finite rows
                keys = np.arange(start + lo, start + hi)
            row_kv.append(keys)
        for u in range(units):
            qo_lens += row_qo
            kv_lists += [unit_pages[b, u] + keys for keys in row_kv]
    kv_lens = np.array([len(k) for k in kv_lists], dtype=np.int64)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens, dtype=np.int64)])
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)])
    kv_indices = (np.concatenate(kv_lists) if kv_lists else np.zeros(0, np.int64))
    return DensePlan(qo_indptr.astype(np.int32), kv_indptr.astype(np.int32),
                     kv_indices.astype(np.int32), (kv_lens > 0).astype(np.int32))


def _runs(flags: np.ndarray) -> list[tuple[bool, int, int]]:
    """Maximal runs of equal flags: (flag, start, end) with end exclusive."""
    if flags.size == 0:
        return []
    edges = np.flatnonzero(np.diff(flags.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), int(flags.size)]
    return [(bool(flags[lo]), lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
