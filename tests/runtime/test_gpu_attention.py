"""BatchAttention and merge_states on a GPU, against the NumPy reference (float64).

Every variant of the zoo (tests/variant_files.py) runs in decode and in prefill, over a
pairwise selection of dtype x head_dim x page_size x GQA group x mode x KV splitting (each
pair of values of two axes appears at least once; not the full product), on fresh random
ragged batches with shuffled pages, poisoned unused cache slots and NaN-poisoned outputs.
Then: torch tensors in -> torch out without copies, merge_states, CUDA-graph replay after a
re-plan, bitwise determinism, a saved-and-loaded module, and validation before launch.

Tolerance (LANGUAGE.md section 7): relative L2 error <= 1e-2 (bf16), <= 2e-3 (fp16). The
largest error per dtype is printed at the end of the run (tests/conftest.py; also written to
$ATTNLANG_ERROR_LOG if set).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest

import attnlang
from attnlang import ir
from attnlang.codegen.config import launch_config
from attnlang.fp8 import to_e4m3
from attnlang.reference import attention_paged
from attnlang.runtime.arrays import bfloat16_bits_to_float, float_to_bfloat16_bits, round_to_dtype
from attnlang.runtime.merge import merge_states_reference
from attnlang.runtime.paged import indptr_from_lengths, ragged_to_paged
from attnlang.runtime.plan_mixed import Tiling, plan_mixed
from tests.codegen.emulator import random_pair_mask
from tests.variant_files import VARIANT_FILES, VARIANT_IDS

pytestmark = pytest.mark.gpu

TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3}
SHORT = {"bfloat16": "bf16", "float16": "fp16"}
VARIANT_PATHS = dict(zip(VARIANT_IDS, VARIANT_FILES, strict=True))
MAX_BATCH, MAX_TOTAL_Q, MAX_KV_INDICES = 8, 512, 1 << 15


# ---------------------------------------------------------------------------- the matrix

AXES = {
    "dtype": ("bfloat16", "float16"),
    "head_dim": (64, 128, 256),
    "page_size": (1, 16, 64),
    "group": (1, 4, 8),
    "mode": ("decode", "prefill"),
    "split": ("auto", "forced", "none"),
}


@dataclass(frozen=True)
class Case:
    variant: str
    dtype: str
    head_dim: int
    page_size: int
    group: int
    mode: str
    split: str
    seed: int

    @property
    def id(self) -> str:
        return (f"{self.variant}-{self.mode}-{SHORT[self.dtype]}-d{self.head_dim}-"
                f"p{self.page_size}-g{self.group}-{self.split}")


def _pairs(values: tuple) -> set:
    return {((i, values[i]), (j, values[j])) for i, j in itertools.combinations(range(6), 2)}


def build_matrix() -> list[Case]:
    """Every variant in decode and prefill in both dtypes; axis values chosen greedily to
    cover new pairs of axis values first, then extra cases (variants in turn) until every pair
    is covered. Deterministic."""
    names = list(AXES)
    candidates = list(itertools.product(*AXES.values()))
    uncovered = set().union(*(_pairs(c) for c in candidates))
    chosen: list[tuple[str, tuple]] = []

    def pick(pool, offset):
        rotated = pool[offset % len(pool):] + pool[:offset % len(pool)]
        return max(rotated, key=lambda c: len(_pairs(c) & uncovered))  # first best wins

    mode_axis, dtype_axis = names.index("mode"), names.index("dtype")
    for n, variant in enumerate(VARIANT_IDS):
        for m, (mode, dtype) in enumerate(itertools.product(AXES["mode"], AXES["dtype"])):
            # The rotation spreads the remaining choices once every pair is covered.
            pool = [c for c in candidates if c[mode_axis] == mode and c[dtype_axis] == dtype]
            values = pick(pool, 23 * (4 * n + m))
            uncovered -= _pairs(values)
            chosen.append((variant, values))
    n = 0
    while uncovered:
        values = pick(candidates, 0)
        uncovered -= _pairs(values)
        chosen.append((VARIANT_IDS[n % len(VARIANT_IDS)], values))
        n += 1
    cases = [Case(variant, *values, seed=1000 + i) for i, (variant, values) in enumerate(chosen)]
    # What the selection promises: every pair of axis values, every variant in both modes.
    seen = set().union(*(_pairs(tuple(getattr(c, n) for n in names)) for c in cases))
    assert seen == set().union(*(_pairs(c) for c in candidates))
    assert {(c.variant, c.mode, c.dtype) for c in cases} == set(
        itertools.product(VARIANT_IDS, AXES["mode"], AXES["dtype"]))
    return cases


MATRIX = build_matrix()


# ---------------------------------------------------------------------------- helpers


def to_device(cp, x: np.ndarray, dtype: str):
    """float32 values (already representable) -> a device array of the attention dtype;
    bf16 travels as uint16 bits (works with or without ml_dtypes)."""
    if dtype == "float16":
        return cp.asarray(x.astype(np.float16))
    return cp.asarray(float_to_bfloat16_bits(x))


def from_device(cp, x, dtype: str) -> np.ndarray:
    host = cp.asnumpy(x)
    if dtype == "float16":
        return host.astype(np.float32)
    return bfloat16_bits_to_float(host.view(np.uint16))


def poisoned(cp, shape, dtype: str):
    if dtype == "float16":
        return cp.full(shape, np.nan, dtype=np.float16)
    return cp.full(shape, 0x7FC0, dtype=np.uint16)  # bf16 NaN


@dataclass
class Batch:
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray  # pages
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    q: np.ndarray  # float32 values as rounded to the dtype
    k_cache: np.ndarray
    v_cache: np.ndarray

    @property
    def table(self):
        return self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len


def make_batch(rng, qo, kv, num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
               head_dim_vo=None) -> Batch:
    qo, kv = np.asarray(qo), np.asarray(kv)
    dv = head_dim if head_dim_vo is None else head_dim_vo
    q = rng.standard_normal((qo.sum(), num_qo_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((kv.sum(), num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((kv.sum(), num_kv_heads, dv)).astype(np.float32)
    k_cache, v_cache, kv_indices, kv_indptr, last = ragged_to_paged(
        round_to_dtype(k, dtype), round_to_dtype(v, dtype), indptr_from_lengths(kv),
        page_size, rng=rng)
    return Batch(indptr_from_lengths(qo), kv_indptr, kv_indices, last,
                 round_to_dtype(q, dtype), round_to_dtype(k_cache, dtype),
                 round_to_dtype(v_cache, dtype))


def lengths_for(rng, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Ragged lengths: decode (qo_len 1, kv_len up to 2000, one of length 1), prefill (one
    long prompt up to 300 queries over up to 2000 keys, a pure prompt, an empty request) or
    mixed (four decode steps and the prefill requests in one batch, shuffled)."""
    if mode == "mixed":
        (qo_d, kv_d), (qo_p, kv_p) = lengths_for(rng, "decode"), lengths_for(rng, "prefill")
        order = rng.permutation(4 + len(qo_p))
        return (np.concatenate([qo_d[:4], qo_p])[order],
                np.concatenate([kv_d[:4], kv_p])[order])
    if mode == "decode":
        kv = np.array([1, rng.integers(2, 300), rng.integers(300, 1000), rng.integers(1000, 2001),
                       rng.integers(1, 2001), rng.integers(1, 2001)])
        rng.shuffle(kv)
        return np.ones_like(kv), kv
    qo = np.array([rng.integers(100, 301), rng.integers(1, 65), 0, rng.integers(1, 17)])
    kv = qo + np.array([rng.integers(300, 1701), rng.integers(0, 501), rng.integers(0, 101),
                         0])
    return qo, kv


def make_params(variant: ir.Variant, rng, qo, kv, num_qo_heads, num_kv_heads, head_dim,
                head_dim_vo=None):
    """Realistic params: ALiBi slopes geometric, QK-norm weights around 1, prefix lengths per
    request, FlashSigmoid's bias -log(n); other scalars near their defaults."""
    sizes = ir.extent_sizes(variant, num_qo_heads, num_kv_heads, len(qo), head_dim, head_dim_vo)
    params = {}
    for spec in variant.params:
        if spec.is_pair:  # 16 x 32 blocks all true, all false or mixed: every tile class
            params[spec.name] = [random_pair_mask(rng, int(q), int(k))
                                 for q, k in zip(qo, kv, strict=True)]
            continue
        if not spec.is_tensor:
            if spec.name == "bias":
                value = -math.log(float(max(kv)))
            elif spec.type is ir.INT:
                value = int(spec.default if spec.default is not None else 1)
            elif spec.default is not None:
                value = float(spec.default) * (1 + 0.1 * rng.random())
            else:
                value = 1.0
        else:
            n = spec.shape(sizes[spec.name])
            if spec.name == "slopes":
                value = 2.0 ** (-8.0 * np.arange(1, n[0] + 1) / n[0])
            elif spec.type is ir.INT and spec.extents == ("batch",):
                value = rng.integers(0, np.asarray(kv) + 1)  # a prefix / offset per request
            elif spec.type is ir.BOOL:
                value = rng.random(n) < 0.3
            elif spec.type is ir.INT:
                value = rng.integers(0, 4, n)
            else:
                value = 1.0 + 0.1 * rng.standard_normal(n)
            dtype = {ir.INT: np.int32, ir.FLOAT: np.float32, ir.BOOL: bool}[spec.type]
            value = np.asarray(value, dtype=dtype)
        params[spec.name] = value
    return params


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def check_lse(got: np.ndarray, ref: np.ndarray, dtype: str | None = None) -> None:
    """lse -inf exactly where the reference's is, else close. A score of bf16 inputs carries
    the rounding of q' and k' to bf16 (2^-9 each, relative to the dot's terms), which a row
    of one or two visible keys passes to its lse whole: 1e-2 absolute for bf16 (as the
    output's relative bound), 5e-3 for the rest (fp16 rounds at 2^-11; merges of states)."""
    assert np.array_equal(np.isneginf(got), np.isneginf(ref)), "fully masked rows differ"
    finite = np.isfinite(ref)
    assert np.isfinite(got[finite]).all()
    atol = 1e-2 if dtype == "bfloat16" else 5e-3
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-3, atol=atol)


def build_attention(variant, case: Case, qo, kv, num_qo_heads, num_kv_heads, **kwargs):
    """BatchAttention for a case (kwargs: more constructor arguments). forced: a small KV
    chunk bound, so short requests split too (capacities sized from a CPU plan); none: no
    split, few CTAs (many items each)."""
    kwargs.update(max_batch_size=MAX_BATCH, max_total_q=MAX_TOTAL_Q,
                  max_kv_indices=MAX_KV_INDICES)
    chunk = None
    if case.split == "forced":
        chunk = int(np.random.default_rng(case.seed).choice(
            [32, 64, 100] if case.mode == "decode" else [128, 200, 256]))
        tilings = {kind: Tiling(launch_config(kind, case.head_dim, case.group,
                                              case.dtype).rows_per_tile, 16, 1)
                   for kind in ("decode", "prefill")}
        need = plan_mixed(qo, kv, num_kv_heads=num_kv_heads, group_size=case.group,
                          **tilings, prefill_min_rows=kwargs.get("prefill_min_rows"),
                          kv_chunk_size=chunk)
        kwargs.update(num_ctas=16, max_work_items=max(need.decode.num_work_items,
                                                      need.prefill.num_work_items),
                      max_partial_rows=max(1, need.num_partial_rows),
                      max_merge_rows=max(1, need.merge_count))
    elif case.split == "none":
        chunk = 1 << 30
        kwargs.update(num_ctas=7)
    attn = attnlang.BatchAttention(variant, num_qo_heads, num_kv_heads, case.head_dim,
                                   dtype=case.dtype, page_size=case.page_size, **kwargs)
    return attn, chunk


# ---------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("case", MATRIX, ids=[c.id for c in MATRIX])
def test_attention_matches_reference(cp, case, error_log):
    check_case(cp, case, error_log)


# The decode kernel (CUDA cores) at GQA groups of 4 and 8, which by default decode in the
# prefill kernel (planner.PREFILL_MIN_ROWS): every variant once, dtype, head_dim, page size
# and split mode in turn. The matrix covers it at group 1.
CUDA_CORE_DECODE = [
    Case(variant, AXES["dtype"][n % 2], AXES["head_dim"][n % 3], AXES["page_size"][(n // 3) % 3],
         (4, 8)[(n // 2) % 2], "decode", AXES["split"][n % 3], seed=3000 + n)
    for n, variant in enumerate(VARIANT_IDS)]


@pytest.mark.parametrize("case", CUDA_CORE_DECODE, ids=[c.id for c in CUDA_CORE_DECODE])
def test_decode_kernel_at_gqa_groups(cp, case, error_log):
    plan = check_case(cp, case, error_log, prefill_min_rows=16)
    assert plan.prefill.num_work_items == 0 and plan.decode.num_work_items > 0


def split_params(variant: ir.Variant, params: dict) -> tuple[dict, dict]:
    """(plan()'s params: the per-pair masks, run()'s: the rest)."""
    pairs = {p.name for p in variant.params if p.is_pair}
    return ({k: v for k, v in params.items() if k in pairs},
            {k: v for k, v in params.items() if k not in pairs})


def check_case(cp, case: Case, error_log, variant: ir.Variant | None = None, **attn_kwargs):
    """Run a case's batch (BatchAttention with attn_kwargs) and compare with the reference;
    returns the plan. variant: a parsed variant instead of the zoo's file case.variant."""
    if variant is None:
        variant = attnlang.load(VARIANT_PATHS[case.variant])
    rng = np.random.default_rng(case.seed)
    num_kv_heads = 4 if case.group == 1 else 2
    num_qo_heads = num_kv_heads * case.group
    qo, kv = lengths_for(rng, case.mode)
    batch = make_batch(rng, qo, kv, num_qo_heads, num_kv_heads, case.head_dim,
                       case.page_size, case.dtype)
    params = make_params(variant, rng, qo, kv, num_qo_heads, num_kv_heads, case.head_dim)
    ref_o, ref_lse = attention_paged(variant, batch.q, batch.k_cache, batch.v_cache,
                                     *batch.table, params=params)

    attn, chunk = build_attention(variant, case, qo, kv, num_qo_heads, num_kv_heads,
                                  **attn_kwargs)
    plan_params, params = split_params(variant, params)
    plan = attn.plan(*batch.table, kv_chunk_size=chunk, params=plan_params)
    if case.split == "forced":
        # The small chunk splits every work unit longer than it. A windowed mask may trim
        # every unit below it (a window of 64 keys over the 16 queries of a GQA-8 tile):
        # then nothing needs merging.
        unsplit = all((p.work_kv_end - p.work_kv_start <= p.kv_chunk_size).all()
                      for p in (plan.decode, plan.prefill))
        assert plan.merge_count > 0 or unsplit, "the forced case must exercise the merge kernel"
    if case.split == "none":
        assert plan.merge_count == 0
    # Half the cases pass tensor params as device arrays, half as NumPy (copied).
    if case.seed % 2:
        params = {k: (cp.asarray(v) if isinstance(v, np.ndarray) else v)
                  for k, v in params.items()}
    q = to_device(cp, batch.q, case.dtype)
    kc = to_device(cp, batch.k_cache, case.dtype)
    vc = to_device(cp, batch.v_cache, case.dtype)
    out = poisoned(cp, q.shape, case.dtype)
    got, lse = attn.run(q, (kc, vc), params, out=out, return_lse=True)
    assert got is out
    got = from_device(cp, got, case.dtype)
    assert not np.isnan(got).any(), "rows left unwritten (still NaN)"
    err = rel_l2(got, ref_o)
    error_log(case.dtype, err, case.id)
    assert err <= TOLERANCE[case.dtype], f"relative L2 error {err:.2e}"
    if variant.softmax:
        check_lse(cp.asnumpy(lse), ref_lse, case.dtype)
    else:
        assert lse is None
    return plan


def test_splitting_does_not_change_the_result(cp):
    """The same batch with no split, the automatic split and a tiny chunk: equal within
    float32 rounding (LANGUAGE.md: the result does not depend on how KV is split)."""
    variant = attnlang.load(VARIANT_PATHS["softcap"])
    rng = np.random.default_rng(7)
    qo, kv = np.array([1, 1, 3]), np.array([1900, 40, 700])
    batch = make_batch(rng, qo, kv, 8, 2, 128, 16, "float16")
    attn = attnlang.BatchAttention(variant, 8, 2, 128, "float16", 16, max_batch_size=4,
                                   max_total_q=16, max_work_items=4096,
                                   max_partial_rows=8192, max_merge_rows=4096)
    q, kc, vc = (to_device(cp, x, "float16") for x in (batch.q, batch.k_cache, batch.v_cache))
    results = []
    for chunk in (1 << 30, None, 48):
        attn.plan(*batch.table, kv_chunk_size=chunk)
        results.append(from_device(cp, attn.run(q, (kc, vc)), "float16"))
    assert rel_l2(results[1], results[0]) < 2e-3 and rel_l2(results[2], results[0]) < 2e-3


# ---------------------------------------------------------------------------- torch


def test_torch_tensors_in_torch_out_without_copies(cp, error_log):
    torch = pytest.importorskip("torch")
    variant = attnlang.load(VARIANT_PATHS["alibi"])
    rng = np.random.default_rng(11)
    qo, kv = np.array([1, 4, 1]), np.array([900, 60, 2])
    batch = make_batch(rng, qo, kv, 16, 2, 128, 16, "bfloat16")
    params = make_params(variant, rng, qo, kv, 16, 2, 128)
    ref_o, ref_lse = attention_paged(variant, batch.q, batch.k_cache, batch.v_cache,
                                     *batch.table, params=params)

    def t(x, dtype=torch.bfloat16):
        return torch.from_numpy(np.ascontiguousarray(x)).to("cuda").to(dtype)

    q, kc, vc = t(batch.q), t(batch.k_cache), t(batch.v_cache)
    slopes = t(params["slopes"], torch.float32)
    attn = attnlang.BatchAttention(variant, 16, 2, 128, torch.bfloat16, 16)
    attn.plan(*batch.table)
    out = torch.full_like(q, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # work goes to torch's current stream
        got = attn.run(q, (kc, vc), {"slopes": slopes}, out=out)
        fresh, lse = attn.run(q, (kc, vc), {"slopes": slopes}, return_lse=True)
    side.synchronize()
    assert got is out and got.data_ptr() == out.data_ptr()
    assert isinstance(fresh, torch.Tensor) and fresh.dtype == torch.bfloat16
    assert fresh.device == q.device and fresh.shape == q.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    for result in (got, fresh):
        err = rel_l2(result.float().cpu().numpy(), ref_o)
        error_log("bfloat16", err, "torch alibi")
        assert err <= TOLERANCE["bfloat16"]
    check_lse(lse.cpu().numpy(), ref_lse)


# ---------------------------------------------------------------------------- merge_states


def _merge_inputs(rng, n, h, d):
    o_a = rng.standard_normal((n, h, d)).astype(np.float32)
    o_b = rng.standard_normal((n, h, d)).astype(np.float32)
    lse_a = (3 * rng.standard_normal((n, h))).astype(np.float32)
    lse_b = (3 * rng.standard_normal((n, h))).astype(np.float32)
    lse_a[:5] = -np.inf  # empty on one side...
    lse_b[5:10] = -np.inf  # ...on the other...
    lse_a[10:12] = lse_b[10:12] = -np.inf  # ...and on both: o = 0, lse = -inf
    o_a[:5] = np.nan  # an empty side's o is never read
    return o_a, lse_a, o_b, lse_b


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_merge_states_matches_numpy(cp, dtype):
    rng = np.random.default_rng(3)
    o_a, lse_a, o_b, lse_b = _merge_inputs(rng, 37, 4, 96)
    if dtype != "float32":
        o_a, o_b = round_to_dtype(o_a, dtype), round_to_dtype(o_b, dtype)
    up = (lambda x: cp.asarray(x)) if dtype == "float32" else (lambda x: to_device(cp, x, dtype))
    o, lse = attnlang.merge_states(up(o_a), cp.asarray(lse_a), up(o_b), cp.asarray(lse_b))
    assert isinstance(o, cp.ndarray) and o.shape == (37, 4, 96)
    got = cp.asnumpy(o) if dtype == "float32" else from_device(cp, o, dtype)
    ref_o, ref_lse = merge_states_reference(o_a, lse_a, o_b, lse_b)
    assert not np.isnan(got).any() and (got[10:12] == 0).all()
    assert rel_l2(got, ref_o) <= {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    check_lse(cp.asnumpy(lse), ref_lse)


def test_merge_states_torch(cp):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    o_a, lse_a, o_b, lse_b = _merge_inputs(rng, 20, 2, 128)
    o_a, o_b = round_to_dtype(o_a, "bf16"), round_to_dtype(o_b, "bf16")
    o, lse = attnlang.merge_states(
        *(torch.from_numpy(x).cuda().to(torch.bfloat16 if x.ndim == 3 else torch.float32)
          for x in (o_a, lse_a, o_b, lse_b)))
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
    ref_o, ref_lse = merge_states_reference(o_a, lse_a, o_b, lse_b)
    assert rel_l2(o.float().cpu().numpy(), ref_o) <= 8e-3
    check_lse(lse.cpu().numpy(), ref_lse)


# ---------------------------------------------------------------------------- CUDA graphs


def test_cuda_graph_replay_after_replan(cp):
    """Capture run() once; plan() a new batch (new lengths, now with splits); replaying the
    graph gives exactly what a plain run of the new plan gives."""
    variant = attnlang.load(VARIANT_PATHS["softcap"])
    dtype, hq, hkv, d, ps = "float16", 8, 2, 128, 16
    rng = np.random.default_rng(21)
    # One cache holding five requests; batch A uses requests 0-1, batch B requests 2-4.
    kv = np.array([30, 7, 1800, 300, 64])
    pool = make_batch(rng, np.zeros(5, int), kv, hq, hkv, d, ps, dtype)
    pages = [pool.kv_indices[pool.kv_indptr[i]:pool.kv_indptr[i + 1]] for i in range(5)]

    def table(requests, qo):
        page_lists = [pages[i] for i in requests]
        return (indptr_from_lengths(qo), indptr_from_lengths([len(p) for p in page_lists]),
                np.concatenate(page_lists), pool.kv_last_page_len[requests])

    table_a, qo_a = table([0, 1], [1, 1]), 2
    table_b, qo_b = table([2, 3, 4], [1, 5, 1]), 7
    q_a = round_to_dtype(rng.standard_normal((qo_a, hq, d)), dtype)
    q_b = round_to_dtype(rng.standard_normal((qo_b, hq, d)), dtype)
    kc, vc = to_device(cp, pool.k_cache, dtype), to_device(cp, pool.v_cache, dtype)
    attn = attnlang.BatchAttention(variant, hq, hkv, d, dtype, ps, max_batch_size=4,
                                   max_total_q=16)
    q_buf = cp.zeros((16, hq, d), dtype=np.float16)
    out_buf = poisoned(cp, (16, hq, d), dtype)
    lse_buf = cp.zeros((16, hq), dtype=np.float32)
    cap = 20.0

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        assert attn.plan(*table_a).merge_count == 0
        q_buf[:qo_a] = cp.asarray(q_a.astype(np.float16))
        attn.run(q_buf[:qo_a], (kc, vc), {"cap": cap}, out=out_buf[:qo_a], lse=lse_buf[:qo_a])
        stream.synchronize()
        stream.begin_capture()
        attn.run(q_buf[:qo_a], (kc, vc), {"cap": cap}, out=out_buf[:qo_a], lse=lse_buf[:qo_a])
        graph = stream.end_capture()

        assert attn.plan(*table_b).merge_count > 0
        q_buf[:qo_b] = cp.asarray(q_b.astype(np.float16))
        out_buf.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        replayed = cp.asnumpy(out_buf[:qo_b]).copy()
        replayed_lse = cp.asnumpy(lse_buf[:qo_b]).copy()
        plain, plain_lse = attn.run(q_buf[:qo_b], (kc, vc), {"cap": cap}, return_lse=True)
        stream.synchronize()
    assert not np.isnan(replayed).any()
    assert np.array_equal(replayed.view(np.uint16), cp.asnumpy(plain).view(np.uint16))
    assert np.array_equal(replayed_lse, cp.asnumpy(plain_lse))
    ref, _ = attention_paged(variant, q_b, pool.k_cache, pool.v_cache, *table_b,
                             params={"cap": cap})
    assert rel_l2(replayed.astype(np.float32), ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_merge_waits_through_empty_launches(cp, kv_dtype):
    """Decode steps split across CTAs, in a graph that also holds the launches of kernels this
    plan leaves empty (the prefill kernel's; with an fp8 cache the conversion and the prefill
    over the copy too), between the decode kernel and the merge. Their idle CTAs return
    before waiting (machine.cuh's leaves_idle) but for each grid's first, so the merge still
    reads the partial states of this replay's decode: replays with two q's in turn each give
    the plain run's output of that q, bit for bit."""
    variant = attnlang.load(VARIANT_PATHS["causal"])
    hq, hkv, d, ps = 32, 8, 128, 16
    rng = np.random.default_rng(8)
    qo, kv = np.array([1, 1]), np.array([30000, 9000])
    batch = make_batch(rng, qo, kv, hq, hkv, d, ps, "bfloat16")
    extra = {}
    if kv_dtype == "fp8":  # e4m3 bytes, scales as device arrays
        kc = cp.asarray(to_e4m3(batch.k_cache * 20))
        vc = cp.asarray(to_e4m3(batch.v_cache * 20))
        scale = cp.full(hkv, 0.05, np.float32)
        extra = dict(k_scale=scale, v_scale=scale)
    else:
        kc, vc = (to_device(cp, x, "bfloat16") for x in (batch.k_cache, batch.v_cache))
    # a graph of this BatchAttention holds every kernel: prompts of 4096 queries reach the
    # prefill kernel and, with an fp8 cache, the converted copy; the steps' 4 rows go to the
    # decode kernel (a bf16 cache's default sends them to the prefill kernel)
    attn = attnlang.BatchAttention(variant, hq, hkv, d, "bf16", ps, kv_dtype=kv_dtype,
                                   max_batch_size=4, max_total_q=4096, prefill_min_rows=4)
    plan = attn.plan(*batch.table)
    assert plan.merge_count > 0 and plan.prefill.num_work_items == 0
    held = [kind for kind, one in attn._launches.items() if one in attn._capture_launches]
    assert held == (["decode", "prefill", "merge"] if kv_dtype is None else
                    ["decode", "prefill", "dequantize", "prefill_dequantized", "merge"])
    qs = [to_device(cp, round_to_dtype(rng.standard_normal((2, hq, d)), "bfloat16"),
                    "bfloat16") for _ in range(2)]
    plain = [cp.asnumpy(attn.run(q, (kc, vc), **extra)).copy() for q in qs]
    assert not np.array_equal(plain[0], plain[1])
    q_buf, nan = cp.empty_like(qs[0]), poisoned(cp, (2, hq, d), "bfloat16")
    out = nan.copy()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        q_buf[...] = qs[0]
        attn.run(q_buf, (kc, vc), out=out, **extra)  # warm up
        stream.begin_capture()
        attn.run(q_buf, (kc, vc), out=out, **extra)
        graph = stream.end_capture()
        for i in [0, 1] * 8:
            q_buf[...] = qs[i]
            out[...] = nan
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(cp.asnumpy(out), plain[i]), f"replay of q{i}"


# ---------------------------------------------------------------------------- determinism


def test_runs_and_plans_are_deterministic(cp):
    variant = attnlang.load(VARIANT_PATHS["gemma2_local"])
    rng = np.random.default_rng(5)
    qo, kv = np.array([1, 30, 1, 1]), np.array([1500, 900, 3, 700])
    batch = make_batch(rng, qo, kv, 16, 2, 128, 16, "bfloat16")
    q, kc, vc = (to_device(cp, x, "bfloat16") for x in (batch.q, batch.k_cache, batch.v_cache))
    attn = attnlang.BatchAttention(variant, 16, 2, 128, "bf16", 16, max_batch_size=4,
                                   max_total_q=64, max_work_items=4096,
                                   max_partial_rows=8192, max_merge_rows=4096)
    first = attn.plan(*batch.table, kv_chunk_size=200)
    assert first.merge_count > 0  # the long requests split
    out1, lse1 = attn.run(q, (kc, vc), return_lse=True)
    assert attn.plan(*batch.table, kv_chunk_size=200).same_as(first)
    out2, lse2 = attn.run(q, (kc, vc), return_lse=True)
    assert cp.array_equal(out1, out2) and cp.array_equal(lse1, lse2)


def test_saved_module_runs_like_the_variant(cp, tmp_path):
    from attnlang.runtime.module import compile_variant

    variant = attnlang.load(VARIANT_PATHS["qk_norm"])
    device_cc = cp.cuda.Device().compute_capability
    arch = "sm_90a" if device_cc == "90" else f"sm_{device_cc}"
    compile_variant(variant, head_dim=64, dtype="float16", arch=arch).save(tmp_path / "m")
    loaded = attnlang.load_compiled(tmp_path / "m")
    rng = np.random.default_rng(6)
    qo, kv = np.array([1, 3]), np.array([400, 20])
    batch = make_batch(rng, qo, kv, 4, 4, 64, 16, "float16")
    params = make_params(variant, rng, qo, kv, 4, 4, 64)
    q, kc, vc = (to_device(cp, x, "float16") for x in (batch.q, batch.k_cache, batch.v_cache))
    outs = []
    for source in (variant, loaded):
        attn = attnlang.BatchAttention(source, 4, 4, 64, "float16", 16, max_batch_size=4,
                                       max_total_q=16, arch=arch)
        attn.plan(*batch.table)
        outs.append(attn.run(q, (kc, vc), params))
    assert cp.array_equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="float16 head_dim 64.*bfloat16 head_dim 64"):
        attnlang.BatchAttention(loaded, 4, 4, 64, "bfloat16", 16)


def test_integer_edge_cases_match_the_reference(cp):
    # The rules of LANGUAGE.md section 9 the kernels implement with their own instructions:
    # int() of NaN and of huge floats (cvt.rzi saturates), shifts by counts outside 0..31,
    # and //, %, / and mod by a zero known only at run time.
    variant = attnlang.parse(
        "variant edges\nparam z: float = 0.0\nparam big: float = 1e30\nparam n: int = 0\n"
        "let s = q_pos % 40 - 3\n"
        "logits = logits + 1e-9 * (float(int(log(z - 1.0))) + float(int(big))"
        " + float(int(-big)) + float(q_pos << s))"
        " + 0.01 * float((-q_pos >> s) + q_pos // n + q_pos % n + q_pos / n + mod(q_pos, n)"
        " + (kv_pos - 9) // 4 + mod(kv_pos - 9, -4) + (kv_pos - 9) / 4 + (kv_pos - 9) % 4)\n"
        "mask = ((q_pos << s) & 7) != 5 and mod(kv_pos - 9, -4) != -2\n"
        "       and (kv_pos - 9) // 4 != -1\n")
    rng = np.random.default_rng(8)
    qo, kv = np.array([1, 40]), np.array([90, 60])
    batch = make_batch(rng, qo, kv, 4, 2, 64, 16, "bfloat16")
    q, kc, vc = (to_device(cp, x, "bfloat16") for x in (batch.q, batch.k_cache, batch.v_cache))
    attn = attnlang.BatchAttention(variant, 4, 2, 64, "bfloat16", 16)
    attn.plan(*batch.table)
    got = from_device(cp, attn.run(q, (kc, vc)), "bfloat16")
    ref, _ = attention_paged(variant, batch.q, batch.k_cache, batch.v_cache, *batch.table)
    assert rel_l2(got, ref) < 1e-2


# ---------------------------------------------------------------------------- validation


def test_bad_inputs_raise_before_any_launch(cp):
    variant = attnlang.load(VARIANT_PATHS["alibi"])
    rng = np.random.default_rng(8)
    qo, kv = np.array([1, 2]), np.array([50, 20])
    batch = make_batch(rng, qo, kv, 8, 2, 64, 16, "float16")
    attn = attnlang.BatchAttention(variant, 8, 2, 64, "float16", 16, max_batch_size=2,
                                   max_total_q=8)
    q, kc, vc = (to_device(cp, x, "float16") for x in (batch.q, batch.k_cache, batch.v_cache))
    slopes = cp.ones(8, dtype=cp.float32)
    with pytest.raises(RuntimeError, match="call plan"):
        attn.run(q, (kc, vc), {"slopes": slopes})
    attn.plan(*batch.table)
    out = poisoned(cp, q.shape, "float16")
    bad_calls = [
        (TypeError, "q has dtype float32", dict(q=q.astype(cp.float32))),
        (ValueError, "q must have shape", dict(q=q[:2])),
        (ValueError, "q must be contiguous", dict(q=cp.asfortranarray(q))),
        (TypeError, "q must be a device array", dict(q=cp.asnumpy(q))),
        (ValueError, "refers to page", dict(kv=(kc[:2], vc[:2]))),
        (TypeError, "v_cache has dtype", dict(kv=(kc, vc.astype(cp.float32)))),
        (ValueError, "missing param 'slopes'", dict(params={})),
        (ValueError, "unknown param 'slope'.*did you mean 'slopes'",
         dict(params={"slope": slopes})),
        (ValueError, r"param 'slopes' \(float\[heads\]\) must have shape \(8,\)",
         dict(params={"slopes": slopes[:4]})),
        (TypeError, "must be a float32 device array",
         dict(params={"slopes": slopes.astype(cp.float64)})),
        (TypeError, "lse must be float32", dict(lse=cp.zeros((3, 8), cp.float16))),
    ]
    for error, match, change in bad_calls:
        with pytest.raises(error, match=match):
            attn.run(change.get("q", q), change.get("kv", (kc, vc)),
                     change.get("params", {"slopes": slopes}), out=out,
                     lse=change.get("lse"))
    cp.cuda.get_current_stream().synchronize()
    assert cp.isnan(out).all(), "a failed call launched a kernel"
    # A plan that does not fit keeps the previous plan usable.
    from attnlang.runtime.planner import CapacityError

    with pytest.raises(CapacityError, match="max_batch_size"):
        attn.plan([0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2], [1, 1, 1])
    attn.run(q, (kc, vc), {"slopes": slopes}, out=out)
    assert not cp.isnan(out).any()


# ---------------------------------------------------------------------------- run()'s C path


def test_the_c_path_runs_layers_like_the_python_path(cp, monkeypatch, error_log):
    """A model's loop: one plan, then each layer's own q and cache. After the first call of a
    signature, calls go through hostpath.FastRun (describe_call is not reached); results
    equal the reference on every layer, with out= and without, on a side stream, after a
    re-plan, with CuPy arrays; bad calls still get the Python path's errors."""
    from attnlang.runtime import attention as attention_module
    from attnlang.runtime import hostpath

    if hostpath.load() is None:
        pytest.skip(f"no C path: {hostpath.unavailable_reason()}")
    torch = pytest.importorskip("torch")
    python_path_calls = []
    describe = attention_module.describe_call
    monkeypatch.setattr(attention_module, "describe_call",
                        lambda *a: python_path_calls.append(1) or describe(*a))
    variant = attnlang.load("examples/softcap.attn")
    rng = np.random.default_rng(21)
    qo, kv = np.array([1, 1, 3]), np.array([700, 33, 250])
    batch = make_batch(rng, qo, kv, 8, 2, 128, 16, "bfloat16")

    def like(x):
        return round_to_dtype(rng.standard_normal(x.shape).astype(np.float32), "bfloat16")

    # Three layers: one page table, each layer its own q and cache.
    layers = [(batch.q, batch.k_cache, batch.v_cache)] + [
        (like(batch.q), like(batch.k_cache), like(batch.v_cache)) for _ in range(2)]
    refs = [attention_paged(variant, *layer, *batch.table, params={"cap": 20.0})[0]
            for layer in layers]

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x)).to("cuda").to(torch.bfloat16)

    tensors = [tuple(t(x) for x in layer) for layer in layers]
    attn = attnlang.BatchAttention(variant, 8, 2, 128, torch.bfloat16, 16)

    def check(outs, label):
        torch.cuda.synchronize()
        for got, ref in zip(outs, refs, strict=True):
            err = rel_l2(got.float().cpu().numpy(), ref)
            error_log("bfloat16", err, f"C path {label}")
            assert err <= TOLERANCE["bfloat16"], label

    for replan in range(2):
        attn.plan(*batch.table)
        python_path_calls.clear()
        outs = [torch.full_like(q, float("nan")) for q, _, _ in tensors]
        for _ in range(2):
            fresh = [attn.run(q, (k, v), {"cap": 20.0}) for q, k, v in tensors]
            given = [attn.run(q, (k, v), {"cap": 20.0}, out=o)
                     for (q, k, v), o in zip(tensors, outs, strict=True)]
        check(fresh, f"plan {replan} new out")
        check(given, f"plan {replan} out=")
        assert len(python_path_calls) == 2, "the C path did not take the repeated calls"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        check([attn.run(q, (k, v), {"cap": 20.0}) for _ in range(2) for q, k, v in tensors][3:],
              "side stream")
    # Another param value or signature goes back to Python, and is right.
    python_path_calls.clear()
    q, k, v = tensors[0]
    other = attn.run(q, (k, v), {"cap": 5.0})
    ref5 = attention_paged(variant, *layers[0], *batch.table, params={"cap": 5.0})[0]
    torch.cuda.synchronize()
    assert rel_l2(other.float().cpu().numpy(), ref5) <= TOLERANCE["bfloat16"]
    assert python_path_calls == [1]
    # Bad calls after the C path took over: the Python path's errors, nothing launched.
    misaligned = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")[1:1 + q.numel()]
    poisoned_out = torch.full_like(q, float("nan"))
    for bad_q, error, match in ((q.float(), TypeError, "q has dtype float32"),
                                (q[:2], ValueError, "q must have shape"),
                                (misaligned.view(q.shape), ValueError, "16-byte boundary")):
        with pytest.raises(error, match=match):
            attn.run(bad_q, (k, v), {"cap": 20.0}, out=poisoned_out)
    torch.cuda.synchronize()
    assert poisoned_out.isnan().all()
    # CuPy arrays take the C path too (their attributes read in C).
    python_path_calls.clear()
    arrays = [tuple(to_device(cp, x, "bfloat16") for x in layer) for layer in layers]
    outs = [attn.run(q, (k, v), {"cap": 20.0}) for _ in range(2) for q, k, v in arrays][3:]
    for got, ref in zip(outs, refs, strict=True):
        assert rel_l2(from_device(cp, got, "bfloat16"), ref) <= TOLERANCE["bfloat16"]
    assert len(python_path_calls) == 1
