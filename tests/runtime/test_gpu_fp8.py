"""An fp8 (e4m3) KV cache through BatchAttention(kv_dtype="fp8"), against the NumPy reference
on the dequantised values (attnlang.fp8.from_e4m3(bits) * scale of the KV head).

Every kernel and path: decode steps at head dim 128 in the tensor-core decode kernel
(decode_mma.cu.j2: groups up to 8, where the variant has no key or value hook), elsewhere MHA
in the CUDA-core decode kernel and GQA groups of 4 and 8 in the prefill kernel (wgmma with its
producer warpgroup at head dims 128 and 256 on the H100, which converts the tiles it copies by
TMA, without one at 64), prompts and chunked prefill, split requests through the merge
kernel; variants with key / value hooks
(the hooks see dequantised values), masks, logits terms; scales as floats and as per-head
device arrays, torch float8_e4m3fn tensors and CuPy uint8 bits; CUDA-graph capture; the
errors for what is not allowed.

Tolerance: the output dtype's (LANGUAGE.md section 7), as the bf16 tests.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnlang
from attnlang.fp8 import from_e4m3, to_e4m3
from attnlang.reference import attention_paged
from attnlang.runtime.arrays import round_to_dtype
from attnlang.runtime.planner import CapacityError
from tests.runtime.test_gpu_attention import (
    SHORT,
    TOLERANCE,
    VARIANT_PATHS,
    check_lse,
    from_device,
    make_batch,
    make_params,
    poisoned,
    rel_l2,
    split_params,
    to_device,
)
from tests.variant_files import ROW_HOOKS

pytestmark = pytest.mark.gpu


def quantize(rng, batch, num_kv_heads: int):
    """The batch's K and V as e4m3 bytes over a scale per KV head near amax / 448 (as a cache
    writer picks it), and the values the kernels see."""
    out = []
    for cache in (batch.k_cache, batch.v_cache):
        amax = np.abs(cache).reshape(-1, num_kv_heads, cache.shape[-1]).max(axis=(0, 2))
        scale = (amax / 448.0 * rng.uniform(1.0, 1.5, num_kv_heads)).astype(np.float32)
        bits = to_e4m3(cache / scale[None, None, :, None])
        out.append((bits, from_e4m3(bits) * scale[None, None, :, None], scale))
    return out


def run_fp8(cp, variant_id, qo, kv, *, num_qo_heads, num_kv_heads, head_dim, dtype, page_size,
            seed, error_log, where, scales="tensor", arrays="cupy", kv_chunk_size=None,
            head_dim_vo=None, expect=None, prefill_min_rows=None, q_exponent=None,
            num_prefill_ctas=None, dequantize=None):
    rng = np.random.default_rng(seed)
    variant = (attnlang.load(VARIANT_PATHS[variant_id]) if isinstance(variant_id, str)
               else variant_id)  # a parsed variant
    qo, kv = np.asarray(qo), np.asarray(kv)
    batch = make_batch(rng, qo, kv, num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                       head_dim_vo)
    sm_scale = None
    if q_exponent is not None:
        # Query rows of 2^(q_exponent - 4) .. 2^(q_exponent + 1) (exact in any dtype) and one
        # zero row, the softmax scale 2^-q_exponent / sqrt(head_dim): logits of the usual size.
        # (Rows of 4x the logits put the lse of the e4m3 matmul's scores at the tolerance's
        # edge: their accumulation keeps ~1e-3 of the score, benchmarks/NOTES.md.)
        exponents = rng.integers(q_exponent - 4, q_exponent + 2, batch.q.shape[:2])
        batch.q[...] *= 2.0 ** exponents[..., None]
        batch.q[rng.integers(len(batch.q)), rng.integers(num_qo_heads)] = 0.0
        sm_scale = 2.0 ** -q_exponent / np.sqrt(head_dim)
    (k_bits, k_seen, k_scale), (v_bits, v_seen, v_scale) = quantize(rng, batch, num_kv_heads)
    params = make_params(variant, rng, qo, kv, num_qo_heads, num_kv_heads, head_dim,
                         head_dim_vo)
    ref_o, ref_lse = attention_paged(variant, batch.q, k_seen, v_seen, *batch.table,
                                     params=params, sm_scale=sm_scale)
    extra = {}
    if kv_chunk_size is not None:
        extra = dict(max_work_items=1 << 16, max_partial_rows=1 << 18, max_merge_rows=1 << 17)
    attn = attnlang.BatchAttention(variant, num_qo_heads, num_kv_heads, head_dim, dtype=dtype,
                                   page_size=page_size, head_dim_vo=head_dim_vo, kv_dtype="fp8",
                                   max_batch_size=max(4, len(qo)),
                                   # a copy where some request may read a key 24 times
                                   max_total_q=max(16 if dequantize is None else 4096,
                                                   int(qo.sum())),
                                   max_kv_indices=max(1 << 12, len(batch.kv_indices)),
                                   prefill_min_rows=prefill_min_rows,
                                   num_prefill_ctas=num_prefill_ctas, **extra)
    plan_params, params = split_params(variant, params)
    plan = attn.plan(*batch.table, kv_chunk_size=kv_chunk_size, params=plan_params,
                     dequantize=dequantize)
    if dequantize is not None:
        assert (attn.last_dequant is not None) == (dequantize and plan.prefill.num_work_items > 0)
    if expect is not None:
        assert (plan.decode.num_work_items > 0, plan.prefill.num_work_items > 0) == expect
    q = to_device(cp, batch.q, dtype)
    if arrays == "torch":
        import torch

        kc = torch.from_dlpack(cp.asarray(k_bits)).view(torch.float8_e4m3fn)
        vc = torch.from_dlpack(cp.asarray(v_bits)).view(torch.float8_e4m3fn)
        q = torch.from_dlpack(q)
        if dtype == "bfloat16":
            q = q.view(torch.bfloat16)
        ks, vs = torch.from_dlpack(cp.asarray(k_scale)), torch.from_dlpack(cp.asarray(v_scale))
    else:
        kc, vc = cp.asarray(k_bits), cp.asarray(v_bits)
        ks, vs = cp.asarray(k_scale), cp.asarray(v_scale)
    if scales == "float":  # one scale for the tensor: the reference's per head, all alike
        ks, vs = float(k_scale[0]), float(v_scale[0])
        assert np.all(k_scale == k_scale[0]) and np.all(v_scale == v_scale[0])
    out = poisoned(cp, batch.q.shape[:2] + (v_bits.shape[3],), dtype)
    if arrays == "torch":
        out = torch.from_dlpack(out)
        if dtype == "bfloat16":
            out = out.view(torch.bfloat16)
    got, lse = attn.run(q, (kc, vc), params, out=out, return_lse=True, k_scale=ks, v_scale=vs,
                        sm_scale=sm_scale)
    if arrays == "torch":
        got = cp.from_dlpack(got.view(torch.uint16) if dtype == "bfloat16" else got)
        lse = cp.from_dlpack(lse)
    got_host = from_device(cp, got, dtype)
    assert not np.isnan(got_host).any(), "rows left unwritten (still NaN)"
    err = rel_l2(got_host, ref_o)
    error_log(dtype, err, where)
    assert err <= TOLERANCE[dtype], f"relative L2 error {err:.2e}"
    if variant.softmax:
        check_lse(cp.asnumpy(lse), ref_lse, dtype)
    return plan


# (variant, dtype, head_dim, page_size, group, shape): decode steps (qo 1), prompts, chunks.
_CASES = [
    ("causal", "bfloat16", 128, 16, 1, "decode"),
    ("causal", "bfloat16", 128, 16, 4, "decode"),
    ("causal", "float16", 256, 64, 8, "decode"),
    ("causal", "bfloat16", 64, 1, 4, "decode"),
    ("causal", "bfloat16", 128, 16, 4, "prefill"),
    ("causal", "float16", 64, 16, 1, "prefill"),
    ("causal", "bfloat16", 256, 16, 2, "prefill"),
    ("qk_norm", "bfloat16", 128, 16, 4, "prefill"),
    ("qk_norm", "float16", 128, 16, 1, "decode"),
    ("gptj_rope", "bfloat16", 256, 64, 4, "chunk"),
    ("softcap", "float16", 128, 1, 8, "chunk"),
    ("alibi", "bfloat16", 64, 16, 4, "prefill"),
    ("t5_bias", "bfloat16", 128, 16, 4, "prefill"),
    ("sliding_window", "bfloat16", 128, 16, 4, "chunk"),
    ("kitchen_sink", "bfloat16", 128, 16, 2, "prefill"),
    ("kitchen_sink", "float16", 128, 16, 1, "decode"),
]
_LENGTHS = {"decode": ([1, 1, 1], [777, 1500, 33]), "prefill": ([300, 517], [300, 517]),
            "chunk": ([70, 129], [900, 400])}


@pytest.mark.parametrize("variant_id, dtype, head_dim, page_size, group, shape", _CASES,
                         ids=[f"{v}-{SHORT[d]}-d{h}-p{p}-g{g}-{s}" for v, d, h, p, g, s in _CASES])
def test_fp8_cache(cp, error_log, variant_id, dtype, head_dim, page_size, group, shape):
    qo, kv = _LENGTHS[shape]
    seed = 7000 + _CASES.index((variant_id, dtype, head_dim, page_size, group, shape))
    run_fp8(cp, variant_id, qo, kv, num_qo_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
            dtype=dtype, page_size=page_size, seed=seed, error_log=error_log,
            where=f"fp8 {variant_id} {shape} d{head_dim} p{page_size} g{group}")


# The wgmma prefill kernel's producer converts the tiles it copies by TMA (pages of a multiple of
# 16 tokens) and publishes them as T; copied by cp.async only (ATTNLANG_PREFILL_TMA=0) the
# computing warps convert them. Each case runs both ways on the same batch and seed: partial
# last tiles and items starting off a 16-key row (forced chunks of 100) copied by cp.async
# inside the converting loop, a key hook (the scales not folded: the producer multiplies),
# T5 (40 producer registers: the computing warps convert), head dim 256 (2 K stages),
# and GQA decode steps in the prefill kernel (split keys: both warpgroups on 4 rows).
_PRODUCER = [("causal", "bfloat16", 128, 16, 4, "prefill", None),
             ("causal", "float16", 128, 16, 1, "chunk", 100),
             ("gptj_rope", "bfloat16", 128, 64, 4, "prefill", None),
             ("t5_bias", "bfloat16", 128, 16, 4, "prefill", None),
             ("causal", "bfloat16", 256, 16, 2, "chunk", 448),
             ("causal", "bfloat16", 128, 16, 4, "decode", None)]


@pytest.mark.parametrize("variant_id, dtype, head_dim, page_size, group, shape, chunk", _PRODUCER,
                         ids=[f"{v}-{SHORT[d]}-d{h}-p{p}-g{g}-{s}-{c or 'auto'}"
                              for v, d, h, p, g, s, c in _PRODUCER])
@pytest.mark.parametrize("tma", ["1", "0"])
def test_fp8_converted_by_the_producer(cp, error_log, monkeypatch, tma, variant_id, dtype,
                                       head_dim, page_size, group, shape, chunk):
    monkeypatch.setenv("ATTNLANG_PREFILL_TMA", tma)
    qo, kv = _LENGTHS[shape]
    run_fp8(cp, variant_id, qo, kv, num_qo_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
            dtype=dtype, page_size=page_size, seed=7300 + head_dim + group, error_log=error_log,
            kv_chunk_size=chunk, prefill_min_rows=group - 1 if shape == "decode" else None,
            expect=(False, True) if shape == "decode" else None,
            where=f"fp8 tma={tma} {variant_id} {shape} d{head_dim} p{page_size} g{group}")


# With bf16 q and no key or value hook, the wgmma prefill kernel multiplies the raw e4m3 keys
# on e4m3 tensor cores, each query row split into two e4m3 rows hi + lo times a power of two of
# its own (prefill_shape.cuh's kFp8Qk): q of 2^-20 and of 2^20 (e4m3 reaches 2^-9 .. 448), rows
# 2^5 apart and a zero row, the scores scaled back before a logits hook (softcap) or without a
# softmax (flash_sigmoid), head dim 256, keys copied by TMA and by cp.async (pages of 8), GQA
# decode steps (split keys).
_SPLIT_Q = [("causal", 128, 16, 4, "prefill", None, -20), ("causal", 256, 8, 2, "chunk", None, 20),
            ("softcap", 128, 16, 1, "prefill", None, 20),
            ("flash_sigmoid", 128, 16, 2, "prefill", None, -20),
            ("causal", 128, 16, 4, "decode", None, 20),
            ("sliding_window", 128, 16, 1, "chunk", 100, -20)]


@pytest.mark.parametrize("variant_id, head_dim, page_size, group, shape, chunk, q_exponent",
                         _SPLIT_Q, ids=[f"{v}-d{h}-p{p}-g{g}-{s}-q2^{e}"
                                        for v, h, p, g, s, _, e in _SPLIT_Q])
def test_fp8_scores_from_split_queries(cp, error_log, variant_id, head_dim, page_size, group,
                                       shape, chunk, q_exponent):
    qo, kv = _LENGTHS[shape]
    run_fp8(cp, variant_id, qo, kv, num_qo_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
            dtype="bfloat16", page_size=page_size, seed=7400 + head_dim + group,
            error_log=error_log, kv_chunk_size=chunk, q_exponent=q_exponent,
            prefill_min_rows=group - 1 if shape == "decode" else None,
            expect=(False, True) if shape == "decode" else None,
            where=f"fp8 split q {variant_id} {shape} d{head_dim} p{page_size} g{group}")


# The prefill through a converted copy of the pages it reads (runtime/dequantize.py; plan()
# takes it by itself for long prompts, forced here for the tests' short ones): the dequantize
# kernel, then the prefill kernel of a bf16/fp16 cache over the copy. Keys by TMA and by
# cp.async (pages of 8), pages of one token, head dims 64-256, a key hook (it sees the
# dequantised keys), a window trimming the pages converted, split chunks through the merge.
_COPY = [("causal", "bfloat16", 128, 16, 4, "prefill", None),
         ("causal", "float16", 128, 8, 1, "chunk", 100),
         ("causal", "bfloat16", 256, 16, 2, "prefill", None),
         ("alibi", "bfloat16", 64, 16, 4, "prefill", None),
         ("gptj_rope", "bfloat16", 128, 64, 4, "prefill", None),
         ("softcap", "float16", 128, 1, 8, "chunk", None),
         ("t5_bias", "bfloat16", 128, 16, 4, "prefill", None),
         ("kitchen_sink", "bfloat16", 128, 16, 2, "prefill", None),
         ("sliding_window", "bfloat16", 128, 16, 4, "chunk", None)]


@pytest.mark.parametrize("variant_id, dtype, head_dim, page_size, group, shape, chunk", _COPY,
                         ids=[f"{v}-{SHORT[d]}-d{h}-p{p}-g{g}-{s}-{c or 'auto'}"
                              for v, d, h, p, g, s, c in _COPY])
def test_fp8_prefill_through_a_copy(cp, error_log, variant_id, dtype, head_dim, page_size,
                                    group, shape, chunk):
    qo, kv = _LENGTHS[shape]
    run_fp8(cp, variant_id, qo, kv, num_qo_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
            dtype=dtype, page_size=page_size, seed=7600 + head_dim + group + page_size,
            error_log=error_log, kv_chunk_size=chunk, dequantize=True,
            where=f"fp8 copy {variant_id} {shape} d{head_dim} p{page_size} g{group}")


def test_fp8_copy_beside_decode_steps(cp, error_log):
    """A mixed batch: decode steps keep reading the fp8 pages (tensor-core decode kernel), the
    prompts read the copy, whose slots replace only their page-table entries."""
    plan = run_fp8(cp, "causal", [1, 260, 1, 130], [900, 700, 33, 1000], num_qo_heads=8,
                   num_kv_heads=2, head_dim=128, dtype="bfloat16", page_size=16, seed=7700,
                   error_log=error_log, dequantize=True, expect=(True, True),
                   where="fp8 copy beside decode steps")
    assert plan.decode.num_work_items and plan.prefill.num_work_items


@pytest.mark.parametrize("head_dim", [128, 256])
def test_fp8_epilogues_in_turn(cp, error_log, head_dim):
    """Where the producer converts the tiles it copies, an item's output is staged in the Q tile
    and the producer copies the next item's first tiles during its epilogue; after an item of
    split keys (rows <= 64, merged through the ring) it waits. Short requests (36-64 rows) and
    long ones on 3 CTAs with several items each, so the two kinds follow each other."""
    plan = run_fp8(cp, "causal", [9, 300, 16, 130, 5, 200], [700, 300, 900, 500, 260, 200],
                   num_qo_heads=8, num_kv_heads=2, head_dim=head_dim, dtype="bfloat16",
                   page_size=16, seed=7500 + head_dim, error_log=error_log, prefill_min_rows=3,
                   num_prefill_ctas=3, where=f"fp8 epilogues in turn d{head_dim}")
    assert plan.prefill.num_work_items > 2 * 3


@pytest.mark.parametrize("arrays", ["cupy", "torch"])
def test_fp8_split_and_merged(cp, error_log, arrays):
    # split requests in both kernels (decode steps and a prompt), torch fp8 tensors
    if arrays == "torch":
        pytest.importorskip("torch")
    for group, expect in ((1, (True, False)), (4, (True, True))):
        run_fp8(cp, "causal", [1, 1, 40], [2000, 700, 900], num_qo_heads=2 * group,
                num_kv_heads=2, head_dim=128, dtype="bfloat16", page_size=16, seed=71,
                error_log=error_log, where=f"fp8 split g{group}", kv_chunk_size=256,
                arrays=arrays, expect=None if group == 1 else expect)


# The tensor-core decode kernel: (variant, dtype, group, page size, queries per request, KV
# chunk): MHA to groups of 8 (R = 8), a group of 6 (two idle columns), two queries of a group
# of 4 in one item, pages of 1 and 7 keys, split requests, lengths off the 32-key tiles.
_MMA_CASES = [
    ("causal", "bfloat16", 1, 16, 1, None),
    ("causal", "float16", 4, 16, 1, 256),
    ("causal", "bfloat16", 8, 7, 1, None),
    ("causal", "bfloat16", 6, 1, 1, 96),
    ("causal", "bfloat16", 4, 16, 2, None),
    ("softcap", "bfloat16", 4, 16, 1, 256),
    ("alibi", "float16", 2, 16, 1, None),
    ("t5_bias", "bfloat16", 4, 16, 1, None),
    ("sliding_window", "bfloat16", 4, 16, 1, 128),
    ("streaming_llm", "bfloat16", 4, 16, 1, None),
    ("kitchen_sink", "bfloat16", 8, 16, 1, 200),
]
# ... and at head dims 64 and 256: (variant, dtype, head dim, group, page size, chunk)
_MMA_DIMS = [
    ("causal", "bfloat16", 64, 4, 16, None),
    ("softcap", "float16", 64, 8, 1, 128),
    ("causal", "float16", 256, 2, 16, 256),
    ("alibi", "bfloat16", 256, 8, 7, None),
]


@pytest.mark.parametrize("variant_id, dtype, group, page_size, queries, chunk", _MMA_CASES,
                         ids=[f"{v}-{SHORT[d]}-g{g}-p{p}-q{q}-c{c}"
                              for v, d, g, p, q, c in _MMA_CASES])
def test_fp8_decode_on_tensor_cores(cp, error_log, variant_id, dtype, group, page_size,
                                    queries, chunk):
    from attnlang.codegen.config import decode_mma

    variant = attnlang.load(VARIANT_PATHS[variant_id])
    on_tensor_cores = decode_mma(128, 128, "float8_e4m3fn", softmax=variant.softmax,
                                 kv_hooks=variant.key is not None or variant.value is not None,
                                 pair_masks=any(p.is_pair for p in variant.params))
    seed = 7100 + _MMA_CASES.index((variant_id, dtype, group, page_size, queries, chunk))
    plan = run_fp8(cp, variant_id, [queries] * 4, [1000, 31, 2049, 2], num_qo_heads=2 * group,
                   num_kv_heads=2, head_dim=128, dtype=dtype, page_size=page_size, seed=seed,
                   error_log=error_log, where=f"fp8 decode_mma {variant_id} g{group}",
                   kv_chunk_size=chunk)
    if on_tensor_cores:  # every step of at most 8 rows decodes there
        assert plan.prefill.num_work_items == 0 and plan.decode.num_work_items > 0


@pytest.mark.parametrize("variant_id, dtype, head_dim, group, page_size, chunk", _MMA_DIMS,
                         ids=[f"{v}-{SHORT[d]}-d{h}-g{g}-p{p}-c{c}"
                              for v, d, h, g, p, c in _MMA_DIMS])
def test_fp8_decode_on_tensor_cores_head_dims(cp, error_log, variant_id, dtype, head_dim, group,
                                              page_size, chunk):
    seed = 7200 + _MMA_DIMS.index((variant_id, dtype, head_dim, group, page_size, chunk))
    plan = run_fp8(cp, variant_id, [1, 2, 1], [900, 2049, 33], num_qo_heads=2 * group,
                   num_kv_heads=2, head_dim=head_dim, dtype=dtype, page_size=page_size,
                   seed=seed, error_log=error_log,
                   where=f"fp8 decode_mma {variant_id} d{head_dim} g{group}", kv_chunk_size=chunk)
    if 2 * group <= 8:  # every request's rows fit an item: all in the decode kernel
        assert plan.prefill.num_work_items == 0 and plan.decode.num_work_items > 0


# The tensor-core decode kernel's q and output stages (TX-lane row groups of 128 / TX rows,
# shuffles over a row's lanes): query and output hooks with row reductions, no key hook
# (variant_files.ROW_HOOKS), at every head dim: (head dim, group, page size, chunk).
_ROW_HOOK_CASES = [(128, 4, 16, 48), (256, 8, 16, None), (64, 1, 3, None), (128, 8, 5, 64)]


@pytest.mark.parametrize("head_dim, group, page_size, chunk", _ROW_HOOK_CASES,
                         ids=[f"d{h}-g{g}-p{p}-c{c}" for h, g, p, c in _ROW_HOOK_CASES])
def test_fp8_decode_on_tensor_cores_row_hooks(cp, error_log, head_dim, group, page_size, chunk):
    variant = attnlang.parse(ROW_HOOKS, filename="row_hooks.attn")
    seed = 7300 + _ROW_HOOK_CASES.index((head_dim, group, page_size, chunk))
    plan = run_fp8(cp, variant, [1, 2, 1], [1200, 70, 9], num_qo_heads=2 * group,
                   num_kv_heads=2, head_dim=head_dim, dtype="bfloat16", page_size=page_size,
                   seed=seed, error_log=error_log,
                   where=f"fp8 decode_mma row hooks d{head_dim} g{group}", kv_chunk_size=chunk)
    if 2 * group <= 8:  # every request's rows fit an item: all in the tensor-core kernel
        assert plan.prefill.num_work_items == 0 and plan.decode.num_work_items > 0


def test_fp8_scales_through_the_c_path(cp, error_log):
    """Repeated run() calls with an fp8 cache take the C path (hostpath.c) once one has been
    validated: device scales (torch tensors) and the variant's own device param are read
    again per call, new values included; float scales ride as CuPy arrays beside torch
    tensors."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(73)
    qo, kv = np.array([1, 1, 1]), np.array([700, 40, 1500])
    variant = attnlang.load(VARIANT_PATHS["alibi"])  # slopes: float[heads], a device array
    batch = make_batch(rng, qo, kv, 8, 2, 128, 16, "bfloat16")
    (k_bits, k_seen, k_scale), (v_bits, v_seen, v_scale) = quantize(rng, batch, 2)
    params = make_params(variant, rng, qo, kv, 8, 2, 128)
    attn = attnlang.BatchAttention(variant, 8, 2, 128, kv_dtype="fp8", max_batch_size=4,
                                   max_total_q=16)
    attn.plan(*batch.table)
    q = torch.from_dlpack(to_device(cp, batch.q, "bfloat16")).view(torch.bfloat16)
    kc = torch.from_dlpack(cp.asarray(k_bits)).view(torch.float8_e4m3fn)
    vc = torch.from_dlpack(cp.asarray(v_bits)).view(torch.float8_e4m3fn)
    device_params = {name: torch.as_tensor(np.asarray(value, dtype=np.float32), device="cuda")
                     for name, value in params.items()}  # alibi's slopes

    def check(got, factor, where):
        ref, _ = attention_paged(variant, batch.q, k_seen * factor, v_seen * factor,
                                 *batch.table, params=params)
        host = from_device(cp, cp.from_dlpack(got.view(torch.uint16)), "bfloat16")
        err = rel_l2(host, ref)
        error_log("bfloat16", err, where)
        assert err <= TOLERANCE["bfloat16"], f"{where}: relative L2 error {err:.2e}"

    def took_c_path():
        ran = any(f.ran or f.ran_on_copy_stream for f in attn._fast_runs.values())
        attn._absorb_fast_flags()  # reset for the next call
        return ran

    for factor in (1.0, 2.0, 0.5):  # new scale tensors per call, the same signature
        ks = torch.as_tensor(k_scale * factor, device="cuda")
        vs = torch.as_tensor(v_scale * factor, device="cuda")
        got = attn.run(q, (kc, vc), device_params, k_scale=ks, v_scale=vs)
        check(got, factor, f"fp8 C path, device scales x{factor}")
        assert took_c_path() == (factor != 1.0 and attn._hostpath is not None)
    # one float per tensor: a cached CuPy array of that value per KV head
    single = (float(k_scale.max()), float(v_scale.max()))
    k_bits, v_bits = to_e4m3(batch.k_cache / single[0]), to_e4m3(batch.v_cache / single[1])
    k_seen, v_seen = from_e4m3(k_bits) * single[0], from_e4m3(v_bits) * single[1]
    kc1 = torch.from_dlpack(cp.asarray(k_bits)).view(torch.float8_e4m3fn)
    vc1 = torch.from_dlpack(cp.asarray(v_bits)).view(torch.float8_e4m3fn)
    for call in range(2):
        got = attn.run(q, (kc1, vc1), device_params, k_scale=single[0], v_scale=single[1])
        check(got, 1.0, f"fp8 C path, float scales, call {call}")
        assert took_c_path() == (call == 1 and attn._hostpath is not None)


def test_fp8_float_scales(cp, error_log):
    # one float per tensor (one KV head, so the batch's per-head scale is one value)
    for group in (1, 4):
        run_fp8(cp, "softcap", [1, 200], [600, 700], num_qo_heads=group, num_kv_heads=1,
                head_dim=128, dtype="bfloat16", page_size=16, seed=72, error_log=error_log,
                where=f"fp8 float scales g{group}", scales="float")


def test_fp8_one_element_device_scales(cp):
    # A per-tensor scale kept on the device (shape () or (1,), CuPy or torch) is read when
    # the kernels run: bit for bit the per-head array's result, new values in a graph replay.
    variant = attnlang.load(VARIANT_PATHS["causal"])
    rng = np.random.default_rng(74)
    hq, hkv, d, page = 8, 2, 128, 16
    attn = attnlang.BatchAttention(variant, hq, hkv, d, kv_dtype="fp8", max_batch_size=4,
                                   max_total_q=64)
    k_bits, v_bits, kc, vc, q_host, q, ks, vs, out = graph_inputs(cp, rng, 64, 4, hq, hkv, d,
                                                                  page)
    attn.plan(np.arange(5), np.array([0, 20, 40, 50, 64]), rng.permutation(64),
              np.array([16, 7, 16, 1]))

    def per_head(k_s, v_s):
        return cp.asnumpy(attn.run(q, (kc, vc), k_scale=cp.full(hkv, k_s, np.float32),
                                   v_scale=cp.full(hkv, v_s, np.float32)))

    want = per_head(0.02, 0.03)
    one_k, one_v = cp.full((1,), 0.02, np.float32), cp.full((), 0.03, np.float32)
    assert np.array_equal(cp.asnumpy(attn.run(q, (kc, vc), k_scale=one_k, v_scale=one_v)), want)
    assert np.array_equal(cp.asnumpy(attn.run(q, (kc, vc), k_scale=one_k,
                                              v_scale=cp.full(hkv, 0.03, np.float32))), want)
    torch = pytest.importorskip("torch")
    tq = torch.from_dlpack(q).view(torch.bfloat16)
    k8, v8 = (torch.from_dlpack(x).view(torch.float8_e4m3fn) for x in (kc, vc))
    got = attn.run(tq, (k8, v8), k_scale=torch.tensor(0.02, device="cuda"),
                   v_scale=torch.tensor([0.03], device="cuda"))
    assert np.array_equal(got.view(torch.uint16).cpu().numpy(), want)

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        attn.run(q, (kc, vc), out=out, k_scale=one_k, v_scale=one_v)  # warm up
        stream.begin_capture()
        attn.run(q, (kc, vc), out=out, k_scale=one_k, v_scale=one_v)
        graph = stream.end_capture()
        one_k.fill(0.05)
        one_v.fill(0.01)
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(cp.asnumpy(out), per_head(0.05, 0.01))
    with pytest.raises(TypeError, match="k_scale must be float32, got a float64"):
        attn.run(q, (kc, vc), k_scale=cp.ones(1), v_scale=one_v)


def test_fp8_errors(cp):
    variant = attnlang.load(VARIANT_PATHS["causal"])
    attn = attnlang.BatchAttention(variant, 4, 2, 64, kv_dtype="fp8", max_batch_size=2,
                                   max_total_q=16)
    attn.plan(np.array([0, 1]), np.array([0, 1]), np.array([0]), np.array([5]))
    q = cp.zeros((1, 4, 64), dtype=np.uint16)
    kc = cp.zeros((1, 16, 2, 64), dtype=np.uint8)
    with pytest.raises(TypeError, match="needs k_scale and v_scale"):
        attn.run(q, (kc, kc))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        attn.run(q, (kc.view(np.int8), kc.view(np.int8)), k_scale=1.0, v_scale=1.0)
    with pytest.raises(TypeError, match="only the KV cache may be fp8"):
        attn.run(cp.zeros((1, 4, 64), dtype=np.uint8), (kc, kc), k_scale=1.0, v_scale=1.0)
    with pytest.raises((TypeError, ValueError), match="k_scale"):
        attn.run(q, (kc, kc), k_scale=cp.ones(3, np.float32), v_scale=1.0)
    bf16 = attnlang.BatchAttention(variant, 4, 2, 64, max_batch_size=2, max_total_q=16)
    with pytest.raises(ValueError, match="no request of max_qo_len=16 queries reads a key"):
        attn.plan(np.array([0, 1]), np.array([0, 1]), np.array([0]), np.array([5]),
                  dequantize=True)
    with pytest.raises(ValueError, match="no converted copy: its cache is not fp8"):
        bf16.plan(np.array([0, 1]), np.array([0, 1]), np.array([0]), np.array([5]),
                  dequantize=True)
    bf16.plan(np.array([0, 1]), np.array([0, 1]), np.array([0]), np.array([5]))
    with pytest.raises(TypeError, match="kv_dtype='fp8'"):
        bf16.run(q, (kc, kc))
    with pytest.raises(TypeError, match="for an fp8 KV cache"):
        bf16.run(q, (cp.zeros((1, 16, 2, 64), np.uint16),) * 2, k_scale=1.0, v_scale=1.0)


def graph_inputs(cp, rng, pages, rows, hq, hkv, d, page):
    """A graph test's fixed buffers: e4m3 caches (host bits and device copies), q (host and
    bf16 device), per-head device scales to refill between replays, a bf16 out."""
    k_bits = to_e4m3(rng.standard_normal((pages, page, hkv, d)) * 50)
    v_bits = to_e4m3(rng.standard_normal((pages, page, hkv, d)) * 50)
    q_host = rng.standard_normal((rows, hq, d)).astype(np.float32)
    return (k_bits, v_bits, cp.asarray(k_bits), cp.asarray(v_bits), q_host,
            to_device(cp, q_host, "bfloat16"), cp.full(hkv, 0.02, np.float32),
            cp.full(hkv, 0.03, np.float32), cp.zeros((rows, hq, d), np.uint16))


@pytest.mark.parametrize("max_qo_len", [None, 1])
def test_fp8_cuda_graph(cp, max_qo_len):
    # capture with device scales; replay after new scale values and a new plan. max_qo_len=1:
    # a decode loop's graph, without the prefill kernel's launch (launches.graph_kernels).
    variant = attnlang.load(VARIANT_PATHS["causal"])
    rng = np.random.default_rng(73)
    hq, hkv, d, page = 8, 2, 128, 16
    attn = attnlang.BatchAttention(variant, hq, hkv, d, kv_dtype="fp8", max_batch_size=4,
                                   max_total_q=64, max_qo_len=max_qo_len)
    pages = 64
    k_bits, v_bits, kc, vc, q_host, q, ks, vs, out = graph_inputs(cp, rng, pages, 4, hq, hkv,
                                                                  d, page)

    def table(lengths):
        n = [-(-x // page) for x in lengths]
        indptr = np.concatenate([[0], np.cumsum(n)])
        indices = rng.permutation(pages)[:indptr[-1]]
        last = np.array([x - (m - 1) * page for x, m in zip(lengths, n, strict=True)])
        return np.arange(5)[:len(lengths) + 1], indptr, indices, last

    stream = cp.cuda.Stream(non_blocking=True)
    tab = table([100, 300, 17, 250])
    attn.plan(*tab)
    with stream:
        attn.run(q, (kc, vc), out=out, k_scale=ks, v_scale=vs)  # warm up
        stream.begin_capture()
        attn.run(q, (kc, vc), out=out, k_scale=ks, v_scale=vs)
        graph = stream.end_capture()
    for lengths, k_s, v_s in (([500, 40, 260, 90], 0.01, 0.05), ([64, 64, 800, 3], 0.04, 0.02)):
        tab = table(lengths)
        with stream:  # the plan's copy and the new scales ordered before the replay
            attn.plan(*tab)
            ks.fill(k_s)
            vs.fill(v_s)
            graph.launch()
        stream.synchronize()
        seen_k = from_e4m3(k_bits) * k_s
        seen_v = from_e4m3(v_bits) * v_s
        ref, _ = attention_paged(variant, round_to_dtype(q_host, "bfloat16"), seen_k, seen_v,
                                 *tab)
        assert rel_l2(from_device(cp, out, "bfloat16"), ref) <= TOLERANCE["bfloat16"]
    if max_qo_len == 1:  # a request of two queries is refused, naming the bound
        _, indptr, indices, last = table([100, 300, 17, 250])
        with pytest.raises(CapacityError, match="max_qo_len=2"):
            attn.plan(np.array([0, 2, 3, 4, 5]), indptr, indices, last)


def test_fp8_copy_capacity_and_graph(cp):
    """A copy of two pages: plan() falls back to converting per tile when a prompt's pages do
    not fit (dequantize=True refuses, naming the bound); a graph captured on a plan through
    the copy replays plans through either path, with new scales."""
    variant = attnlang.load(VARIANT_PATHS["causal"])
    rng = np.random.default_rng(74)
    hq, hkv, d, page = 8, 2, 128, 16
    copy_bytes = 2 * page * hkv * 2 * d * 2  # two pages of K and V in bf16
    attn = attnlang.BatchAttention(variant, hq, hkv, d, kv_dtype="fp8", max_batch_size=2,
                                   max_total_q=1024, max_dequant_bytes=copy_bytes)
    pages = 40
    k_bits, v_bits, kc, vc, q_host, q, ks, vs, out = graph_inputs(cp, rng, pages, 1024, hq,
                                                                  hkv, d, page)

    def table(qo, kv):
        n = [-(-x // page) for x in kv]
        indptr = np.concatenate([[0], np.cumsum(n)])
        last = np.array([x - (m - 1) * page for x, m in zip(kv, n, strict=True)])
        return (np.concatenate([[0], np.cumsum(qo)]), indptr,
                rng.permutation(pages)[:indptr[-1]], last)

    fits = table([25], [30])  # two pages
    too_long = table([256], [300])
    with pytest.raises(CapacityError, match="max_dequant_bytes"):
        attn.plan(*too_long, dequantize=True)
    stream = cp.cuda.Stream(non_blocking=True)
    attn.plan(*fits, dequantize=True)
    assert attn.last_dequant is not None and attn.last_dequant.pages.size == 2
    with stream:  # views of the buffers at their start: later plans use more rows
        attn.run(q[:25], (kc, vc), out=out[:25], k_scale=ks, v_scale=vs)  # warm up
        stream.begin_capture()
        attn.run(q[:25], (kc, vc), out=out[:25], k_scale=ks, v_scale=vs)
        graph = stream.end_capture()
    for tab, force, k_s, v_s in ((too_long, None, 0.01, 0.05), (fits, True, 0.04, 0.02),
                                 (table([20], [25]), False, 0.03, 0.03)):
        with stream:
            attn.plan(*tab, dequantize=force)
            ks.fill(k_s)
            vs.fill(v_s)
            out.fill(0x7FC0)  # bf16 NaN: rows the replay leaves unwritten show
            graph.launch()
        stream.synchronize()
        assert (attn.last_dequant is not None) == bool(force)
        n = int(tab[0][-1])
        ref, _ = attention_paged(variant, round_to_dtype(q_host[:n], "bfloat16"),
                                 from_e4m3(k_bits) * k_s, from_e4m3(v_bits) * v_s, *tab)
        got = from_device(cp, out, "bfloat16")[:n]
        assert rel_l2(got, ref) <= TOLERANCE["bfloat16"]


def test_fp8_copy_layers_back_to_back(cp):
    """Two layers' run() in one graph, each a prompt through the copy with no split (the merge
    kernel has no row): the second layer's conversion must not rewrite the copy while the
    first layer's prefill still reads it. Each kernel waits for the one before it only, and
    every CTA waits before it exits (the merge kernel's without a row too); the prefill on 2
    CTAs leaves the second layer's kernels free SMs to start early on."""
    variant = attnlang.load(VARIANT_PATHS["causal"])
    rng = np.random.default_rng(75)
    hq, hkv, d, page, n = 8, 2, 128, 16, 1024
    attn = attnlang.BatchAttention(variant, hq, hkv, d, kv_dtype="fp8", max_batch_size=1,
                                   max_total_q=n, num_prefill_ctas=2)
    pages = n // page
    table = (np.array([0, n]), np.array([0, pages]), rng.permutation(pages),
             np.array([page]))
    attn.plan(*table, dequantize=True)
    assert attn.last_dequant is not None and attn.last_plan.merge_count == 0
    layers = [graph_inputs(cp, rng, pages, n, hq, hkv, d, page) for _ in range(2)]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _, _, kc, vc, _, q, ks, vs, out in layers:
            attn.run(q, (kc, vc), out=out, k_scale=ks, v_scale=vs)
        graph = stream.end_capture()
        for *_, out in layers:
            out.fill(0x7FC0)
        graph.launch()
    stream.synchronize()
    for k_bits, v_bits, _, _, q_host, _, ks, vs, out in layers:
        ref, _ = attention_paged(variant, round_to_dtype(q_host, "bfloat16"),
                                 from_e4m3(k_bits) * float(ks[0]),
                                 from_e4m3(v_bits) * float(vs[0]), *table)
        assert rel_l2(from_device(cp, out, "bfloat16"), ref) <= TOLERANCE["bfloat16"]
