"""The transformers backend's layout (CPU): transformers' dense [B, H, S, D] tensors and padding
mask, laid out for BatchAttention (`dense_inputs`), give through the NumPy reference exactly
what a float64 eager attention gives (causal on absolute positions, pads masked)."""

import math

import numpy as np
import pytest

import attnlang
from attnlang import reference

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from attnlang.integrations import transformers as alt  # noqa: E402
from attnlang.integrations.dense_layout import dense_plan, key_pages  # noqa: E402

CAUSAL = attnlang.parse("variant c\nmask = causal")
WINDOW_SOFTCAP = attnlang.parse(
    "variant w\nconst window: int = 5\nconst cap: float = 2.0\n"
    "logits = cap * tanh(logits / cap)\nmask = causal and q_pos - kv_pos < window")
ALIBI_HEADS = attnlang.parse(  # reads `head`: must take the token-major layout
    "variant a\nlogits = logits - 0.25 * (head + 1) * (q_pos - kv_pos)\nmask = causal")


def eager(query, key, value, pad, scale, window=None, cap=None, slope=None):
    """float64 attention the way transformers' eager path masks it: absolute positions,
    query i at key position Sk - Sq + i, padded keys removed."""
    b, hq, sq, d = query.shape
    hkv, sk = key.shape[1], key.shape[2]
    k = key.repeat_interleave(hq // hkv, dim=1)
    v = value.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", query, k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    qpos = torch.arange(sk - sq, sk)[:, None]
    kpos = torch.arange(sk)[None, :]
    if slope is not None:
        s = s - slope[None, :, None, None] * (qpos - kpos)
    allowed = kpos <= qpos
    if window is not None:
        allowed = allowed & (qpos - kpos < window)
    allowed = allowed[None, None] & pad[:, None, None, :]
    s = s.masked_fill(~allowed, -math.inf)
    return torch.einsum("bhqk,bhkd->bqhd", torch.softmax(s, -1), v)


def run_reference(variant, inputs, plan, scale, batch, q_len):
    o, _ = reference.attention_paged(variant, inputs.q.numpy(), inputs.k_cache.numpy(),
                                     inputs.v_cache.numpy(), plan.qo_indptr, plan.kv_indptr,
                                     plan.kv_indices, plan.kv_last_page_len, sm_scale=scale)
    return inputs.output(torch.from_numpy(o), batch, q_len)


CASES = {  # (B, Hq, Hkv, Sq, Sk, left pads per row, right pads per row)
    "prefill-left-pad": (3, 4, 2, 9, 9, (0, 3, 8), (0, 0, 0)),
    "decode-left-pad": (3, 4, 1, 1, 12, (0, 4, 11), (0, 0, 0)),
    "chunk-with-cache": (2, 6, 2, 4, 10, (2, 0), (0, 0)),
    "prefill-right-pad": (2, 4, 4, 7, 7, (0, 0), (0, 3)),
    "no-padding": (2, 8, 2, 5, 5, (0, 0), (0, 0)),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("variant", ["causal", "window_softcap", "alibi_heads"])
@pytest.mark.parametrize("strided", [False, True], ids=["dynamic", "static-cache"])
@pytest.mark.parametrize("dv", [16, 8], ids=["d16", "v8"])  # v8: MLA-like values (8 beside 16)
def test_layout_equals_eager(case, variant, strided, dv):
    b, hq, hkv, sq, sk, left, right = CASES[case]
    d = 16
    g = torch.Generator().manual_seed(hash((case, variant, strided, dv)) % 2**31)
    query = torch.randn(b, hq, sq, d, generator=g, dtype=torch.float64)
    if strided:  # a StaticCache: [B, Hkv, max_len, D] buffers, the first Sk positions used
        big = torch.randn(b, hkv, sk + 5, d, generator=g, dtype=torch.float64)
        key = big[:, :, :sk]
        value = torch.randn(b, hkv, sk + 5, dv, generator=g, dtype=torch.float64)[:, :, :sk]
    else:
        key = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64)
        # MLA: a split view of one projection, as DeepSeek's expand_kv hands it over
        value = torch.randn(b, hkv, sk, dv + 8, generator=g, dtype=torch.float64)[..., 8:]
    pad = torch.ones(b, sk, dtype=torch.bool)
    for i, (lp, rp) in enumerate(zip(left, right, strict=True)):
        pad[i, :lp] = False
        if rp:
            pad[i, sk - rp:] = False
    mask = None if pad.all() else pad
    scale = 0.3
    v, kw = {"causal": (CAUSAL, {}),
             "window_softcap": (WINDOW_SOFTCAP, {"window": 5, "cap": 2.0}),
             "alibi_heads": (ALIBI_HEADS, {"slope": 0.25 * torch.arange(1, hq + 1,
                                                                        dtype=torch.float64)})
             }[variant]
    by_head = not alt._reads_numbering(v)
    assert by_head == (variant != "alibi_heads")
    inputs = alt.dense_inputs(query, key, value, mask, by_head=by_head)
    if by_head:  # K/V are read in place: the page views share the key's storage
        assert inputs.k_cache.data_ptr() == key.data_ptr()
    plan = inputs.make_plan()
    got = run_reference(v, inputs, plan, scale, b, sq)
    want = eager(query, key, value, pad, scale, **kw)
    real_rows = pad[:, sk - sq:]  # padded query rows: finite, not compared
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[real_rows], want[real_rows], rtol=1e-10, atol=1e-10)


def test_plan_splits_pad_rows_into_their_own_requests():
    # B=1, Sk=Sq=4, one left pad: request 0 = row 0 over key 0, request 1 = rows 1..3
    plan = dense_plan(np.array([[100]]), 4, 4, np.array([[False, True, True, True]]))
    assert plan.qo_indptr.tolist() == [0, 1, 4]
    assert plan.kv_indptr.tolist() == [0, 1, 4]
    assert plan.kv_indices.tolist() == [100, 101, 102, 103]
    assert plan.kv_last_page_len.tolist() == [1, 1]


def test_padding_inside_the_query_is_rejected():
    with pytest.raises(ValueError, match="padding between real query tokens"):
        dense_plan(np.array([[0]]), 4, 4, np.array([[True, False, True, True]]))


def test_key_pages_need_whole_tokens():
    assert key_pages((8 * 10 * 64, 10 * 64, 64, 1), 64, 2, 8)[1, 3] == 8 * 10 + 3 * 10
    with pytest.raises(ValueError, match="not whole tokens"):
        key_pages((640, 64, 1, 10), 64, 1, 1)


def test_an_all_true_mask_plans_like_no_mask():
    pages = key_pages((2 * 6 * 64, 6 * 64, 64, 1), 64, 3, 2)
    for q_len in (1, 4):
        plain = dense_plan(pages, q_len, 6, None)
        masked = dense_plan(pages, q_len, 6, np.ones((3, 6), bool))
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
            np.testing.assert_array_equal(getattr(masked, name), getattr(plain, name))
