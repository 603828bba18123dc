"""The prefill producer's TMA tensor maps: which caches get them, and the buffer's size
(encoding the maps needs the CUDA driver: the GPU tests run it, test_gpu_prefill's TMA tiles)."""

import pytest

from attnlang.runtime import tensor_maps


@pytest.mark.parametrize("page_size, rows", [(16, 16), (32, 16), (48, 16), (4096, 16),
                                             (8, None), (1, None), (100, None)])
def test_box_rows(page_size, rows):
    assert tensor_maps.box_rows(page_size) == rows


def test_a_ragged_layout_has_boxes_anywhere():
    # kv_layout="ragged": pages of one token, each request's rows consecutive
    assert tensor_maps.box_rows(1, ragged=True) == 16
    assert tensor_maps.uses_tma(128, 128, "bfloat16", "bfloat16", 1, "sm_90a", ragged=True)
    assert not tensor_maps.uses_tma(128, 128, "bfloat16", "bfloat16", 1, "sm_90a")
    assert not tensor_maps.uses_tma(128, 128, "bfloat16", "bfloat16", 1, "sm_80", ragged=True)


@pytest.mark.parametrize("head_dim, head_dim_vo, kv_dtype, page_size, arch, want", [
    (128, 128, "bfloat16", 64, "sm_90a", True),
    (256, 256, "float16", 4096, "sm_90a", True),
    (128, 128, "bfloat16", 16, "sm_90a", True),
    (128, 128, "bfloat16", 8, "sm_90a", False),           # pages of 8: cp.async
    (128, 128, "float8_e4m3fn", 64, "sm_90a", True),      # boxes of raw e4m3 rows
    (64, 64, "bfloat16", 64, "sm_90a", False),            # no producer at head dim 64
    (192, 128, "bfloat16", 64, "sm_90a", False),          # nor for MLA's head dims
    (128, 128, "bfloat16", 64, "sm_80", False),           # the mma.sync path
])
def test_uses_tma(monkeypatch, head_dim, head_dim_vo, kv_dtype, page_size, arch, want):
    monkeypatch.delenv("ATTNLANG_PREFILL_TMA", raising=False)
    got = tensor_maps.uses_tma(head_dim, head_dim_vo, "bfloat16", kv_dtype, page_size, arch)
    assert got is want


def test_uses_tma_knob(monkeypatch):
    monkeypatch.setenv("ATTNLANG_PREFILL_TMA", "0")
    assert not tensor_maps.uses_tma(128, 128, "bfloat16", "bfloat16", 16, "sm_90a")
    monkeypatch.setenv("ATTNLANG_PREFILL_TMA", "1")
    assert tensor_maps.uses_tma(128, 128, "bfloat16", "bfloat16", 16, "sm_90a")


def test_buffer_bytes():
    # two templates, then a K and a V map per CTA (prefill_shape.cuh's kTmaCtaMaps)
    assert tensor_maps.buffer_bytes(132) == 256 + 132 * 256
