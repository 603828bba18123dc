"""Paged KV caches from ragged K/V, in NumPy: for tests, examples and benchmarks.

The cache layout is the kernels' (docs/INTERNALS.md): ``k_cache``/``v_cache``
``[num_pages, page_size, num_kv_heads, head_dim]``; request b owns pages
``kv_indices[kv_page_indptr[b]:kv_page_indptr[b+1]]`` in sequence order, the last holding
``kv_last_page_len[b]`` valid tokens (0 for a request with no tokens, which owns no pages).

Example::

    k = rng.standard_normal((30, 8, 128)); v = ...          # two requests: 12 + 18 tokens
    k_cache, v_cache, kv_indices, kv_indptr, last = ragged_to_paged(k, v, [0, 12, 30], 16)
    # kv_indptr [0, 1, 3], last [12, 2]; pages in random order, unused slots poisoned
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ragged_to_paged", "paged_to_ragged", "indptr_from_lengths", "POISON_SCALE"]

# Unused pages and the tail of each last page hold values this large (random sign): a kernel
# that reads them produces visibly wrong output, yet nothing is NaN or inf, so the failure
# shows up as an error in the comparison rather than being masked by NaN handling.
POISON_SCALE = 64.0


def indptr_from_lengths(lengths: Any) -> np.ndarray:
    """``[0, l0, l0 + l1, ...]`` as int32. Example: ``[3, 0, 4] -> [0, 3, 3, 7]``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)


def ragged_to_paged(k: np.ndarray, v: np.ndarray, kv_indptr: Any, page_size: int,
                    num_pages: int | None = None, shuffle: bool = True,
                    rng: np.random.Generator | int | None = None):
    """Scatter ragged K/V into a paged cache.

    Args:
        k, v: [total_kv, num_kv_heads, head_dim] (any float dtype), request b's tokens at
            rows kv_indptr[b]:kv_indptr[b+1]; v's head dim may differ (MLA: 192 and 128).
        kv_indptr: [batch+1] token offsets.
        page_size: tokens per page.
        num_pages: pages in the cache (default: what the batch needs plus a quarter spare,
            at least one, so unused pages exist). Must be >= what the batch needs.
        shuffle: give requests pages in random order (tests non-contiguous page tables);
            False assigns pages 0, 1, 2, ... in order.
        rng: a Generator or seed for the page order and the poison values.

    Returns (k_cache, v_cache, kv_indices, kv_page_indptr, kv_last_page_len): caches
    [num_pages, page_size, num_kv_heads, head_dim] in k's (v's) dtype and head dim; int32 page
    table arrays ready for BatchAttention.plan (kv_page_indptr is its kv_indptr).
    """
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    k, v = np.asarray(k), np.asarray(v)
    if k.ndim != 3 or v.ndim != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"k and v must be [total_kv, num_kv_heads, head_dim] with the same "
                         f"tokens and heads, got {k.shape} and {v.shape}")
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
            or page_size < 1:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    indptr = np.asarray(kv_indptr, dtype=np.int64)
    if indptr.ndim != 1 or indptr.size < 1 or indptr[0] != 0 or (np.diff(indptr) < 0).any():
        raise ValueError("kv_indptr must be non-decreasing and start at 0")
    if indptr[-1] != k.shape[0]:
        raise ValueError(f"kv_indptr[-1] = {indptr[-1]} must equal the number of K/V rows "
                         f"{k.shape[0]}")
    lengths = np.diff(indptr)
    pages_per_req = -(-lengths // page_size)
    needed = int(pages_per_req.sum())
    if num_pages is None:
        num_pages = needed + max(1, needed // 4)
    if num_pages < needed:
        raise ValueError(f"num_pages = {num_pages} is too small: the batch needs {needed}")
    _, hkv, d = k.shape
    k_cache = _poison(rng, (num_pages, page_size, hkv, d), k.dtype)
    v_cache = _poison(rng, (num_pages, page_size, hkv, v.shape[2]), v.dtype)
    order = rng.permutation(num_pages) if shuffle else np.arange(num_pages)
    kv_indices = order[:needed].astype(np.int32)
    page_indptr = indptr_from_lengths(pages_per_req)
    last = np.where(lengths > 0, lengths - (pages_per_req - 1) * page_size, 0).astype(np.int32)
    for b in range(lengths.shape[0]):
        n = int(lengths[b])
        if n == 0:
            continue
        pages = kv_indices[page_indptr[b]:page_indptr[b + 1]]
        # Token t of the request lives at (pages[t // page_size], t % page_size); the tail
        # of the last page keeps its poison.
        t = np.arange(n)
        k_cache[pages[t // page_size], t % page_size] = k[indptr[b]:indptr[b + 1]]
        v_cache[pages[t // page_size], t % page_size] = v[indptr[b]:indptr[b + 1]]
    return k_cache, v_cache, kv_indices, page_indptr, last


def paged_to_ragged(k_cache: np.ndarray, v_cache: np.ndarray, kv_indices: Any,
                    kv_page_indptr: Any, kv_last_page_len: Any):
    """The inverse of ragged_to_paged: (k, v, kv_indptr) with k, v [total_kv, Hkv, D] (v: its
    own head dim)."""
    kv_indices = np.asarray(kv_indices, dtype=np.int64)
    page_indptr = np.asarray(kv_page_indptr, dtype=np.int64)
    last = np.asarray(kv_last_page_len, dtype=np.int64)
    page_size = k_cache.shape[1]
    ks, vs, lengths = [], [], []
    for b in range(last.shape[0]):
        pages = kv_indices[page_indptr[b]:page_indptr[b + 1]]
        n = 0 if pages.size == 0 else (pages.size - 1) * page_size + int(last[b])
        ks.append(k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n])
        vs.append(v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n])
        lengths.append(n)
    k = np.concatenate(ks) if ks else np.zeros((0, *k_cache.shape[2:]), k_cache.dtype)
    v = np.concatenate(vs) if vs else np.zeros((0, *v_cache.shape[2:]), v_cache.dtype)
    return k, v, indptr_from_lengths(lengths)


def _poison(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    magnitude = rng.uniform(0.5 * POISON_SCALE, POISON_SCALE, size=shape)
    sign = rng.choice(np.array([-1.0, 1.0]), size=shape)
    if np.issubdtype(np.dtype(dtype), np.floating):
        return (magnitude * sign).astype(dtype)
    return (magnitude * sign).astype(np.float32).astype(dtype)
