"""Run the soft-capping variant on a GPU over a ragged batch with a paged KV cache, and
check it against the NumPy reference.

    python examples/run_softcap.py            # needs a CUDA GPU and `pip install ".[cuda12]"`

Three requests: a decode step (1 query over 1000 cached tokens), a prefill of 300 tokens,
and a chunked prefill (64 new queries over 700 tokens). fp16 so that CuPy holds the data
natively (bf16 works the same through PyTorch tensors).
"""

from pathlib import Path

import cupy as cp
import numpy as np

import attnlang as al
from attnlang.runtime.paged import indptr_from_lengths, ragged_to_paged

HERE = Path(__file__).parent
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16


def main():
    variant = al.load(HERE / "softcap.attn")
    rng = np.random.default_rng(0)
    qo_lens, kv_lens = [1, 300, 64], [1000, 300, 700]
    qo_indptr, kv_token_indptr = indptr_from_lengths(qo_lens), indptr_from_lengths(kv_lens)
    q = rng.standard_normal((sum(qo_lens), NUM_QO_HEADS, HEAD_DIM)).astype(np.float16)
    k = rng.standard_normal((sum(kv_lens), NUM_KV_HEADS, HEAD_DIM)).astype(np.float16)
    v = rng.standard_normal((sum(kv_lens), NUM_KV_HEADS, HEAD_DIM)).astype(np.float16)
    k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len = ragged_to_paged(
        k, v, kv_token_indptr, PAGE_SIZE, rng=rng)

    attn = al.BatchAttention(variant, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS,
                             head_dim=HEAD_DIM, dtype="float16", page_size=PAGE_SIZE)
    attn.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)   # CPU: builds the work list
    out, lse = attn.run(cp.asarray(q), (cp.asarray(k_cache), cp.asarray(v_cache)),
                        params={"cap": 20.0}, return_lse=True)

    ref_o, ref_lse = al.reference.attention(variant, q, k, v, qo_indptr, kv_token_indptr,
                                            params={"cap": 20.0})
    out = cp.asnumpy(out).astype(np.float64)
    err = np.linalg.norm(out - ref_o) / np.linalg.norm(ref_o)
    lse_err = np.abs(cp.asnumpy(lse) - ref_lse).max()
    print(f"{variant.name}: out {out.shape}, relative L2 error {err:.2e}, "
          f"max |lse error| {lse_err:.2e}")
    assert err < 2e-3, "fp16 tolerance of LANGUAGE.md section 7 exceeded"


if __name__ == "__main__":
    main()
