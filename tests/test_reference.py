"""The NumPy reference (attnlang.reference) against the papers' own definitions.

Each variant of tests/variant_files.py (the zoo plus the test-only variants) is written a
second time here, directly from its paper, as plain NumPy over loops on requests, heads and
query rows (`Paper` below). Nothing here calls the IR evaluator, so a mistake in either one
shows up as a mismatch. Hand-built IR covers what no variant file pins down exactly: the
builtin table one function at a time, C integer division, the reductions.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

import attnlang as al
from attnlang import ir
from attnlang.reference import attention, attention_paged
from tests.variant_files import ROOT, VARIANT_FILES, VARIANT_IDS

F, INT, B = ir.FLOAT, ir.INT, ir.BOOL
RTOL = 1e-10  # float64 reference vs float64 formula


def load(name: str) -> ir.Variant:
    for path in VARIANT_FILES:
        if path.stem == name:
            return al.load(path)
    raise KeyError(name)


# ----------------------------------------------------------------------------------------
# The papers' definitions, written independently of the evaluator.
# ----------------------------------------------------------------------------------------


def rope_half(x: np.ndarray, pos, theta: float) -> np.ndarray:
    """RoFormer rotary embedding in the GPT-NeoX / Llama "rotate_half" layout: element i is
    paired with i + D/2 and turned by pos * theta^(-2i/D). x [..., D], pos [...] or scalar."""
    d = x.shape[-1]
    pos = np.asarray(pos, dtype=np.float64)
    out = np.empty_like(x)
    for i in range(d // 2):
        angle = pos * theta ** (-2.0 * i / d)
        lo, hi = x[..., i], x[..., i + d // 2]
        out[..., i] = lo * np.cos(angle) - hi * np.sin(angle)
        out[..., i + d // 2] = hi * np.cos(angle) + lo * np.sin(angle)
    return out


def rope_pairs(x: np.ndarray, pos, theta: float) -> np.ndarray:
    """GPT-J rotary embedding: elements (2i, 2i+1) form a complex number turned by
    pos * theta^(-2i/D)."""
    d = x.shape[-1]
    pos = np.asarray(pos, dtype=np.float64)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(
        1j * pos[..., None] * theta ** (-2.0 * np.arange(d // 2) / d)
    )
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def rms_norm(x: np.ndarray, w, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * w


def c_mod(a, n: int) -> np.ndarray:
    """C's `%`: the remainder has the sign of the dividend."""
    return np.array([int(math.fmod(int(x), n)) for x in np.ravel(a)]).reshape(np.shape(a))


def causal(qp, kp):
    return kp <= qp


def _ident(x, *_):
    return x


@dataclass
class Paper:
    """One variant as its paper defines it. Per request b, query head h (kv head kvh):
    query(x [D], q_pos, b, h, P), key/value(x [kv_len, D], kv_pos [kv_len], b, kvh, P),
    logits(s [kv_len], q_pos, kv_pos, b, h, kv_len, P), mask(q_pos, kv_pos, b, P),
    output(o [D], q_pos, b, h, P). P: the params passed at run time."""

    params: Callable[[np.random.Generator, Dims], dict] = lambda rng, dims: {}
    query: Callable = _ident
    key: Callable = _ident
    value: Callable = _ident
    logits: Callable = _ident
    mask: Callable = lambda qp, kp, b, P: np.ones(np.shape(kp), bool)
    output: Callable = _ident
    softmax: bool = True
    # A mask that also reads the query's row in its request: (q_pos, q_row, kv_pos, b, P).
    row_mask: Callable | None = None


@dataclass
class Dims:
    hq: int
    hkv: int
    d: int
    qo_lens: list[int] = field(default_factory=list)
    kv_lens: list[int] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return len(self.qo_lens)


def _kitchen_sink_params(rng, dims):
    return {"kvw": rng.uniform(0.5, 1.5, dims.hkv), "gate": rng.standard_normal(dims.hq),
            "shift": -4}


def _kitchen_sink_logits(s, qp, kp, b, h, kv_len, P):
    # clamp to [-5, 5], divide by temp = sqrt(2), add softplus(2^-|s|)
    return np.clip(s, -5, 5) / math.sqrt(2) + np.log1p(np.exp(2.0 ** -np.abs(s)))


def _kitchen_sink_mask(qp, kp, b, P):
    third = 64 // 3  # 21, a const folded with C division
    return ((c_mod(qp - kp, 7) != 3) & (kp >= -1 - P["shift"] - third // 21)) | (kp == 0)


def _kitchen_sink_output(o, qp, b, h, P):
    odd = np.arange(o.shape[-1]) % 2 == 1
    return o / (1 + math.exp(-P["gate"][h])) + np.where(odd, 0.01 * o.mean(), 0.0)


def _take(table, *index):
    """table[index], 0 (false) where any index is outside its axis."""
    index = np.broadcast_arrays(*(np.asarray(i) for i in index))
    inside = np.ones(index[0].shape, bool)
    for i, n in zip(index, table.shape, strict=True):
        inside &= (i >= 0) & (i < n)
    return np.where(inside, table[tuple(np.where(inside, i, 0) for i in index)], 0)


def _t5_bucket(qp, kp):
    """T5's unidirectional bucket (transformers' _relative_position_bucket), vectorised."""
    rp = np.maximum(qp - kp, 0)
    with np.errstate(divide="ignore"):
        large = 16 + (np.log(rp / 16) / math.log(8) * 16)
    large = np.minimum(np.where(rp < 16, 0, large).astype(np.int64), 31)
    return np.where(rp < 16, rp, large)


_erf = np.vectorize(math.erf)


def _natten(qp, kp):
    def pixel(i):
        t, inside = np.divmod(i, 64)
        return (t // 8) * 8 + inside // 8, (t % 8) * 8 + inside % 8
    (qy, qx), (ky, kx) = pixel(qp), pixel(kp)
    y0, x0 = np.clip(qy - 3, 0, 57), np.clip(qx - 3, 0, 57)
    return (ky >= y0) & (ky < y0 + 7) & (kx >= x0) & (kx < x0 + 7)


def _tables_logits(s, qp, kp, b, h, n, P):
    rel = qp - kp
    return s + _take(P["bias"][h], rel // 8, qp % 4) + 0.1 * _erf(s)


def _tables_mask(qp, qr, kp, b, P):
    near = (kp ^ qp) < 24
    keep = _take(P["keep"][b], kp).astype(bool)
    return ((keep | near) & (int(qp * 0.5) >= kp // 2 - 3 - qr) & ~(kp * 2 == -2)
            & ~np.isin(kp, [2, 7, 12]) & (qp - kp > -70))


PAPERS: dict[str, Paper] = {
    "causal": Paper(mask=lambda qp, kp, b, P: causal(qp, kp)),
    "mla": Paper(mask=lambda qp, kp, b, P: causal(qp, kp)),  # at its own head dims: test_ports
    "full": Paper(),
    "sliding_window": Paper(mask=lambda qp, kp, b, P: causal(qp, kp) & (qp - kp < 4096)),
    "softcap": Paper(
        params=lambda rng, dims: {"cap": 2.5},
        logits=lambda s, qp, kp, b, h, n, P: P["cap"] * np.tanh(s / P["cap"]),
        mask=lambda qp, kp, b, P: causal(qp, kp),
    ),
    "gemma2_local": Paper(
        params=lambda rng, dims: {"cap": 3.0},
        logits=lambda s, qp, kp, b, h, n, P: P["cap"] * np.tanh(s / P["cap"]),
        mask=lambda qp, kp, b, P: causal(qp, kp) & (qp - kp < 4096),
    ),
    # Press et al.: head h (1-based) gets slope 2^(-8h/H); bias -m * distance.
    "alibi": Paper(
        params=lambda rng, dims: {"slopes": 2.0 ** (-8.0 * np.arange(1, dims.hq + 1) / dims.hq)},
        logits=lambda s, qp, kp, b, h, n, P: s - P["slopes"][h] * (qp - kp),
        mask=lambda qp, kp, b, P: causal(qp, kp),
    ),
    "flash_sigmoid": Paper(
        params=lambda rng, dims: {"bias": -1.5},
        logits=lambda s, qp, kp, b, h, n, P: 1 / (1 + np.exp(-(s + P["bias"]))),
        mask=lambda qp, kp, b, P: causal(qp, kp),
        softmax=False,
    ),
    "streaming_llm": Paper(
        params=lambda rng, dims: {"theta": 5000.0},
        query=lambda x, qp, b, h, P: rope_half(x, qp, P["theta"]),
        key=lambda x, kp, b, kvh, P: rope_half(x, kp, P["theta"]),
        mask=lambda qp, kp, b, P: causal(qp, kp) & ((kp < 4) | (qp - kp < 1024)),
    ),
    "qk_norm": Paper(
        params=lambda rng, dims: {"wq": rng.uniform(0.5, 1.5, dims.d),
                                  "wk": rng.uniform(0.5, 1.5, dims.d)},
        query=lambda x, qp, b, h, P: rope_half(rms_norm(x, P["wq"], 1e-6), qp, 1e6),
        key=lambda x, kp, b, kvh, P: rope_half(rms_norm(x, P["wk"], 1e-6), kp, 1e6),
        mask=lambda qp, kp, b, P: causal(qp, kp),
    ),
    "prefix_lm": Paper(
        params=lambda rng, dims: {"prefix": np.array([rng.integers(0, n + 1)
                                                      for n in dims.kv_lens], np.int32)},
        mask=lambda qp, kp, b, P: (kp < P["prefix"][b]) | causal(qp, kp),
    ),
    # Nakanishi: scale the logits by s * log(n), n = number of keys the query sees.
    "ssmax": Paper(
        params=lambda rng, dims: {"s": 0.6},
        logits=lambda s, qp, kp, b, h, n, P: P["s"] * math.log(qp + 1) * s,
        mask=lambda qp, kp, b, P: causal(qp, kp),
    ),
    "gptj_rope": Paper(
        query=lambda x, qp, b, h, P: rope_pairs(x, qp, 1e4),
        key=lambda x, kp, b, kvh, P: rope_pairs(x, kp, 1e4),
        mask=lambda qp, kp, b, P: causal(qp, kp),
    ),
    "t5_bias": Paper(
        params=lambda rng, dims: {"bias": rng.standard_normal((dims.hq, 32))},
        logits=lambda s, qp, kp, b, h, n, P: s + P["bias"][h][_t5_bucket(qp, kp)],
        mask=lambda qp, kp, b, P: causal(qp, kp),
    ),
    "swin_bias": Paper(  # positions past the 7x7 window index outside the table: no bias
        params=lambda rng, dims: {"bias": rng.standard_normal((dims.hq, 13, 13))},
        logits=lambda s, qp, kp, b, h, n, P: s + _take(
            P["bias"][h], qp // 7 - kp // 7 + 6, qp % 7 - kp % 7 + 6),
    ),
    "longformer": Paper(
        params=lambda rng, dims: {"is_global": rng.random((dims.batch, 16384)) < 0.05},
        mask=lambda qp, kp, b, P: ((np.abs(qp - kp) <= 256) | P["is_global"][b][kp]
                                   | P["is_global"][b][qp]),
    ),
    "flamingo_xattn": Paper(
        params=lambda rng, dims: {"text_image": rng.integers(0, 3, (dims.batch, 8192)),
                                  "key_image": rng.integers(1, 3, (dims.batch, 4096))},
        row_mask=lambda qp, qr, kp, b, P: ((P["text_image"][b][qr] != 0)
                                           & (P["key_image"][b][kp] == P["text_image"][b][qr])),
    ),
    "natten_tiled": Paper(mask=lambda qp, kp, b, P: _natten(qp, kp)),
    "spec_tree": Paper(  # a random matrix per request: any per-pair mask
        params=lambda rng, dims: {"allowed": [rng.random((q, k)) < 0.6 for q, k in
                                              zip(dims.qo_lens, dims.kv_lens, strict=True)]},
        row_mask=lambda qp, qr, kp, b, P: P["allowed"][b][qr, kp],
    ),
    "sandwich": Paper(  # sum_i cos((m - n) w_i) = <p_m, p_n> of sinusoidal embeddings
        params=lambda rng, dims: {"scale": 0.7},
        logits=lambda s, qp, kp, b, h, n, P: s + P["scale"] * np.cos(
            np.multiply.outer(qp - kp, 10000.0 ** (-2 * np.arange(1, 65) / 128))).sum(-1),
        mask=lambda qp, kp, b, P: causal(qp, kp),
    ),
    "gelu_attention": Paper(
        logits=lambda s, qp, kp, b, h, n, P: 0.5 * s * (1 + _erf(s / math.sqrt(2))) / (qp + 1),
        mask=lambda qp, kp, b, P: causal(qp, kp),
        softmax=False,
    ),
    "tables": Paper(
        params=lambda rng, dims: {"bias": rng.standard_normal((dims.hq, 8, 4)),
                                  "keep": rng.random((dims.batch, 64)) < 0.3,
                                  "shift": rng.integers(-9, 9, (dims.hkv, 3))},
        key=lambda x, kp, b, kvh, P: (x * (1 + 0.01 * (P["shift"][kvh][kp % 3] & 3))[:, None]
                                      + (0.01 * np.sin(kp) * np.cos(kp >> 1))[:, None]),
        logits=_tables_logits,
        row_mask=_tables_mask,
    ),
    "kitchen_sink": Paper(
        params=_kitchen_sink_params,
        query=lambda x, qp, b, h, P: x * (1 + abs(c_mod(qp, 3))) ** 0.25 / math.sqrt(2 + 1),
        value=lambda x, kp, b, kvh, P: (
            x * P["kvw"][kvh] + 0.1 * x.max(-1, keepdims=True) - 0.05 * x.min(-1, keepdims=True)
            + 0.01 * x.sum(-1, keepdims=True) / x.shape[-1]
        ),
        logits=_kitchen_sink_logits,
        mask=_kitchen_sink_mask,
        output=_kitchen_sink_output,
    ),
    "rope_norm_window": Paper(
        params=lambda rng, dims: {"offset": rng.integers(0, 50, dims.batch), "scale": 0.7},
        query=lambda x, qp, b, h, P: rope_half(
            x / np.sqrt(np.mean(x * x) + 1e-5), qp + P["offset"][b], 500.0
        ),
        key=lambda x, kp, b, kvh, P: rope_pairs(
            x - x.mean(-1, keepdims=True), kp + P["offset"][b], 1e4
        ),
        logits=lambda s, qp, kp, b, h, n, P: P["scale"] / (1 + np.exp(-s)) / (1 + n),
        mask=lambda qp, kp, b, P: (qp - kp < 64) & causal(qp, kp),
        output=lambda o, qp, b, h, P: o * 2.0 - o.max() * 0.1,
        softmax=False,
    ),
}


def paper_attention(paper: Paper, P, q, k, v, qo_indptr, kv_indptr, sm_scale):
    """LANGUAGE.md section 6 one request, head and query row at a time, float64."""
    total_q, hq, d = q.shape
    group = hq // k.shape[1]
    o = np.zeros((total_q, hq, d))
    lse = np.full((total_q, hq), -np.inf)
    for b in range(len(qo_indptr) - 1):
        rows = range(qo_indptr[b], qo_indptr[b + 1])
        kb, vb = k[kv_indptr[b]:kv_indptr[b + 1]], v[kv_indptr[b]:kv_indptr[b + 1]]
        kv_len = len(kb)
        kv_pos = np.arange(kv_len)
        for h in range(hq):
            kvh = h // group
            keys = paper.key(kb[:, kvh], kv_pos, b, kvh, P)
            values = paper.value(vb[:, kvh], kv_pos, b, kvh, P)
            for i, row in enumerate(rows):
                q_pos = kv_len - len(rows) + i
                qv = paper.query(q[row, h], q_pos, b, h, P)
                s = paper.logits(sm_scale * (keys @ qv), q_pos, kv_pos, b, h, kv_len, P)
                seen = (paper.mask(q_pos, kv_pos, b, P) if paper.row_mask is None
                        else paper.row_mask(q_pos, i, kv_pos, b, P))
                seen = np.broadcast_to(seen, (kv_len,))
                oi = np.zeros(d)
                if paper.softmax and seen.any():
                    top = s[seen].max()
                    w = np.exp(s[seen] - top)
                    oi = w @ values[seen] / w.sum()
                    lse[row, h] = top + math.log(w.sum())
                elif not paper.softmax:
                    oi = s[seen] @ values[seen]
                o[row, h] = paper.output(oi, q_pos, b, h, P)
    return o, (lse if paper.softmax else None)


def ragged_batch(rng, hq, hkv, d, lens):
    """Random q, k, v for requests of (qo_len, kv_len); returns (q, k, v, qo_ip, kv_ip, dims)."""
    qo_lens = [a for a, _ in lens]
    kv_lens = [b for _, b in lens]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = rng.standard_normal((qo_indptr[-1], hq, d))
    k = rng.standard_normal((kv_indptr[-1], hkv, d))
    v = rng.standard_normal((kv_indptr[-1], hkv, d))
    return q, k, v, qo_indptr, kv_indptr, Dims(hq, hkv, d, qo_lens, kv_lens)


def random_lens(rng, batch=4, max_qo=9, max_extra_kv=80):
    """Ragged requests with qo_len <= kv_len: a decode row, a pure prefill, and random ones."""
    lens = [(1, int(rng.integers(1, max_extra_kv))), (6, 6)]
    for _ in range(batch - 2):
        qo = int(rng.integers(1, max_qo + 1))
        lens.append((qo, qo + int(rng.integers(0, max_extra_kv))))
    return lens


HEADS = [pytest.param(8, 2, id="gqa4"), pytest.param(4, 4, id="mha")]


# ----------------------------------------------------------------------------------------
# Every variant against its paper.
# ----------------------------------------------------------------------------------------


def test_every_variant_file_has_a_paper_definition():
    assert sorted(VARIANT_IDS) == sorted(PAPERS)


@pytest.mark.parametrize("hq, hkv", HEADS)
@pytest.mark.parametrize("path", VARIANT_FILES, ids=VARIANT_IDS)
def test_variant_matches_paper(path, hq, hkv):
    rng = np.random.default_rng(zlib.crc32(f"{path.stem}-{hq}".encode()))
    v = al.load(path)
    paper = PAPERS[path.stem]
    q, k, vv, qo_ip, kv_ip, dims = ragged_batch(rng, hq, hkv, 16, random_lens(rng))
    params = paper.params(rng, dims)
    o, lse = attention(v, q, k, vv, qo_ip, kv_ip, params=params)
    ref_o, ref_lse = paper_attention(paper, params, q, k, vv, qo_ip, kv_ip, 1 / math.sqrt(16))
    assert o.dtype == np.float64 and o.shape == q.shape
    np.testing.assert_allclose(o, ref_o, rtol=RTOL, atol=1e-13)
    if v.softmax:
        assert lse.dtype == np.float64 and lse.shape == q.shape[:2]
        np.testing.assert_allclose(lse, ref_lse, rtol=RTOL, atol=1e-13)
    else:
        assert lse is None


@pytest.mark.parametrize("name", ["sliding_window", "gemma2_local", "streaming_llm"])
def test_long_windows_match_paper(name):
    """Sequences past the real windows (4096, 1024) and sinks, with the files' own consts."""
    rng = np.random.default_rng(7)
    v, paper = load(name), PAPERS[name]
    q, k, vv, qo_ip, kv_ip, dims = ragged_batch(rng, 4, 1, 8, [(3, 4200), (1, 4097), (2, 1100)])
    params = paper.params(rng, dims)
    o, lse = attention(v, q, k, vv, qo_ip, kv_ip, params=params, sm_scale=0.9)
    ref_o, ref_lse = paper_attention(paper, params, q, k, vv, qo_ip, kv_ip, 0.9)
    np.testing.assert_allclose(o, ref_o, rtol=RTOL, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=RTOL, atol=1e-13)


def test_short_window_from_source():
    """The sliding-window mask with a window shorter than the requests."""
    text = (ROOT / "examples" / "sliding_window.attn").read_text().replace("4096", "5")
    v = al.parse(text, filename="sliding_window_5.attn")
    paper = Paper(mask=lambda qp, kp, b, P: causal(qp, kp) & (qp - kp < 5))
    rng = np.random.default_rng(3)
    q, k, vv, qo_ip, kv_ip, _ = ragged_batch(rng, 8, 2, 16, random_lens(rng, max_extra_kv=20))
    o, lse = attention(v, q, k, vv, qo_ip, kv_ip)
    ref_o, ref_lse = paper_attention(paper, {}, q, k, vv, qo_ip, kv_ip, 0.25)
    np.testing.assert_allclose(o, ref_o, rtol=RTOL, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=RTOL, atol=1e-13)


def test_defaults_sm_scale_and_input_dtypes():
    """Param defaults apply, sm_scale is honoured, and any real input dtype is accepted."""
    rng = np.random.default_rng(11)
    v = load("softcap")
    q, k, vv, qo_ip, kv_ip, _ = ragged_batch(rng, 4, 2, 8, [(2, 5), (3, 3)])
    q16, k_int = q.astype(np.float16), np.round(4 * k).astype(np.int8)
    o, lse = attention(v, q16, k_int, vv, qo_ip, kv_ip, sm_scale=0.3)
    paper = Paper(logits=lambda s, *_: 30.0 * np.tanh(s / 30.0),
                  mask=lambda qp, kp, b, P: causal(qp, kp))
    ref_o, ref_lse = paper_attention(paper, {}, q16.astype(np.float64), k_int.astype(np.float64),
                                     vv, qo_ip, kv_ip, 0.3)
    np.testing.assert_allclose(o, ref_o, rtol=RTOL, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=RTOL, atol=1e-13)


def test_single_request_without_indptrs():
    rng = np.random.default_rng(5)
    v = load("causal")
    q, k, vv, qo_ip, kv_ip, _ = ragged_batch(rng, 4, 2, 8, [(3, 7)])
    o, lse = attention(v, q, k, vv)
    o2, lse2 = attention(v, q, k, vv, qo_ip, kv_ip)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)


@pytest.mark.parametrize("path", VARIANT_FILES, ids=VARIANT_IDS)
def test_float32_mode_within_1e5_of_float64(path):
    rng = np.random.default_rng(21)
    v = al.load(path)
    q, k, vv, qo_ip, kv_ip, dims = ragged_batch(rng, 8, 2, 16, random_lens(rng))
    params = PAPERS[path.stem].params(rng, dims)
    o64, lse64 = attention(v, q, k, vv, qo_ip, kv_ip, params=params)
    o32, lse32 = attention(v, q, k, vv, qo_ip, kv_ip, params=params, precision="float32")
    assert o32.dtype == np.float32
    np.testing.assert_allclose(o32, o64, rtol=1e-5, atol=1e-5)
    if v.softmax:
        assert lse32.dtype == np.float32
        np.testing.assert_allclose(lse32, lse64, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Fully masked rows.
# ----------------------------------------------------------------------------------------


def test_fully_masked_rows_give_zero_and_minus_inf_without_warnings():
    rng = np.random.default_rng(13)
    # Request 0 has more queries than keys: q_pos = -3..1, so its first 3 rows see nothing
    # under a causal mask; request 1 has no keys at all.
    q, k, vv, qo_ip, kv_ip, _ = ragged_batch(rng, 4, 2, 8, [(5, 2), (2, 0), (3, 4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, lse = attention(load("causal"), q, k, vv, qo_ip, kv_ip)
        o_sig, lse_sig = attention(load("flash_sigmoid"), q, k, vv, qo_ip, kv_ip)
        o32, lse32 = attention(load("causal"), q, k, vv, qo_ip, kv_ip, precision="float32")
    dead = [0, 1, 2, 5, 6]
    for out, out_lse in ((o, lse), (o32, lse32)):
        assert not np.isnan(out).any() and not np.isnan(out_lse).any()
        assert np.all(out[dead] == 0) and np.all(out_lse[dead] == -np.inf)
        assert np.all(np.isfinite(np.delete(out_lse, dead, axis=0)))
    assert lse_sig is None
    assert np.all(o_sig[dead] == 0) and not np.isnan(o_sig).any()
    ref_o, _ = paper_attention(PAPERS["causal"], {}, q, k, vv, qo_ip, kv_ip, 1 / math.sqrt(8))
    np.testing.assert_allclose(o, ref_o, rtol=RTOL, atol=1e-13)


def test_output_stage_runs_on_fully_masked_rows():
    """o = 0 before the output stage: `output = o + 1` gives 1 on a row that sees nothing."""
    v = ir.Variant("never", mask=ir.Const(False, B),
                   output=ir.Binary("+", ir.Var("o", F), ir.Const(1.0, F), F))
    rng = np.random.default_rng(17)
    q, k, vv, _, _, _ = ragged_batch(rng, 2, 1, 4, [(3, 6)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, lse = attention(v, q, k, vv)
    assert np.all(o == 1.0) and np.all(lse == -np.inf)


# ----------------------------------------------------------------------------------------
# Hand-built IR: the builtin table, C integer semantics, reductions.
# ----------------------------------------------------------------------------------------

LOGITS = ir.Var("logits", F)


def call(fn: str, *args: ir.Expr, t: ir.Type = F) -> ir.Call:
    return ir.Call(fn, tuple(args), t)


def fc(x: float) -> ir.Const:
    return ir.Const(float(x), F)


ABS = call("abs", LOGITS)
# name -> (logits stage as IR, the same function of one logit in plain Python math)
SCALAR_CASES = {
    "exp": (call("exp", LOGITS), math.exp),
    "exp2": (call("exp2", LOGITS), lambda x: 2.0**x),
    "log": (call("log", ABS), lambda x: math.log(abs(x))),
    "log2": (call("log2", ABS), lambda x: math.log2(abs(x))),
    "sqrt": (call("sqrt", ABS), lambda x: math.sqrt(abs(x))),
    "rsqrt": (call("rsqrt", ABS), lambda x: 1 / math.sqrt(abs(x))),
    "tanh": (call("tanh", LOGITS), math.tanh),
    "sigmoid": (call("sigmoid", LOGITS), lambda x: 1 / (1 + math.exp(-x))),
    "abs": (ABS, abs),
    "floor": (call("floor", LOGITS), math.floor),
    "ceil": (call("ceil", LOGITS), math.ceil),
    "softplus": (call("softplus", LOGITS), lambda x: math.log1p(math.exp(x))),
    "min": (call("min", LOGITS, fc(0.3)), lambda x: min(x, 0.3)),
    "max": (call("max", LOGITS, fc(0.3)), lambda x: max(x, 0.3)),
    "pow": (call("pow", ABS, fc(1.7)), lambda x: abs(x) ** 1.7),
    "clamp": (call("clamp", LOGITS, fc(-1), fc(2)), lambda x: min(max(x, -1), 2)),
    "where": (call("where", ir.Binary(">", LOGITS, fc(0), B), LOGITS, fc(-2)),
              lambda x: x if x > 0 else -2.0),
    "neg": (ir.Unary("-", LOGITS, F), lambda x: -x),
    "pow_op": (ir.Binary("**", ABS, fc(1.5), F), lambda x: abs(x) ** 1.5),
    "div": (ir.Binary("/", LOGITS, fc(3), F), lambda x: x / 3),
    "fmod": (ir.Binary("%", LOGITS, fc(0.7), F), lambda x: math.fmod(x, 0.7)),
    "not": (call("where", ir.Unary("not", ir.Binary("<", LOGITS, fc(0), B), B), fc(1), fc(0)),
            lambda x: float(not x < 0)),
}


@pytest.mark.parametrize("name", SCALAR_CASES)
def test_scalar_builtin(name):
    expr, fn = SCALAR_CASES[name]
    v = ir.Variant(name, logits=expr, softmax=False)
    rng = np.random.default_rng(29)
    q, k, vv, qo_ip, kv_ip, _ = ragged_batch(rng, 4, 2, 8, [(3, 5), (2, 7)])
    sm_scale = 10.0  # logits of order +-40: exercises the ranges where the functions bend
    o, lse = attention(v, q, k, vv, qo_ip, kv_ip, sm_scale=sm_scale)
    paper = Paper(logits=lambda s, *_: np.array([fn(x) for x in s]), softmax=False)
    ref_o, _ = paper_attention(paper, {}, q, k, vv, qo_ip, kv_ip, sm_scale)
    assert lse is None
    np.testing.assert_allclose(o, ref_o, rtol=RTOL, atol=1e-12)


def test_softplus_and_sigmoid_are_stable_for_huge_logits():
    for fn, exact in (("softplus", lambda x: max(x, 0.0) + math.log1p(math.exp(-abs(x)))),
                      ("sigmoid", lambda x: 0.5 * (1 + math.tanh(x / 2)))):
        v = ir.Variant(fn, logits=call(fn, LOGITS), softmax=False)
        rng = np.random.default_rng(31)
        q, k, vv, _, _, _ = ragged_batch(rng, 2, 1, 8, [(3, 6)])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            o, _ = attention(v, q, k, vv, sm_scale=1000.0)
        paper = Paper(logits=lambda s, *_, f=exact: np.array([f(x) for x in s]), softmax=False)
        ref_o, _ = paper_attention(paper, {}, q, k, vv, [0, 3], [0, 6], 1000.0)
        np.testing.assert_allclose(o, ref_o, rtol=RTOL, atol=1e-12)


def _int_output(op: str) -> ir.Variant:
    """output = float((dim - 8) OP (q_pos - 3)): int arithmetic on negative operands."""
    a = ir.Binary("-", ir.Var("dim", INT), ir.Const(8, INT), INT)
    b = ir.Binary("-", ir.Var("q_pos", INT), ir.Const(3, INT), INT)
    return ir.Variant(f"int_{op}", output=ir.Cast(ir.Binary(op, a, b, INT)))


@pytest.mark.parametrize("op, expect", [
    ("/", lambda a, b: math.trunc(a / b) if b else 0),   # C: toward zero; x / 0 -> 0
    ("%", lambda a, b: int(math.fmod(a, b)) if b else 0),  # C: sign of the dividend
])
def test_int_division_and_modulo_follow_c(op, expect):
    rng = np.random.default_rng(37)
    q, k, vv, _, _, _ = ragged_batch(rng, 2, 1, 16, [(7, 7)])  # q_pos 0..6, dim 0..15
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, _ = attention(_int_output(op), q, k, vv)
    want = np.array([[expect(d - 8, i - 3) for d in range(16)] for i in range(7)], float)
    np.testing.assert_array_equal(o, np.broadcast_to(want[:, None, :], o.shape))
    if op == "/":
        assert o[0, 0, 1] == 2 and o[6, 0, 1] == -2  # -7 / -3 == 2, -7 / 3 == -2
    else:
        assert o[0, 0, 1] == -1 and o[6, 0, 15] == 1  # -7 % -3 == -1, 7 % 3 == 1


def test_float_modulo_is_fmod():
    v = ir.Variant("fmod", output=ir.Binary(
        "%", ir.Cast(ir.Binary("-", ir.Var("dim", INT), ir.Const(8, INT), INT)), fc(2.5), F))
    rng = np.random.default_rng(41)
    q, k, vv, _, _, _ = ragged_batch(rng, 2, 1, 16, [(2, 2)])
    o, _ = attention(v, q, k, vv)
    np.testing.assert_array_equal(o[0, 0], [math.fmod(d - 8, 2.5) for d in range(16)])


REDUCTIONS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


@pytest.mark.parametrize("op", REDUCTIONS)
def test_reductions_over_dim(op):
    """query = q - op(q * q) (vector stage) and output = o * op(o): both reduce over dim."""
    o_var, q_var = ir.Var("o", F), ir.Var("q", F)
    v = ir.Variant(
        f"reduce_{op}",
        query=ir.Binary("-", q_var, ir.Reduce(op, ir.Binary("*", q_var, q_var, F)), F),
        output=ir.Binary("*", o_var, ir.Reduce(op, o_var), F),
        mask=ir.Binary("<=", ir.Var("kv_pos", INT), ir.Var("q_pos", INT), B),
    )
    red = REDUCTIONS[op]
    paper = Paper(
        query=lambda x, *_: x - red(x * x),
        mask=lambda qp, kp, b, P: causal(qp, kp),
        output=lambda o, *_: o * red(o),
    )
    rng = np.random.default_rng(43)
    q, k, vv, qo_ip, kv_ip, _ = ragged_batch(rng, 8, 2, 16, [(3, 9), (4, 4)])
    o, lse = attention(v, q, k, vv, qo_ip, kv_ip)
    ref_o, ref_lse = paper_attention(paper, {}, q, k, vv, qo_ip, kv_ip, 0.25)
    np.testing.assert_allclose(o, ref_o, rtol=RTOL, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=RTOL, atol=1e-13)


def test_index_variables():
    """head, kv_head, batch, qo_len, kv_len and the kernel-wide names in the output stage."""
    terms = [("head", 1.0), ("kv_head", 10.0), ("batch", 100.0), ("qo_len", 1e3),
             ("kv_len", 1e4), ("num_heads", 1e5), ("num_kv_heads", 1e6), ("head_dim", 1e7)]
    expr: ir.Expr = ir.Binary("*", ir.Var("sm_scale", F), fc(1e8), F)
    for name, weight in terms:
        expr = ir.Binary("+", expr, ir.Binary("*", ir.Cast(ir.Var(name, INT)), fc(weight), F), F)
    v = ir.Variant("indices", output=expr)
    rng = np.random.default_rng(47)
    q, k, vv, qo_ip, kv_ip, _ = ragged_batch(rng, 6, 2, 4, [(1, 3), (2, 5)])
    o, _ = attention(v, q, k, vv, qo_ip, kv_ip, sm_scale=0.5)
    for b, (qs, qe) in enumerate([(0, 1), (1, 3)]):
        for h in range(6):
            want = (h + 10 * (h // 3) + 100 * b + 1e3 * (qe - qs) + 1e4 * (kv_ip[b + 1] - kv_ip[b])
                    + 1e5 * 6 + 1e6 * 2 + 1e7 * 4 + 0.5e8)
            assert np.all(o[qs:qe, h] == want)


# ----------------------------------------------------------------------------------------
# Run-time validation.
# ----------------------------------------------------------------------------------------


@pytest.fixture
def small():
    rng = np.random.default_rng(53)
    return ragged_batch(rng, 4, 2, 8, [(2, 3), (1, 4)])


def test_missing_param_without_default(small):
    q, k, vv, qo_ip, kv_ip, _ = small
    with pytest.raises(ValueError, match="missing 'slopes'"):
        attention(load("alibi"), q, k, vv, qo_ip, kv_ip)
    attention(load("softcap"), q, k, vv, qo_ip, kv_ip)  # cap has a default


def test_unknown_param_suggests_a_name(small):
    q, k, vv, qo_ip, kv_ip, _ = small
    with pytest.raises(ValueError, match="no param 'cpa'.*did you mean 'cap'"):
        attention(load("softcap"), q, k, vv, qo_ip, kv_ip, params={"cpa": 20.0})


@pytest.mark.parametrize("name, params, pattern", [
    ("alibi", {"slopes": np.ones(5)}, r"slopes.*shape \(4,\).*heads = 4"),
    ("alibi", {"slopes": np.ones((4, 1))}, r"slopes.*shape \(4,\)"),
    ("qk_norm", {"wq": np.ones(7), "wk": np.ones(8)}, r"wq.*shape \(8,\).*dim = 8"),
    ("prefix_lm", {"prefix": np.array([1, 2, 3])}, r"prefix.*shape \(2,\).*batch = 2"),
    ("kitchen_sink", {"kvw": np.ones(4), "gate": np.ones(4)}, r"kvw.*kv_heads = 2"),
    ("softcap", {"cap": np.ones(2)}, r"cap.*scalar"),
])
def test_tensor_param_extent(small, name, params, pattern):
    q, k, vv, qo_ip, kv_ip, _ = small
    with pytest.raises(ValueError, match=pattern):
        attention(load(name), q, k, vv, qo_ip, kv_ip, params=params)


def test_param_types(small):
    q, k, vv, qo_ip, kv_ip, _ = small
    with pytest.raises(TypeError, match="prefix.*integer"):
        attention(load("prefix_lm"), q, k, vv, qo_ip, kv_ip, params={"prefix": [0.5, 1.0]})
    with pytest.raises(TypeError, match="shift.*integer"):
        attention(load("kitchen_sink"), q, k, vv, qo_ip, kv_ip,
                  params={"kvw": [1, 1], "gate": [0, 0, 0, 0], "shift": 1.5})
    with pytest.raises(TypeError, match="params"):
        attention(load("softcap"), q, k, vv, qo_ip, kv_ip, params=[("cap", 1.0)])


def test_shape_and_indptr_errors(small):
    q, k, vv, qo_ip, kv_ip, _ = small
    v = load("causal")
    with pytest.raises(ValueError, match=r"num_heads \(4\).*num_kv_heads \(3\b"):
        attention(v, q, np.ones((7, 3, 8)), np.ones((7, 3, 8)), qo_ip, kv_ip)
    with pytest.raises(ValueError, match="k: head dim"):
        attention(v, q, k[..., :4], vv[..., :4], qo_ip, kv_ip)
    with pytest.raises(ValueError, match="vv: shape"):
        attention(v, q, k, vv[:-1], qo_ip, kv_ip)
    with pytest.raises(ValueError, match="q: expected 3 dimensions"):
        attention(v, q[0], k, vv, qo_ip, kv_ip)
    with pytest.raises(TypeError, match="q: expected an array of real numbers"):
        attention(v, q.astype(complex), k, vv, qo_ip, kv_ip)
    with pytest.raises(ValueError, match="qo_indptr: must be non-decreasing"):
        attention(v, q, k, vv, [0, 3, 2, 3], [0, 3, 5, 7])
    with pytest.raises(ValueError, match="kv_indptr: ends at 6 but k has 7 rows"):
        attention(v, q, k, vv, qo_ip, [0, 3, 6])
    with pytest.raises(ValueError, match="kv_indptr: must start at 0"):
        attention(v, q, k, vv, qo_ip, [1, 3, 7])
    with pytest.raises(TypeError, match="qo_indptr: expected an integer array"):
        attention(v, q, k, vv, [0.0, 2.0, 3.0], kv_ip)
    with pytest.raises(ValueError, match="different batch sizes"):
        attention(v, q, k, vv, [0, 1, 2, 3], kv_ip)
    with pytest.raises(ValueError, match="qo_indptr: None means a single request"):
        attention(v, q, k, vv, None, kv_ip)
    with pytest.raises(ValueError, match="precision"):
        attention(v, q, k, vv, qo_ip, kv_ip, precision="bfloat16")
    with pytest.raises(ValueError, match="rope needs an even head dim"):
        attention(load("gptj_rope"), q[..., :7], k[..., :7], vv[..., :7], qo_ip, kv_ip)
    with pytest.raises(TypeError, match="sm_scale"):
        attention(v, q, k, vv, qo_ip, kv_ip, sm_scale=np.ones(2))


# ----------------------------------------------------------------------------------------
# The paged wrapper.
# ----------------------------------------------------------------------------------------


def to_pages(rng, k, v, kv_indptr, page_size, spare_pages=3):
    """Scatter each request's KV into shuffled pages of a cache whose unused slots hold
    random junk; returns (k_cache, v_cache, page_indptr, kv_indices, kv_last_page_len)."""
    kv_lens = np.diff(kv_indptr)
    n_pages = [-(-int(n) // page_size) for n in kv_lens]
    total = sum(n_pages) + spare_pages
    _, hkv, d = k.shape
    k_cache = rng.standard_normal((total, page_size, hkv, d)) * 100
    v_cache = rng.standard_normal((total, page_size, hkv, d)) * 100
    order = rng.permutation(total)[: sum(n_pages)]
    page_indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    for b, n in enumerate(kv_lens):
        for t in range(n):
            page = order[page_indptr[b] + t // page_size]
            k_cache[page, t % page_size] = k[kv_indptr[b] + t]
            v_cache[page, t % page_size] = v[kv_indptr[b] + t]
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, n_pages, strict=True)]
    return k_cache, v_cache, page_indptr, order.astype(np.int32), np.array(last, np.int32)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_equals_ragged(page_size):
    rng = np.random.default_rng(59 + page_size)
    v = load("streaming_llm")  # rope on kv_pos: page order must be the logical order
    lens = random_lens(rng, batch=5, max_extra_kv=40) + [(2, 0)]
    q, k, vv, qo_ip, kv_ip, _ = ragged_batch(rng, 8, 2, 16, lens)
    kc, vc, page_ip, pages, last = to_pages(rng, k, vv, kv_ip, page_size)
    o, lse = attention_paged(v, q, kc, vc, qo_ip, page_ip, pages, last)
    ref_o, ref_lse = attention(v, q, k, vv, qo_ip, kv_ip)
    np.testing.assert_allclose(o, ref_o, rtol=1e-13, atol=1e-14)
    np.testing.assert_array_equal(lse == -np.inf, ref_lse == -np.inf)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13, atol=1e-14)


def test_paged_validation():
    rng = np.random.default_rng(61)
    v = load("causal")
    q, k, vv, qo_ip, kv_ip, _ = ragged_batch(rng, 4, 2, 8, [(2, 5), (1, 3)])
    kc, vc, page_ip, pages, last = to_pages(rng, k, vv, kv_ip, 2, spare_pages=0)
    bad = pages.copy()
    bad[1] = len(kc)
    with pytest.raises(ValueError, match=r"kv_indices: page index 5 .*out of range \[0, 5\)"):
        attention_paged(v, q, kc, vc, qo_ip, page_ip, bad, last)
    with pytest.raises(ValueError, match="kv_last_page_len: request 1"):
        attention_paged(v, q, kc, vc, qo_ip, page_ip, pages, [1, 3])
    with pytest.raises(ValueError, match="kv_last_page_len: expected shape"):
        attention_paged(v, q, kc, vc, qo_ip, page_ip, pages, [1])
    with pytest.raises(ValueError, match="kv_indptr: ends at"):
        attention_paged(v, q, kc, vc, qo_ip, page_ip, pages[:-1], last)
    with pytest.raises(ValueError, match="v_cache: shape"):
        attention_paged(v, q, kc, vc[:, :1], qo_ip, page_ip, pages, last)


@pytest.mark.parametrize("name", ["kitchen_sink", "rope_norm_window", "qk_norm"])
def test_row_chunking_changes_nothing(monkeypatch, name):
    """Long requests are evaluated in chunks of query rows; the result must not move."""
    from attnlang import reference

    rng = np.random.default_rng(67)
    v, paper = load(name), PAPERS[name]
    q, k, vv, qo_ip, kv_ip, dims = ragged_batch(rng, 8, 2, 16, [(9, 30), (1, 5), (13, 13)])
    params = paper.params(rng, dims)
    whole = attention(v, q, k, vv, qo_ip, kv_ip, params=params)
    monkeypatch.setattr(reference, "_GRID_ELEMENTS", 8 * 30 * 2)  # two rows at a time
    chunked = attention(v, q, k, vv, qo_ip, kv_ip, params=params)
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-13, atol=1e-14)
    if v.softmax:
        np.testing.assert_allclose(chunked[1], whole[1], rtol=1e-13, atol=1e-14)
