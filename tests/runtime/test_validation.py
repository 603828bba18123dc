"""Run-time input checks that need no GPU: BatchAttention construction, plan() and run()
inputs (validated on array descriptions before anything launches), the kernel argument
ABI against the rendered kernels, the workspace image, compiled-module directories,
merge_states' inputs, the paged-cache helpers and the bf16 helpers."""

import ctypes
import hashlib
import json
import re

import numpy as np
import pytest

import attnlang
from attnlang import ir
from attnlang.codegen.lower import lower
from attnlang.runtime import attention as A
from attnlang.runtime.arrays import (
    TensorInfo,
    bfloat16_bits_to_float,
    describe,
    float_to_bfloat16_bits,
    normalize_dtype,
    normalize_kv_dtype,
    round_to_dtype,
)
from attnlang.runtime.compiler import Cubin, FunctionInfo
from attnlang.runtime.merge import merge_states_reference, validate_merge_inputs
from attnlang.runtime.module import (
    KernelModule,
    ModuleLoadError,
    arch_runs_on,
    load_compiled,
)
from attnlang.runtime.paged import indptr_from_lengths, paged_to_ragged, ragged_to_paged
from attnlang.runtime.planner import CapacityError, PlanError, plan_batch
from attnlang.runtime.validate import validate_ragged_inputs
from tests.variant_files import VARIANT_FILES, VARIANT_IDS

SHAPE = A.validate_shape(8, 2, 64, "bf16", 16)
SOFTCAP = attnlang.parse("variant softcap\nparam cap: float = 30.0\n"
                         "logits = cap * tanh(logits / cap)\nmask = causal\n")
ALIBI = attnlang.parse("variant alibi\nparam slopes: float[heads]\n"
                       "logits = logits - slopes[head] * (q_pos - kv_pos)\nmask = causal\n")
MIXED = attnlang.parse(
    "variant mixed\nparam w: float[dim]\nparam prefix: int[batch]\nparam shift: int = 2\n"
    "param kvw: float[kv_heads]\n"
    "query = q * w[dim]\nvalue = v * kvw[kv_head]\n"
    "mask = kv_pos < prefix[batch] + shift or causal\n")


def plan_inputs(qo=(1, 3), kv=(20, 40), page_size=16, pages=None):
    """A valid PlanInputs: requests with qo/kv lengths, pages 0, 1, 2, ... in order."""
    counts = [-(-n // page_size) for n in kv]
    last = [n - (c - 1) * page_size if c else 0 for n, c in zip(kv, counts, strict=True)]
    indices = np.arange(sum(counts)) if pages is None else np.asarray(pages)
    return A.validate_plan_inputs(indptr_from_lengths(qo), indptr_from_lengths(counts),
                                  indices, last, page_size=page_size)


PLAN = plan_inputs()  # total_q 4, batch 2, pages 0..3


def dev(shape, dtype="bfloat16", **kw):
    return TensorInfo(tuple(shape), dtype, **kw)


def run_inputs(**overrides):
    """validate_run_inputs on a valid set of described arrays, with some replaced."""
    args = dict(
        shape=SHAPE, specs=SOFTCAP.params, plan=PLAN,
        q=dev((4, 8, 64)), kv_cache=(dev((10, 16, 2, 64)), dev((10, 16, 2, 64))),
        params=None, out=None, lse=None, sm_scale=None, variant_name="softcap",
    )
    args.update(overrides)
    return A.validate_run_inputs(args.pop("shape"), args.pop("specs"), args.pop("plan"),
                                 args.pop("q"), args.pop("kv_cache"), args.pop("params"),
                                 **args)


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize("args,error,match", [
    ((8, 3, 64, "bf16", 16), ValueError, "num_qo_heads .8. must be a multiple of num_kv_heads"),
    ((0, 1, 64, "bf16", 16), ValueError, "num_qo_heads must be a positive integer"),
    ((8, -2, 64, "bf16", 16), ValueError, "num_kv_heads"),
    ((8, 2.0, 64, "bf16", 16), TypeError, "num_kv_heads"),
    ((8, 2, 96, "bf16", 16), ValueError, "unsupported head_dim 96 with head_dim_vo 96: expected "
                                         "one of 64, 128, 256 for both, or 192/128"),
    ((8, 2, 192, "bf16", 16), ValueError, "unsupported head_dim 192 with head_dim_vo 192"),
    ((8, 2, 128, "bf16", 16, 64), ValueError, "unsupported head_dim 128 with head_dim_vo 64"),
    ((8, 2, True, "bf16", 16), ValueError, "head_dim"),
    ((8, 2, 64, "float32", 16), ValueError, "dtype must be float16 or bfloat16"),
    ((8, 2, 64, "bf16", 0), ValueError, "page_size"),
])
def test_shape_errors(args, error, match):
    with pytest.raises(error, match=match):
        A.validate_shape(*args)


def test_value_head_dim_shape():
    shape = A.validate_shape(8, 2, 192, "bf16", 16, head_dim_vo=128)
    assert (shape.head_dim, shape.head_dim_vo) == (192, 128)
    assert A.validate_shape(8, 2, 64, "bf16", 16).head_dim_vo == 64


def test_batch_attention_checks_arguments_before_touching_a_gpu():
    # These raise on a machine without a GPU (or CuPy), before any device call.
    with pytest.raises(ValueError, match="num_qo_heads"):
        attnlang.BatchAttention(SOFTCAP, num_qo_heads=6, num_kv_heads=4, head_dim=128)
    with pytest.raises(ValueError, match="head_dim"):
        attnlang.BatchAttention(SOFTCAP, num_qo_heads=8, num_kv_heads=4, head_dim=100)
    with pytest.raises(ValueError, match="dtype"):
        attnlang.BatchAttention(SOFTCAP, 8, 4, 128, dtype="int8")
    with pytest.raises(ValueError, match="max_total_q"):
        attnlang.BatchAttention(SOFTCAP, 8, 4, 128, max_total_q=0)
    with pytest.raises(TypeError, match="max_partial_rows"):
        attnlang.BatchAttention(SOFTCAP, 8, 4, 128, max_partial_rows=1.5)
    with pytest.raises(ValueError, match="max_qo_len must be a positive integer, got 0"):
        attnlang.BatchAttention(SOFTCAP, 8, 4, 128, max_qo_len=0)
    with pytest.raises(ValueError, match=r"max_qo_len \(65\) must not exceed max_total_q \(64\)"):
        attnlang.BatchAttention(SOFTCAP, 8, 4, 128, max_total_q=64, max_qo_len=65)
    with pytest.raises(ValueError, match="prefill_min_rows must be an integer >= 0, got -1"):
        attnlang.BatchAttention(SOFTCAP, 8, 4, 128, prefill_min_rows=-1)
    with pytest.raises(TypeError, match="prefill_min_rows"):
        attnlang.BatchAttention(SOFTCAP, 8, 4, 128, prefill_min_rows=2.5)
    with pytest.raises(TypeError, match="variant_or_module must be an attnlang Variant"):
        attnlang.BatchAttention("examples/softcap.attn", 8, 4, 128)
    with pytest.raises(TypeError, match="cascade must be True or False"):
        attnlang.BatchAttention(SOFTCAP, 8, 4, 128, cascade="yes")
    module = fake_module(dtype="float16", head_dim=128)
    with pytest.raises(ValueError, match="float16 head_dim 128.*bfloat16 head_dim 64"):
        attnlang.BatchAttention(module, 8, 4, 64, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"lacks the prefill, cascade kernel\(s\).*--cascade"):
        attnlang.BatchAttention(fake_module(dtype="bfloat16", head_dim=128), 8, 4, 128,
                                cascade=True)


@pytest.mark.parametrize("value,expected", [
    ("bf16", "bfloat16"), ("BF16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16"),
    ("half", "float16"), (np.float16, "float16"), (np.dtype("float16"), "float16"),
    ("torch.bfloat16", "bfloat16"),
])
def test_dtype_aliases(value, expected):
    assert normalize_dtype(value) == expected


# ---------------------------------------------------------------- plan() inputs


def test_plan_inputs_compute_kv_lengths():
    p = A.validate_plan_inputs([0, 1, 1, 4], [0, 3, 3, 4], [7, 2, 5, 0], [5, 0, 16],
                               page_size=16)
    assert p.kv_lens.tolist() == [37, 0, 16] and p.qo_lens.tolist() == [1, 0, 3]
    assert p.max_page == 7 and p.total_q == 4 and p.batch_size == 3
    for a in (p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len):
        assert a.dtype == np.int32 and a.flags.c_contiguous


@pytest.mark.parametrize("args,match", [
    (([0, 2, 1], [0, 1, 2], [0, 1], [1, 1]), r"qo_indptr must be non-decreasing"),
    (([1, 2], [0, 1], [0], [1]), r"qo_indptr must start at 0"),
    (([0, 1], [0, 2, 1], [0, 1], [1, 1]), r"kv_indptr must be non-decreasing"),
    (([0, 1, 2], [0, 1], [0], [1]), r"qo_indptr and kv_indptr must both have"),
    (([0, 1], [0, 1], [0], [1, 1]), r"kv_last_page_len must have one entry per request"),
    (([0, 1], [0, 2], [0], [1]), r"kv_indices must have kv_indptr\[-1\] = 2 entries"),
    (([0, 1], [0, 1], [-3], [1]), r"kv_indices must be page numbers.*kv_indices\[0\] = -3"),
    (([0, 1], [0, 1], [0], [0]), r"kv_last_page_len\[0\] = 0 must be in \[1, page_size=16\]"),
    (([0, 1], [0, 1], [0], [17]), r"kv_last_page_len\[0\] = 17"),
    (([0, 0], [0, 0], [], [17]), r"kv_last_page_len\[0\] = 17 must be 0 .it has no pages."),
    (([0, 5], [0, 1], [0], [4]), r"request 0 has 5 queries .qo_indptr. but only 4 KV tokens"),
    (([0, 1], [[0, 1]], [0], [1]), r"kv_indptr must be a 1-D array"),
    (([0.0, 1.0], [0, 1], [0], [1]), r"qo_indptr must hold integers"),
    (([], [0], [], []), r"qo_indptr must have batch_size \+ 1 >= 1 entries"),
])
def test_plan_input_errors(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        A.validate_plan_inputs(*args, page_size=16)


def test_empty_requests_may_carry_last_page_len_zero():
    p = A.validate_plan_inputs([0, 0, 1], [0, 0, 1], [3], [0, 1], page_size=16)
    assert p.kv_lens.tolist() == [0, 1]


# ---------------------------------------------------------------- run() inputs


def test_valid_run_inputs():
    r = run_inputs(params={"cap": 20})
    assert r.sm_scale == pytest.approx(1 / 8) and r.device == 0
    (spec, value), = r.params
    assert spec.name == "cap" and value == np.float32(20) and value.dtype == np.float32
    assert run_inputs().params[0][1] == np.float32(30.0)  # the default
    assert run_inputs(sm_scale=0.5).sm_scale == 0.5
    # CuPy without ml_dtypes carries bf16 as uint16 bits.
    q16 = dev((4, 8, 64), "uint16")
    k16 = dev((10, 16, 2, 64), "uint16")
    run_inputs(q=q16, kv_cache=(k16, k16))


@pytest.mark.parametrize("overrides,error,match", [
    (dict(q=dev((5, 8, 64))), ValueError, r"q must have shape \[total_q, num_qo_heads, "
                                          r"head_dim\] = \(4, 8, 64\), got \(5, 8, 64\)"),
    (dict(q=dev((4, 2, 64))), ValueError, r"q must have shape"),
    (dict(q=dev((4, 8, 64, 1))), ValueError, r"q must have shape"),
    (dict(q=dev((4, 8, 64), "float16")), TypeError, r"q has dtype float16 but this "
                                                    r"BatchAttention was built for bfloat16"),
    (dict(q=dev((4, 8, 64), "uint16", kind="torch")), TypeError, r"q has dtype uint16"),
    (dict(q=dev((4, 8, 64), strides=(1, 4, 32))), ValueError, r"q must be contiguous"),
    (dict(q=np.zeros((4, 8, 64), np.float16)), TypeError, r"q must be a device array.*NumPy"),
    (dict(q=None), TypeError, r"q is required"),
    (dict(q=[1, 2]), TypeError, r"q must be an array"),
    (dict(kv_cache=dev((10, 16, 2, 64))), TypeError, r"kv_cache must be a \(k_cache, v_cache\)"),
    (dict(kv_cache=(dev((10, 16, 2, 64)),) * 3), TypeError, r"kv_cache must be a"),
    (dict(kv_cache=(dev((10, 8, 2, 64)), dev((10, 8, 2, 64)))), ValueError,
     r"k_cache must have shape \[num_pages, page_size, num_kv_heads, head_dim\] = "
     r"\(N, 16, 2, 64\), got \(10, 8, 2, 64\)"),
    (dict(kv_cache=(dev((10, 16, 8, 64)), dev((10, 16, 8, 64)))), ValueError, r"k_cache must"),
    (dict(kv_cache=(dev((10, 16, 2, 64)), dev((11, 16, 2, 64)))), ValueError,
     r"v_cache must have shape .*the shape of k_cache"),
    (dict(kv_cache=(dev((10, 16, 2, 64), "float16"), dev((10, 16, 2, 64)))), TypeError,
     r"k_cache has dtype float16 but q has bfloat16"),
    (dict(kv_cache=(dev((10, 16, 2, 64)), dev((10, 16, 2, 64), strides=(2048, 1, 1024, 16)))),
     ValueError, r"v_cache must be contiguous"),
    (dict(kv_cache=(dev((3, 16, 2, 64)), dev((3, 16, 2, 64)))), ValueError,
     r"kv_indices .given to plan\(\). refers to page 4, but k_cache has only 3 pages"),
    (dict(kv_cache=(dev((10, 16, 2, 64), device=1), dev((10, 16, 2, 64), device=1))),
     ValueError, r"k_cache is on device 1 but q is on device 0"),
    (dict(out=dev((4, 8, 64), "float16")), TypeError, r"out has dtype float16 but q has"),
    (dict(out=dev((4, 8, 32))), ValueError, r"out must have shape"),
    (dict(lse=dev((4, 8), "float16")), TypeError, r"lse must be float32"),
    (dict(lse=dev((4, 2), "float32")), ValueError, r"lse must have shape \[total_q, "
                                                   r"num_qo_heads\] = \(4, 8\)"),
    (dict(lse=dev((4, 8), "float32", device=2)), ValueError, r"lse is on device 2"),
    (dict(sm_scale=True), TypeError, r"sm_scale must be a number"),
    (dict(sm_scale="0.1"), TypeError, r"sm_scale must be a number"),
    (dict(sm_scale=float("nan")), ValueError, r"sm_scale must be finite"),
])
def test_run_input_errors(overrides, error, match):
    with pytest.raises(error, match=match):
        run_inputs(**overrides)


RAGGED = A.validate_shape(8, 2, 64, "bf16", None, kv_layout="ragged")


def test_a_ragged_layout_is_pages_of_one_identity_token():
    # request b's keys are rows kv_indptr[b]:kv_indptr[b+1] of k and v
    plan = A.validate_batch(RAGGED, [0, 3, 3, 4], [0, 10, 10, 15], None, None)
    assert RAGGED.page_size == 1 and RAGGED.ragged
    assert plan.kv_lens.tolist() == [10, 0, 5]
    assert plan.kv_indices.tolist() == list(range(15))
    assert plan.kv_last_page_len.tolist() == [1, 0, 1] and plan.max_page == 14
    args = dict(shape=RAGGED, specs=SOFTCAP.params, inputs=plan, q=dev((4, 8, 64)))
    A.validate_run_inputs(kv_cache=(dev((15, 2, 64)), dev((15, 2, 64))), **args)
    A.validate_run_inputs(kv_cache=(dev((20, 2, 64)), dev((20, 2, 64))), **args)
    with pytest.raises(ValueError, match=r"k_cache must have shape \[total_kv, num_kv_heads, "
                                         r"head_dim\] = \(N, 2, 64\), got \(15, 1, 2, 64\)"):
        A.validate_run_inputs(kv_cache=(dev((15, 1, 2, 64)),) * 2, **args)
    with pytest.raises(ValueError, match=r"kv_indptr .given to plan\(\). spans 15 rows of k and "
                                         r"v, but k_cache has only 14"):
        A.validate_run_inputs(kv_cache=(dev((14, 2, 64)),) * 2, **args)


@pytest.mark.parametrize("qo, rows", [([3, 0, 1], [10, 0, 5]), ([1], [1]), ([0, 0], [0, 0]),
                                      ([700, 1, 130, 9], [1089, 1900, 130, 33])])
def test_ragged_inputs_are_the_identity_tables(qo, rows):
    # built without scanning the table: the same arrays validate_plan_inputs returns for it
    got = validate_ragged_inputs(indptr_from_lengths(qo), indptr_from_lengths(rows))
    want = A.validate_plan_inputs(indptr_from_lengths(qo), indptr_from_lengths(rows),
                                  np.arange(sum(rows)), (np.asarray(rows) > 0).astype(int),
                                  page_size=1)
    for field in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "qo_lens",
                  "kv_lens"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and np.array_equal(a, b), field
    assert got.max_page == want.max_page


@pytest.mark.parametrize("call, error, match", [
    (lambda: A.validate_shape(8, 2, 64, "bf16", 16, kv_layout="ragged"), ValueError,
     r"page_size=16 with kv_layout='ragged': a ragged layout has no pages"),
    (lambda: A.validate_shape(8, 2, 64, "bf16", 16, kv_layout="contiguous"), ValueError,
     r"kv_layout must be one of \('paged', 'ragged'\)"),
    (lambda: A.validate_batch(RAGGED, [0, 3], [0, 10], [0], [1]), TypeError,
     r"kv_layout is 'ragged': plan\(qo_indptr, kv_indptr\) takes no kv_indices"),
    (lambda: A.validate_batch(SHAPE, [0, 3], [0, 1], None, None), TypeError,
     r"plan\(\) of a paged cache takes qo_indptr, kv_indptr, kv_indices and kv_last_page_len"),
    (lambda: A.validate_batch(RAGGED, [0, 3, 9], [0, 10, 12], None, None), PlanError,
     r"request 1 has 6 queries .qo_indptr. but only 2 rows of k and v"),
    (lambda: A.validate_batch(RAGGED, [0, 3], [0, 10, 12], None, None), PlanError,
     r"qo_indptr and kv_indptr must both have batch_size \+ 1 entries"),
    (lambda: A.validate_batch(RAGGED, [0, 3], [4, 2], None, None), PlanError, r"kv_indptr"),
])
def test_ragged_layout_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


MLA_SHAPE = A.validate_shape(8, 2, 192, "bf16", 16, head_dim_vo=128)


def test_run_inputs_with_a_value_head_dim():
    # MLA: q and k_cache of 192, v_cache and out of 128; a dim table of the output stage is
    # as long as the values (dim_sizes, from the compiled module).
    gate = attnlang.parse("variant g\nparam w: float[dim]\noutput = o * w[dim]\n")
    sizes = ir.extent_sizes(gate, 8, 2, 2, 192, 128)
    assert sizes["w"]["dim"] == 128
    r = run_inputs(shape=MLA_SHAPE, specs=gate.params, q=dev((4, 8, 192)),
                   kv_cache=(dev((10, 16, 2, 192)), dev((10, 16, 2, 128))),
                   out=dev((4, 8, 128)), params={"w": np.ones(128)},
                   dim_sizes={"w": sizes["w"]["dim"]})
    assert r.sm_scale == pytest.approx(192 ** -0.5)
    with pytest.raises(ValueError, match=r"v_cache must have shape \[num_pages, page_size, "
                                         r"num_kv_heads, head_dim_vo\] = \(10, 16, 2, 128\)"):
        run_inputs(shape=MLA_SHAPE, q=dev((4, 8, 192)),
                   kv_cache=(dev((10, 16, 2, 192)), dev((10, 16, 2, 192))))
    with pytest.raises(ValueError, match=r"out must have shape \[total_q, num_qo_heads, "
                                         r"head_dim_vo\] = \(4, 8, 128\)"):
        run_inputs(shape=MLA_SHAPE, q=dev((4, 8, 192)), out=dev((4, 8, 192)),
                   kv_cache=(dev((10, 16, 2, 192)), dev((10, 16, 2, 128))))
    with pytest.raises(ValueError, match=r"param 'w' \(float\[dim\]\) must have shape \(128,\)"):
        run_inputs(shape=MLA_SHAPE, specs=gate.params, q=dev((4, 8, 192)),
                   kv_cache=(dev((10, 16, 2, 192)), dev((10, 16, 2, 128))),
                   params={"w": np.ones(192)}, dim_sizes={"w": 128})


def test_a_dim_table_read_at_both_head_dims_is_refused():
    both = attnlang.parse("variant b\nparam w: float[dim]\nquery = q * w[dim]\n"
                          "value = v * w[dim]\n")
    assert ir.extent_sizes(both, 8, 2, 1, 128, 128)["w"]["dim"] == 128
    with pytest.raises(ValueError, match=r"param 'w' \(float\[dim\]\) is read in the query, "
                                         r"value stages, whose vectors are 192 \(query, key\) "
                                         r"and 128 \(value, output\) long"):
        ir.extent_sizes(both, 8, 2, 1, 192, 128)


@pytest.mark.parametrize("specs,params,error,match", [
    (SOFTCAP.params, {"cpa": 3.0}, ValueError,
     r"unknown param 'cpa' for variant softcap; did you mean 'cap'\? \(its params: cap\)"),
    ((), {"cap": 3.0}, ValueError, r"unknown param 'cap': variant softcap takes no params"),
    (SOFTCAP.params, {"cap": "30"}, TypeError, r"param 'cap' \(float = 30.0\) must be a number"),
    (SOFTCAP.params, {"cap": True}, TypeError, r"param 'cap'.*must be a number, got bool"),
    (SOFTCAP.params, [30.0], TypeError, r"params must be a dict"),
    (ALIBI.params, {}, ValueError, r"missing param 'slopes' \(float\[heads\]\) of variant "
                                   r"softcap: pass params=\{'slopes': ...\}"),
    (ALIBI.params, {"slopes": np.ones(4)}, ValueError,
     r"param 'slopes' \(float\[heads\]\) must have shape \(8,\) \(heads = 8: one value per "
     r"query head\), got \(4,\)"),
    (ALIBI.params, {"slopes": np.ones((8, 1))}, ValueError, r"must have shape \(8,\)"),
    (ALIBI.params, {"slopes": 0.5}, TypeError, r"param 'slopes'.*got a scalar"),
    (ALIBI.params, {"slopes": dev((8,), "float64")}, TypeError,
     r"param 'slopes' \(float\[heads\]\) must be a float32 device array, got float64"),
    (ALIBI.params, {"slopes": dev((8,), "float32", device=3)}, ValueError,
     r"param 'slopes'.*is on device 3"),
    (ALIBI.params, {"slopes": np.array(["a"] * 8)}, TypeError, r"must hold real numbers"),
    (MIXED.params, {"w": np.ones(64), "prefix": [1, 2], "kvw": np.ones(2), "shift": 1.5},
     TypeError, r"param 'shift' \(int = 2\) must be an integer"),
    (MIXED.params, {"w": np.ones(64), "prefix": [1, 2], "kvw": np.ones(2), "shift": 2**40},
     ValueError, r"param 'shift'.*must fit in int32"),
    (MIXED.params, {"w": np.ones(64), "prefix": [1.0, 2.0], "kvw": np.ones(2)}, TypeError,
     r"param 'prefix' \(int\[batch\]\) must hold integers"),
    (MIXED.params, {"w": np.ones(64), "prefix": [1, 2, 3], "kvw": np.ones(2)}, ValueError,
     r"param 'prefix' \(int\[batch\]\) must have shape \(2,\) \(batch = 2: one value per "
     r"request\)"),
    (MIXED.params, {"w": np.ones(32), "prefix": [1, 2], "kvw": np.ones(2)}, ValueError,
     r"param 'w' \(float\[dim\]\) must have shape \(64,\)"),
    (MIXED.params, {"w": np.ones(64), "prefix": [1, 2], "kvw": np.ones(8)}, ValueError,
     r"param 'kvw' \(float\[kv_heads\]\) must have shape \(2,\) \(kv_heads = 2: one value per "
     r"KV head\)"),
    (MIXED.params, {"w": np.ones(64), "prefix": dev((2,), "int64"), "kvw": np.ones(2)},
     TypeError, r"param 'prefix'.*must be a int32 device array, got int64"),
])
def test_param_errors(specs, params, error, match):
    with pytest.raises(error, match=match):
        run_inputs(specs=specs, params=params)


def test_params_resolve_in_declaration_order():
    dev_w = dev((64,), "float32", ptr=1234)
    r = run_inputs(specs=MIXED.params,
                   params={"kvw": [0.5, 2], "prefix": np.array([3, 4], np.int64), "w": dev_w})
    names = [s.name for s, _ in r.params]
    assert names == ["w", "prefix", "shift", "kvw"]
    w, prefix, shift, kvw = (v for _, v in r.params)
    assert w is dev_w
    assert prefix.dtype == np.int32 and prefix.tolist() == [3, 4]
    assert shift == np.int32(2) and isinstance(shift, np.int32)
    assert kvw.dtype == np.float32 and kvw.tolist() == [0.5, 2.0]


# ---------------------------------------------------------------- kernel ABI


def _entry_signature(source: str, kind: str) -> list[str]:
    """The parameter declarations of the rendered `extern "C"` entry named `kind`."""
    start = source.index('extern "C"')
    m = re.compile(r"\b" + kind + r"\s*\(").search(source, start)
    assert m, f"no extern C {kind} entry"
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        i += 1
    return [p.strip() for p in source[m.end():i - 1].split(",")]


def _arg_kind(decl: str) -> type:
    if "*" in decl:
        return np.uint64
    return np.float32 if re.match(r"(const\s+)?float\b", decl) else np.int32


@pytest.mark.parametrize("path", VARIANT_FILES, ids=VARIANT_IDS)
@pytest.mark.parametrize("kind", ["decode", "prefill", "merge", "cascade"])
def test_kernel_args_match_the_rendered_entry(path, kind):
    from attnlang.pipeline import generate_source

    variant = attnlang.load(path)
    if kind == "cascade" and lower(variant).kv_reads_request:
        # Keys that depend on their request are not shared by a prefix's requests.
        with pytest.raises(ValueError, match="has no cascade kernel: its key or value hook"):
            generate_source(variant, kind, "bfloat16", 128)
        return
    source = generate_source(variant, kind, "bfloat16", 128)
    decls = _entry_signature(source, kind)
    values, ws = _launch_inputs(variant, np.int32(1), np.float32(1))
    args = A.kernel_args(kind, q=1, k_cache=2, v_cache=3, out=4, lse=5, ws=ws, num_heads=8,
                         num_kv_heads=2, page_size=16, sm_scale=0.125, params=values)
    assert len(args) == len(decls), (decls, args)
    for decl, arg in zip(decls, args, strict=True):
        assert type(arg) is _arg_kind(decl), (decl, arg)
    named = dict(zip([re.findall(r"\w+", d)[-1] for d in decls], args, strict=True))
    assert named["sm_scale"] == np.float32(0.125) and named["page_size"] == 16
    assert named["out"] == 4 and named["partial_lse"] == ws["partial_lse"]
    if kind == "decode":
        assert named["q"] == 1 and named["work_partial"] == ws["work_partial"]
    elif kind == "prefill":  # the same arguments, its own work list, the tensor maps
        assert named["q"] == 1 and named["work_partial"] == ws["prefill_work_partial"]
        assert named["work_indptr"] == ws["prefill_work_indptr"]
        assert named["tma_maps"] == ws["tma_maps"]
    elif kind == "cascade":  # prefill's, its own work list and two arrays more
        assert named["q"] == 1 and named["work_partial"] == ws["cascade_work_partial"]
        assert named["work_indptr"] == ws["cascade_work_indptr"]
        assert named["cascade_item"] == ws["cascade_item"]
        assert named["token_request"] == ws["token_request"]
        assert named["tma_maps"] == ws["tma_maps"]
    else:
        assert named["merge_count"] == ws["merge_count"]
        assert named["merge_slots"] == ws["merge_slots"]


def _launch_inputs(variant, int_value, float_value):
    """(params, ws) for kernel_args: each param a fake device tensor or the given scalar, the
    workspace sections at made-up addresses."""
    values = []
    for i, spec in enumerate(variant.params):
        if spec.is_tensor:
            values.append((spec, dev((4,), "float32", ptr=1000 + i)))
        else:
            values.append((spec, int_value if spec.type is ir.INT else float_value))
    ws = {name: 10_000 + i for i, name in enumerate([*A._SECTIONS, "partial_o",
                                                     "partial_lse", "tma_maps"])}
    return values, ws


@pytest.mark.parametrize("path", VARIANT_FILES, ids=VARIANT_IDS)
def test_packed_args_equal_kernel_args(path):
    """run()'s packed kernelParams slots, after a call's update, hold exactly kernel_args'
    tuple (types and values), and a second update leaves nothing of the first behind."""
    values, ws = _launch_inputs(attnlang.load(path), np.int32(3), np.float32(2.5))
    for kind in ("decode", "prefill", "merge", "cascade"):
        packed = A.PackedArgs(kind, ws, num_heads=8, num_kv_heads=2, page_size=16,
                              num_params=len(values))
        packed.update(1 << 40, 2, 3, 4, 5, -7.5, values)  # overwritten below
        packed.update(11, 12, 13, 14, 15, 0.3, values)
        want = A.kernel_args(kind, q=11, k_cache=12, v_cache=13, out=14, lse=15, ws=ws,
                             num_heads=8, num_kv_heads=2, page_size=16, sm_scale=0.3,
                             params=values)
        got = packed.values()
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert type(a) is type(b) and a == b, (kind, a, b)
        # kernelParams[i] is the address of slot i
        pointers = np.frombuffer((ctypes.c_uint64 * len(want)).from_address(
            packed.kernel_params), dtype=np.uint64)
        assert (np.diff(pointers) == 8).all()


def test_call_key_tracks_everything_but_addresses():
    """run() reuses a validation for calls that differ only in their arrays' addresses (a
    new q, another layer's cache); any other change is validated anew."""
    def key(*args):
        described = A.describe_call(*args)
        return None if described is None else described[0]

    q, k, v = dev((4, 8, 64), "bfloat16"), dev((9, 16, 2, 64), "bfloat16"), dev(
        (9, 16, 2, 64), "bfloat16", ptr=64)
    cap = 30.0
    base = key(q, (k, v), {"cap": cap}, None, None, None)
    assert base is not None
    assert key(q, (k, v), {"cap": cap}, None, None, None) == base
    # another layer: same descriptions at other addresses
    moved = [dev(x.shape, x.dtype, ptr=x.ptr + (1 << 30)) for x in (q, k, v)]
    assert key(moved[0], (moved[1], moved[2]), {"cap": cap}, None, None, None) == base
    assert key(q, [k, v], {"cap": cap}, None, None, None) == base
    for changed in (
            key(dev((5, 8, 64), "bfloat16"), (k, v), {"cap": cap}, None, None, None),
            key(dev((4, 8, 64), "float16"), (k, v), {"cap": cap}, None, None, None),
            key(dev((4, 8, 64), "bfloat16", device=1), (k, v), {"cap": cap}, None, None, None),
            key(dev((4, 8, 64), "bfloat16", strides=(512, 1, 8)), (k, v), {"cap": cap},
                None, None, None),
            key(q, (dev((10, 16, 2, 64), "bfloat16"), v), {"cap": cap}, None, None, None),
            key(q, (k, v), {"cap": 31.0}, None, None, None),
            key(q, (k, v), {"cap": 30}, None, None, None),
            key(q, (k, v), {"cap": cap}, dev((4, 8, 64), "bfloat16"), None, None),
            key(q, (k, v), {"cap": cap}, None, dev((4, 8), "float32"), None),
            key(q, (k, v), {"cap": cap}, None, None, 0.5)):
        assert changed != base
    assert key(q, (k, v), None, None, None, True) != key(q, (k, v), None, None, None, 1)
    assert key(q, (k, v), {"w": True}, None, None, None) != key(q, (k, v), {"w": 1}, None,
                                                                  None, None)
    slopes = dev((8,), "float32")
    assert key(q, (k, v), {"s": slopes}, None, None, None) == key(
        q, (k, v), {"s": dev((8,), "float32", ptr=4096)}, None, None, None)
    assert key(q, (k, v), {"s": slopes}, None, None, None) != key(
        q, (k, v), {"s": dev((8,), "int32")}, None, None, None)
    # host-array params (contents may change), odd kv_cache or params, host q: in full
    assert key(q, (k, v), {"s": np.ones(8)}, None, None, None) is None
    assert key(q, (k, v), {"s": [1.0] * 8}, None, None, None) is None
    assert key(q, k, None, None, None, None) is None
    assert key(q, (k, v), [("cap", 1.0)], None, None, None) is None
    assert key(np.zeros((4, 8, 64)), (k, v), None, None, None, None) is None
    # the pointers come along: q, k_cache, v_cache, out, lse (0 where absent), tensor params
    _, pointers, tensor_ptrs = A.describe_call(q, (k, v), {"s": dev((8,), "float32", ptr=96)},
                                               None, dev((4, 8), "float32", ptr=32), None)
    assert pointers == (q.ptr, k.ptr, v.ptr, 0, 32) and tensor_ptrs == {"s": 96}


def test_kernel_args_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown kernel kind"):
        A.kernel_args("encode", q=0, k_cache=0, v_cache=0, out=0, lse=0, ws={}, num_heads=1,
                      num_kv_heads=1, page_size=1, sm_scale=1.0, params=())


# ---------------------------------------------------------------- workspace image


def test_workspace_image_holds_the_plan_at_fixed_offsets():
    from attnlang.runtime.planner import worst_case_bounds

    bounds = worst_case_bounds(max_batch_size=8, max_total_q=64, num_kv_heads=2, group_size=4,
                               rows_per_tile=4, num_ctas=10)
    layout = A.workspace_layout(10, bounds, 512)
    starts = sorted((layout.offsets[n], n) for n in A._SECTIONS)
    for (a, name), (b, _) in zip(starts, starts[1:] + [(layout.total, "end")], strict=True):
        assert a % 32 == 0 and b - a >= layout.capacity[name]
    assert starts[-1][1] == "kv_indices"

    inputs = plan_inputs(qo=(1, 3, 0), kv=(700, 40, 5), pages=None)
    plan = plan_batch(inputs.qo_lens, inputs.kv_lens, num_kv_heads=2, group_size=4,
                      rows_per_tile=4, num_ctas=10, kv_chunk_size=128, bounds=bounds)
    assert plan.merge_count > 0
    host = np.full(layout.total, -7, dtype=np.int32)
    n = A.fill_workspace(layout, host, plan, inputs)
    assert n == layout.offsets["kv_indices"] + inputs.kv_indices.shape[0]
    arrays = {**plan.work_arrays(), **plan.merge_arrays(), "qo_indptr": inputs.qo_indptr,
              "kv_indptr": inputs.kv_indptr, "kv_indices": inputs.kv_indices,
              "kv_last_page_len": inputs.kv_last_page_len,
              "merge_count": np.array([plan.merge_count])}
    for name, a in arrays.items():
        start = layout.offsets[name]
        assert np.array_equal(host[start:start + a.shape[0]], a), name


def test_page_table_capacity_error_names_the_bound():
    e = CapacityError("max_kv_indices", 2000, 1000, "page-table entries (kv_indices)")
    assert "max_kv_indices=2000" in str(e) and "BatchAttention" in str(e)
    e = CapacityError("max_qo_len", 2, 1, "queries in one request")
    assert "needs 2 queries in one request" in str(e) and "max_qo_len=2" in str(e)


# ---------------------------------------------------------------- compiled modules


def fake_cubin(data: bytes) -> Cubin:
    return Cubin(data=data, arch="sm_90a", key="k", log="", compile_seconds=0.5,
                 functions=(FunctionInfo("decode", 96, 0, 0, 0, 0),), cache="miss", path=None)


def fake_module(dtype="bfloat16", head_dim=128, **kw):
    fields = dict(name="softcap", params=SOFTCAP.params, softmax=True, dtype=dtype,
                  head_dim=head_dim, arch="sm_90a",
                  cubins={"decode": fake_cubin(b"\x7fELF decode"),
                          "merge": fake_cubin(b"\x7fELF merge")},
                  entries={"decode": "decode", "merge": "merge"}, nvrtc_version="12.9")
    fields.update(kw)
    return KernelModule(**fields)


def test_module_round_trip(tmp_path):
    module = fake_module(params=MIXED.params, softmax=False)
    module.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["cubins"]["decode"]["sha256"] == hashlib.sha256(b"\x7fELF decode").hexdigest()
    assert manifest["variant"]["params"][2] == {"name": "shift", "type": "int",
                                                "extents": [], "default": 2}
    loaded = load_compiled(tmp_path / "m")
    assert loaded.params == module.params and loaded.softmax is False
    assert {k: c.data for k, c in loaded.cubins.items()} == {
        k: c.data for k, c in module.cubins.items()}
    assert loaded.cubins["decode"].functions == module.cubins["decode"].functions
    merge = loaded.cubins["merge"]
    assert merge.cache == "loaded" and merge.compile_seconds == 0.5
    assert (loaded.dtype, loaded.head_dim, loaded.arch) == ("bfloat16", 128, "sm_90a")
    assert loaded.head_dim_vo == 128
    assert loaded.label("decode") == "softcap/decode bf16 d128 sm_90a"


def test_module_round_trip_of_head_dims(tmp_path):
    module = fake_module(head_dim=192, head_dim_vo=128, params=MIXED.params,
                         param_dims={"w": 192})
    module.save(tmp_path / "m")
    loaded = load_compiled(tmp_path / "m")
    assert (loaded.head_dim, loaded.head_dim_vo, dict(loaded.param_dims)) == (192, 128, {"w": 192})
    assert loaded.label("merge") == "softcap/merge bf16 d192/128 sm_90a"
    with pytest.raises(ValueError, match=r"bfloat16 head_dim 192/128 \(query-key/value\), cache "
                                         r"bfloat16, but this BatchAttention asks for bfloat16 "
                                         r"head_dim 128/128"):
        attnlang.BatchAttention(loaded, 8, 2, 128)


# ---------------------------------------------------------------- fp8 KV caches


@pytest.mark.parametrize("value", ["fp8", "e4m3", "float8_e4m3fn", "torch.float8_e4m3fn",
                                   "FP8_E4M3"])
def test_kv_dtype_aliases(value):
    assert normalize_kv_dtype(value, "bfloat16") == "float8_e4m3fn"
    assert normalize_kv_dtype(None, "float16") == "float16"
    assert normalize_kv_dtype("bf16", "bfloat16") == "bfloat16"


@pytest.mark.parametrize("value", ["fp16", "int8", "float8_e5m2", 3])
def test_kv_dtype_refused(value):
    with pytest.raises(ValueError, match=r"kv_dtype must be q's dtype \(bfloat16\) or "
                                         r"float8_e4m3fn"):
        normalize_kv_dtype(value, "bfloat16")


FP8 = A.validate_shape(8, 2, 64, "bf16", 16, kv_dtype="fp8")


def test_fp8_cache_arrays():
    specs = attnlang.ir.with_kv_scales(SOFTCAP).params
    scales = {"k_scale": dev((2,), "float32"), "v_scale": dev((2,), "float32"), "cap": 30.0}
    for cache_dtype in ("float8_e4m3fn", "uint8"):
        cache = dev((10, 16, 2, 64), cache_dtype)
        got = run_inputs(shape=FP8, specs=specs, kv_cache=(cache, cache), params=scales)
        assert got.k_cache.dtype == cache_dtype
    with pytest.raises(TypeError, match=r"k_cache has dtype bfloat16 but this BatchAttention "
                                        r"was built for an fp8 cache"):
        run_inputs(shape=FP8, specs=specs, params=scales)
    cache = dev((10, 16, 2, 64), "float8_e4m3fn")
    with pytest.raises(TypeError, match=r"q has dtype float8_e4m3fn .*only the KV cache may be "
                                        r"fp8"):
        run_inputs(shape=FP8, specs=specs, q=dev((4, 8, 64), "float8_e4m3fn"),
                   kv_cache=(cache, cache), params=scales)
    with pytest.raises(TypeError, match=r"out has dtype float8_e4m3fn .*only the KV cache"):
        run_inputs(shape=FP8, specs=specs, kv_cache=(cache, cache), params=scales,
                   out=dev((4, 8, 64), "float8_e4m3fn"))
    with pytest.raises(TypeError, match=r"kv_dtype='fp8'"):
        run_inputs(kv_cache=(cache, cache))  # a bf16 BatchAttention given an fp8 cache


def test_fp8_scale_params():
    v = attnlang.ir.with_kv_scales(SOFTCAP)
    assert [p.declared for p in v.params] == ["float", "float[kv_heads]", "float[kv_heads]"]
    assert attnlang.ir.with_kv_scales(v) is v
    clash = attnlang.parse("variant c\nparam k_scale: float = 2.0\nlogits = logits * k_scale\n")
    with pytest.raises(ValueError, match=r"declares param 'k_scale', a name an fp8 KV cache "
                                         r"gives its dequantisation scales"):
        attnlang.ir.with_kv_scales(clash)


def test_fp8_module_round_trip(tmp_path):
    module = fake_module(kv_dtype="float8_e4m3fn",
                         params=attnlang.ir.with_kv_scales(SOFTCAP).params)
    assert module.label("decode") == "softcap/decode bf16 fp8 KV d128 sm_90a"
    module.save(tmp_path / "m")
    loaded = load_compiled(tmp_path / "m")
    assert loaded.kv_dtype == "float8_e4m3fn" and loaded.params == module.params
    assert not loaded.decode_mma
    tensor_cores = fake_module(kv_dtype="float8_e4m3fn", params=module.params, decode_mma=True)
    tensor_cores.save(tmp_path / "t")
    assert load_compiled(tmp_path / "t").decode_mma  # the launches follow the saved kernel
    with pytest.raises(ValueError, match=r"cache float8_e4m3fn, but this BatchAttention asks "
                                         r"for bfloat16 head_dim 128/128, cache bfloat16"):
        attnlang.BatchAttention(loaded, 8, 2, 128)
    # manifests written before fp8 caches: the dtype's own cache
    path = tmp_path / "m" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["kv_dtype"]
    path.write_text(json.dumps(manifest))
    assert load_compiled(tmp_path / "m").kv_dtype == "bfloat16"


def test_module_round_trip_of_tables_and_old_manifests(tmp_path):
    tables = attnlang.parse("variant t\nparam bias: float[heads, 32]\n"
                            "param seen: bool[batch, 64]\nlogits = logits + bias[head, 3]\n"
                            "mask = seen[batch, kv_pos]\n")
    fake_module(params=tables.params).save(tmp_path / "t")
    assert load_compiled(tmp_path / "t").params == tables.params
    # A manifest written before tables: one optional named "extent" per param.
    fake_module(params=MIXED.params).save(tmp_path / "old")
    path = tmp_path / "old" / "manifest.json"
    manifest = json.loads(path.read_text())
    for p in manifest["variant"]["params"]:
        extents = p.pop("extents")
        p["extent"] = extents[0] if extents else None
    path.write_text(json.dumps(manifest))
    assert load_compiled(tmp_path / "old").params == MIXED.params


def test_module_load_errors(tmp_path):
    with pytest.raises(ModuleLoadError, match="manifest.json is missing"):
        load_compiled(tmp_path)
    fake_module().save(tmp_path / "m")
    (tmp_path / "m" / "merge.cubin").write_bytes(b"tampered")
    with pytest.raises(ModuleLoadError, match="merge.cubin is corrupt: its sha256"):
        load_compiled(tmp_path / "m")
    fake_module().save(tmp_path / "m")
    manifest_path = tmp_path / "m" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["attnlang_version"] = "0.0.1"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ModuleLoadError, match="compiled by attnlang 0.0.1"):
        load_compiled(tmp_path / "m")
    assert load_compiled(tmp_path / "m", check_version=False).name == "softcap"
    del manifest["dtype"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ModuleLoadError, match="malformed"):
        load_compiled(tmp_path / "m", check_version=False)
    manifest_path.write_text("{not json")
    with pytest.raises(ModuleLoadError, match="cannot read"):
        load_compiled(tmp_path / "m")


@pytest.mark.parametrize("arch,device,ok", [
    ("sm_90a", "sm_90", True), ("sm_90a", "sm_100", False), ("sm_80", "sm_86", True),
    ("sm_86", "sm_80", False), ("sm_80", "sm_90", False), ("sm_90", "sm_90", True),
    ("sm_100a", "sm_100", True), ("bogus", "sm_90", False),
])
def test_arch_compatibility(arch, device, ok):
    assert arch_runs_on(arch, device) is ok


# ---------------------------------------------------------------- merge_states


def test_merge_states_input_errors():
    o, lse = dev((3, 2, 64), "float16"), dev((3, 2), "float32")
    assert validate_merge_inputs(o, lse, o, lse)[-1] == "float16"
    assert validate_merge_inputs(dev((3, 2, 64), "uint16"), lse,
                                 dev((3, 2, 64), "uint16"), lse)[-1] == "bfloat16"
    with pytest.raises(ValueError, match=r"o_b must have the shape of o_a"):
        validate_merge_inputs(o, lse, dev((3, 2, 32), "float16"), lse)
    with pytest.raises(TypeError, match=r"o_b has dtype float32 but o_a has float16"):
        validate_merge_inputs(o, lse, dev((3, 2, 64), "float32"), lse)
    with pytest.raises(TypeError, match=r"lse_b must be float32"):
        validate_merge_inputs(o, lse, o, dev((3, 2), "float16"))
    with pytest.raises(ValueError, match=r"lse_a must have shape \[N, num_heads\]"):
        validate_merge_inputs(o, dev((3,), "float32"), o, lse)
    with pytest.raises(TypeError, match=r"o_a must be a device array"):
        validate_merge_inputs(np.zeros((3, 2, 64)), lse, o, lse)
    with pytest.raises(TypeError, match=r"o_a must be float16, bfloat16 or float32"):
        validate_merge_inputs(dev((3, 2, 64), "int32"), lse, dev((3, 2, 64), "int32"), lse)


def test_merge_states_reference_recovers_the_full_softmax():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((5, 3, 40))  # logits of 40 keys per (token, head)
    v = rng.standard_normal((40, 16))

    def state(cols):
        lse = np.log(np.exp(s[..., cols]).sum(-1)) if len(cols) else np.full(s.shape[:2],
                                                                               -np.inf)
        p = np.exp(s[..., cols] - lse[..., None]) if len(cols) else np.zeros((5, 3, 0))
        return p @ v[cols], lse

    full_o, full_lse = state(np.arange(40))
    o, lse = merge_states_reference(*state(np.arange(13)), *state(np.arange(13, 40)))
    np.testing.assert_allclose(o, full_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, full_lse, rtol=1e-12)
    # An empty side contributes nothing (its o is ignored, even NaN); two give o=0, -inf.
    o_a, lse_a = state(np.arange(40))
    o, lse = merge_states_reference(o_a, lse_a, np.full_like(o_a, np.nan),
                                    np.full(lse_a.shape, -np.inf))
    np.testing.assert_allclose(o, o_a) and np.testing.assert_allclose(lse, lse_a)
    o, lse = merge_states_reference(np.full_like(o_a, np.nan), np.full(lse_a.shape, -np.inf),
                                    np.full_like(o_a, np.nan), np.full(lse_a.shape, -np.inf))
    assert (o == 0).all() and np.isneginf(lse).all()


# ---------------------------------------------------------------- paged caches, dtypes


def test_ragged_to_paged_round_trip_and_poison():
    rng = np.random.default_rng(3)
    lengths = [12, 0, 33, 1, 16]
    indptr = indptr_from_lengths(lengths)
    k = rng.standard_normal((indptr[-1], 2, 8)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    kc, vc, idx, pind, last = ragged_to_paged(k, v, indptr, 16, rng=rng)
    assert kc.shape[1:] == (16, 2, 8) and kc.shape[0] > pind[-1]
    assert pind.tolist() == [0, 1, 1, 4, 5, 6] and last.tolist() == [12, 0, 1, 1, 16]
    assert len(set(idx.tolist())) == idx.shape[0] and idx.tolist() != sorted(idx.tolist())
    k2, v2, indptr2 = paged_to_ragged(kc, vc, idx, pind, last)
    assert np.array_equal(k2, k) and np.array_equal(v2, v)
    assert np.array_equal(indptr2, indptr)
    unused = np.setdiff1d(np.arange(kc.shape[0]), idx)
    assert np.isfinite(kc).all() and (np.abs(kc[unused]) >= 32).all()
    assert (np.abs(kc[idx[0], 12:]) >= 32).all(), "the tail of a last page is poisoned"
    inputs = A.validate_plan_inputs(indptr_from_lengths([1, 0, 2, 1, 3]), pind, idx, last,
                                    page_size=16)
    assert inputs.kv_lens.tolist() == lengths
    ordered = ragged_to_paged(k, v, indptr, 16, shuffle=False, num_pages=6)[2]
    assert ordered.tolist() == list(range(6))
    with pytest.raises(ValueError, match="num_pages = 2 is too small"):
        ragged_to_paged(k, v, indptr, 16, num_pages=2)


def test_bfloat16_bits():
    x = np.array([1.0, -2.5, 3.14159, 1e-3, 0.0, np.inf, -np.inf], dtype=np.float32)
    bits = float_to_bfloat16_bits(x)
    assert bits.dtype == np.uint16 and bits[0] == 0x3F80 and bits[1] == 0xC020
    back = bfloat16_bits_to_float(bits)
    np.testing.assert_allclose(back, x, rtol=2**-8)
    assert np.array_equal(float_to_bfloat16_bits(back), bits)  # exact round trip
    # Round to nearest even: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> 1.
    assert bfloat16_bits_to_float(float_to_bfloat16_bits(np.float32(1 + 2**-8)))[()] == 1.0
    assert np.isnan(bfloat16_bits_to_float(float_to_bfloat16_bits(np.float32(np.nan))))
    assert round_to_dtype([1 + 2**-12], "fp16")[0] == 1.0


def test_describe_numpy_and_strides():
    a = np.zeros((4, 6), np.float32)
    info = describe(a, "x")
    assert (info.shape, info.dtype, info.kind, info.device) == ((4, 6), "float32", "numpy", None)
    assert info.contiguous and not describe(a.T, "x").contiguous
    assert describe(info, "x") is info or describe(info, "x") == info
    with pytest.raises(TypeError, match="x must be an array"):
        describe(object(), "x")


def test_a_per_pair_mask_comes_from_plan_not_run():
    tree = attnlang.parse("variant t\nparam allowed: bool[q, kv]\nparam cap: float = 5.0\n"
                          "logits = cap * tanh(logits / cap)\nmask = allowed[q_row, kv_pos]\n")
    buffer = np.uint64(0x7F0000001000)  # what plan() hands run(): its packed buffer
    r = run_inputs(specs=tree.params, params={"cap": 3.0}, plan_params={"allowed": buffer})
    assert [(spec.name, value) for spec, value in r.params] == [("allowed", buffer),
                                                                ("cap", np.float32(3.0))]
    with pytest.raises(ValueError, match=r"param 'allowed' \(bool\[q, kv\]\) is a per-pair mask: "
                                         r"pass it to plan\(params=...\)"):
        run_inputs(specs=tree.params, params={"allowed": np.ones(5, bool)},
                   plan_params={"allowed": buffer})
    with pytest.raises(ValueError, match=r"comes from plan\(\): call plan\(..., "
                                         r"params=\{'allowed': ...\}\) first"):
        run_inputs(specs=tree.params)


def test_kernel_args_without_tensor_maps():
    # a workspace without the producer's maps (no TMA tiles) passes a null pointer
    values, ws = _launch_inputs(attnlang.load(VARIANT_FILES[0]), np.int32(1), np.float32(1))
    del ws["tma_maps"]
    args = A.kernel_args("prefill", q=1, k_cache=2, v_cache=3, out=4, lse=5, ws=ws,
                         num_heads=8, num_kv_heads=2, page_size=16, sm_scale=0.125,
                         params=values)
    at = A.kernel_args("decode", q=1, k_cache=2, v_cache=3, out=4, lse=5, ws=ws, num_heads=8,
                       num_kv_heads=2, page_size=16, sm_scale=0.125, params=values)
    assert len(args) == len(at) + 1 and 0 in args
