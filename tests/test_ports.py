"""The ported examples (T5, Swin, Longformer, Flamingo, tiled NATTEN, GELU attention, MLA) against
independent float64 formulas, written the way their papers' code computes them: loops and
index arithmetic in Python, not attnlang's semantics. The reference must agree to 1e-12."""

from __future__ import annotations

import math

import numpy as np

import attnlang as al
from tests.variant_files import ROOT

HQ, HKV, D = 4, 2, 16


def _batch(rng, qo_lens, kv_lens):
    q = rng.standard_normal((sum(qo_lens), HQ, D))
    k = rng.standard_normal((sum(kv_lens), HKV, D))
    v = rng.standard_normal((sum(kv_lens), HKV, D))
    return q, k, v, np.cumsum([0, *qo_lens]), np.cumsum([0, *kv_lens])


def _dense(q, k, v, qo_indptr, kv_indptr, score, sm_scale, softmax=True):
    """Plain attention; score(b, h, i, j, s) -> (s', allowed) for query row i, key j."""
    out = np.zeros_like(q)
    for b in range(len(qo_indptr) - 1):
        qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        qb, kb, vb = q[qs], k[ks], v[ks]
        for h in range(HQ):
            g = h // (HQ // HKV)
            for i in range(len(qb)):
                weights = np.zeros(len(kb))
                scores = [score(b, h, i, j, sm_scale * float(qb[i, h] @ kb[j, g]))
                          for j in range(len(kb))]
                allowed = np.array([a for _, a in scores], bool)
                s = np.array([x for x, _ in scores])
                if softmax and allowed.any():
                    e = np.exp(s[allowed] - s[allowed].max())
                    weights[allowed] = e / e.sum()
                elif not softmax:
                    weights[allowed] = s[allowed]
                out[qo_indptr[b] + i, h] = weights @ vb[:, g]
    return out


def _check(name, rng, qo_lens, kv_lens, params, score, sm_scale=0.3, softmax=True):
    variant = al.load(ROOT / "examples" / f"{name}.attn")
    q, k, v, qo_indptr, kv_indptr = _batch(rng, qo_lens, kv_lens)
    got, _ = al.reference.attention(variant, q, k, v, qo_indptr, kv_indptr, params, sm_scale)
    want = _dense(q, k, v, qo_indptr, kv_indptr, score, sm_scale, softmax)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _t5_bucket(relative_position, num_buckets=32, max_distance=128):
    """transformers' T5Attention._relative_position_bucket, unidirectional, for one int."""
    relative_position = -min(relative_position, 0)
    max_exact = num_buckets // 2
    if relative_position < max_exact:
        return relative_position
    large = max_exact + int(math.log(relative_position / max_exact)
                            / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return min(large, num_buckets - 1)


def test_t5_bias():
    rng = np.random.default_rng(1)
    bias = rng.standard_normal((HQ, 32))
    qo, kv = (3, 1, 5), (300, 40, 5)

    def score(b, h, i, j, s):
        q_pos = kv[b] - qo[b] + i
        return s + bias[h, _t5_bucket(j - q_pos)], j <= q_pos

    _check("t5_bias", rng, qo, kv, {"bias": bias}, score, sm_scale=1.0)


def test_swin_bias():
    rng = np.random.default_rng(2)
    w = 7
    table = rng.standard_normal(((2 * w - 1) ** 2, HQ))  # Swin's relative_position_bias_table
    coords = np.stack(np.meshgrid(np.arange(w), np.arange(w), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (w - 1)
    index = rel[..., 0] * (2 * w - 1) + rel[..., 1]  # Swin's relative_position_index
    bias = table.T.reshape(HQ, 2 * w - 1, 2 * w - 1)

    def score(b, h, i, j, s):
        return s + table[index[i, j], h], True

    _check("swin_bias", rng, (49, 49), (49, 49), {"bias": bias}, score)


def test_longformer():
    rng = np.random.default_rng(3)
    qo, kv = (280, 1), (280, 700)
    is_global = np.zeros((2, 16384), bool)
    is_global[0, [0, 17, 279]] = True
    is_global[1, [3, 650]] = True

    def score(b, h, i, j, s):
        q_pos = kv[b] - qo[b] + i
        return s, abs(q_pos - j) <= 256 or is_global[b, j] or is_global[b, q_pos]

    _check("longformer", rng, qo, kv, {"is_global": is_global}, score)


def test_flamingo_cross_attention():
    rng = np.random.default_rng(4)
    # Request 0: 12 text tokens, images 1 and 2 of 5 visual tokens each; request 1: no image.
    text_image = np.zeros((2, 8192), np.int64)
    text_image[0, :12] = [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    key_image = np.zeros((2, 4096), np.int64)
    key_image[0, :10] = [1] * 5 + [2] * 5
    key_image[1, :3] = 1

    def score(b, h, i, j, s):
        image = text_image[b, i]
        return s, image != 0 and key_image[b, j] == image

    _check("flamingo_xattn", rng, (12, 4), (10, 3),
           {"text_image": text_image, "key_image": key_image}, score)


def test_natten_tiled():
    rng = np.random.default_rng(5)
    width, tile, kernel = 64, 8, 7

    def pixel(index):  # FlexAttention's tiled layout: tile by tile, row-major inside
        t, inside = divmod(index, tile * tile)
        ty, tx = divmod(t, width // tile)
        return ty * tile + inside // tile, tx * tile + inside % tile

    def score(b, h, i, j, s):
        (qy, qx), (ky, kx) = pixel(i), pixel(j)
        y0 = min(max(qy - kernel // 2, 0), width - kernel)
        x0 = min(max(qx - kernel // 2, 0), width - kernel)
        return s, y0 <= ky < y0 + kernel and x0 <= kx < x0 + kernel

    # 200 query rows of the 4096-pixel image (the tail of a prompt) against all of it.
    _check("natten_tiled", rng, (200,), (200,), {}, score)


def test_sandwich():
    rng = np.random.default_rng(7)
    qo, kv = (4, 1), (50, 9)
    d_bar = 128

    def embedding(position):  # sinusoidal, [sin | cos] of position / 10000^(2i / d)
        freq = 10000.0 ** (-2 * np.arange(1, d_bar // 2 + 1) / d_bar)
        return np.concatenate([np.sin(position * freq), np.cos(position * freq)])

    def score(b, h, i, j, s):
        q_pos = kv[b] - qo[b] + i
        return s + 0.5 * float(embedding(q_pos) @ embedding(j)), j <= q_pos

    _check("sandwich", rng, qo, kv, {"scale": 0.5}, score)


def test_gelu_attention():
    rng = np.random.default_rng(6)
    qo, kv = (5, 1), (9, 30)

    def score(b, h, i, j, s):
        q_pos = kv[b] - qo[b] + i
        return 0.5 * s * (1 + math.erf(s / math.sqrt(2))) / (q_pos + 1), j <= q_pos

    _check("gelu_attention", rng, qo, kv, {}, score, softmax=False)


def test_mla_value_head_dim():
    """Queries and keys of 192, values of 128: the reference's output is 128 wide and equals
    causal softmax attention written out by hand (DeepSeek's scale, one request per loop)."""
    rng = np.random.default_rng(7)
    qo, kv, hq, hkv = (3, 1), (9, 6), 4, 2
    q = rng.standard_normal((sum(qo), hq, 192))
    k = rng.standard_normal((sum(kv), hkv, 192))
    v = rng.standard_normal((sum(kv), hkv, 128))
    scale = 1.0 / math.sqrt(192) * 1.3**2
    got, lse = al.reference.attention(al.load(ROOT / "examples" / "mla.attn"), q, k, v,
                                      np.cumsum([0, *qo]), np.cumsum([0, *kv]), None, scale)
    assert got.shape == (sum(qo), hq, 128) and lse.shape == (sum(qo), hq)
    want = np.zeros_like(got)
    for b in range(len(qo)):
        q0, k0 = sum(qo[:b]), sum(kv[:b])
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(qo[b]):
                visible = kv[b] - qo[b] + i + 1  # causal: keys 0 .. q_pos
                s = [scale * float(q[q0 + i, h] @ k[k0 + j, g]) for j in range(visible)]
                e = np.exp(np.array(s) - max(s))
                want[q0 + i, h] = (e / e.sum()) @ v[k0:k0 + visible, g]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
