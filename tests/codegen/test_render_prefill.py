"""The prefill kind: rendering, its launch shape, and its sources through NVRTC.

Every variant renders a prefill source with exactly the decode kernel's arguments (the
runtime launches both kinds alike), and compiles at bf16 / head_dim 128 for sm_90a (the wgmma
path: no spills, and no wgmma serialised by ptxas) and for sm_90 and sm_80 (the mma.sync
path) within the spill budget below; qk_norm (reductions and rope in two vector hooks: the
heaviest on registers) also over every dtype x head_dim x {sm_90a, sm_80}.
"""

from __future__ import annotations

import re

import pytest

import attnlang
from attnlang.codegen import config
from attnlang.codegen.lower import LINE_RESET, lower
from attnlang.codegen.render import generated_name, render
from attnlang.runtime import module
from tests.codegen.test_render import (
    DECODE_ARGS,
    _toolchain_problem,
    by_id,
    entry_args,
    head_dims,
    load,
)
from tests.variant_files import CPU_HEAVY_IDS, VARIANT_FILES, VARIANT_IDS

_PROBLEM = _toolchain_problem()
needs_nvrtc = pytest.mark.skipif(
    _PROBLEM is not None, reason=f"needs NVRTC and CUDA headers: {(_PROBLEM or '')[:200]}")


@pytest.mark.parametrize("path", VARIANT_FILES, ids=VARIANT_IDS)
def test_prefill_source_takes_the_decode_arguments(path):
    hooks = lower(load(path))
    src = render(hooks, "prefill", "bfloat16", 128)
    includes = re.findall(r"^\s*#\s*include\s*(.*)$", src, re.M)
    assert includes == ["<cuda_fp16.h>", "<cuda_bf16.h>"]
    assert "{{" not in src and "{%" not in src and LINE_RESET not in src
    assert "namespace variant {" in src and "constexpr int kHeadDim = 128;" in src
    args = entry_args(src, "prefill")
    # the decode kernel's arguments, and the producer's tensor maps after the work list
    at = DECODE_ARGS.index("work_partial") + 1
    names = DECODE_ARGS[:at] + ["tma_maps"] + DECODE_ARGS[at:]
    assert [name for _, name in args] == names + [p.name for p in hooks.kernel_params]
    decode = entry_args(render(hooks, "decode", "bfloat16", 128), "decode")
    assert args[:at] + args[at + 1:] == decode


def test_prefill_templates_list_what_they_splice():
    # one kernel per instruction path, prefill_common.cu.j2's header lists every value any of
    # them splices and every part they include
    from pathlib import Path

    from attnlang import paths

    root = Path(paths.templates_dir())
    header = (root / "prefill_common.cu.j2").read_text().split("-#}")[0]
    for name in ("prefill_common", "prefill_entry", "prefill_mma", "prefill_wgmma"):
        text = (root / f"{name}.cu.j2").read_text()
        for value in set(re.findall(r"{{\s*(\w+)\s*}}", text)):
            assert value in header, f"{name}.cu.j2 splices '{value}' unlisted in prefill_common"
        for part in re.findall(r'{% include "(prefill_\w+\.cuh)" %}', text):
            assert part in header and (root / part).exists(), (name, part)


def test_launch_config_prefill():
    cfg = config.launch_config("prefill", 128, 4)
    # 4 warps x 32 rows, 2 stages of 64 keys, Q tile, distance table: two CTAs per SM
    assert cfg == config.LaunchConfig((128, 1, 1), 128, 98304 + 3072, 64)
    assert cfg.needs_smem_opt_in
    for head_dim in config.HEAD_DIMS:
        for dtype in config.DTYPES:
            shape = config.template_shape("prefill", head_dim, dtype)
            for group in (1, 3, 4, 8, 64):
                cfg = config.launch_config("prefill", head_dim, group, dtype)
                warps = cfg.threads // 32
                assert cfg.block == (shape.max_threads, 1, 1) and cfg.threads % 32 == 0
                # each warp owns row_blocks blocks of 16 fused rows
                assert cfg.rows_per_tile == 16 * shape.row_blocks * warps
                assert cfg.kv_tile == shape.kv_tile and shape.kv_tile % 16 == 0
                kv_bytes = 2 * shape.stages * shape.kv_tile * head_dim * 2  # K and V stages
                q_bytes = cfg.rows_per_tile * head_dim * 2
                assert cfg.smem_bytes == kv_bytes + q_bytes + config.DISTANCE_TABLE_BYTES
                assert cfg.rows_per_tile * head_dim * 4 <= cfg.smem_bytes  # fp32 O staging
                # The CTAs per SM the kernel is built for fit the H100's 228 KB.
                assert shape.min_blocks * (cfg.smem_bytes + 1024) <= 228 * 1024


def test_launch_config_prefill_wgmma():
    # Two warpgroups of 64 rows (the same 128-row work items) and a producer warpgroup, three
    # stages of 128 keys.
    assert config.launch_config("prefill", 128, 4, arch="sm_90a") == config.LaunchConfig(
        (384, 1, 1), 128, 3 * 2 * 128 * 128 * 2 + 128 * 128 * 2 + 3072, 128)
    # Head dim 256: 64-key tiles, 2 K stages and 3 V stages (V is read one tile longer), the
    # Q tile and the table: all of 227 KB.
    assert config.launch_config("prefill", 256, 4, arch="sm_90a") == config.LaunchConfig(
        (384, 1, 1), 128, 227 * 1024, 64)
    # Head dim 64 keeps two CTAs per SM (its kernel fits 128 registers): no producer.
    assert config.launch_config("prefill", 64, 4, arch="sm_90a").block == (256, 1, 1)
    for head_dim in config.HEAD_DIMS:
        for arch in ("sm_90a", "sm_90", "sm_80", "sm_100a", None):
            wgmma = config.uses_wgmma("prefill", head_dim, arch)
            assert wgmma == (arch == "sm_90a")
            shape = config.template_shape("prefill", head_dim, "float16", arch)
            assert shape.wgmma == wgmma
            assert shape.key_stages == shape.stages - (wgmma and head_dim == 256)
            cfg = config.launch_config("prefill", head_dim, 8, "float16", arch)
            # Both paths take 128-row work items; the KV tile (the planner's chunk unit)
            # comes from the launch config of the path.
            assert cfg.rows_per_tile == 128 and cfg.kv_tile == shape.kv_tile
            producer = wgmma and head_dim in (128, 256)
            assert shape.producer_threads == (128 if producer else 0)
            assert cfg.block == (shape.max_threads + shape.producer_threads, 1, 1)
            # The producer's pipeline barriers come out of the distance table's bytes.
            assert shape.distance_table_floats == (config.DISTANCE_TABLE_BYTES
                                                   - 128 * producer) // 4
            assert shape.sub_keys == (shape.kv_tile if wgmma else min(shape.kv_tile, 32))
            # The CTAs per SM the kernel is built for fit the H100's 228 KB (227 per CTA).
            assert cfg.smem_bytes <= 227 * 1024
            assert shape.min_blocks * (cfg.smem_bytes + 1024) <= 228 * 1024
    assert not config.uses_wgmma("decode", 128, "sm_90a")


def test_wgmma_source_only_for_sm_90a():
    hooks = lower(load(by_id("softcap")))
    hopper = render(hooks, "prefill", "bfloat16", 128, "sm_90a")
    assert "constexpr bool kWgmma = true;" in hopper
    # S of a 128-key tile, O of head_dim 128
    assert hopper.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 2
    for arch in (None, "sm_90", "sm_80"):
        assert "constexpr bool kWgmma = false;" in render(hooks, "prefill", "bfloat16", 128, arch)
    fp16 = render(hooks, "prefill", "float16", 64, "sm_90a")
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in fp16
    assert "kWgmma" not in render(hooks, "decode", "bfloat16", 128, "sm_90a")


# bytes, mma.sync path (the zoo at head_dim 128 spills up to 52 on sm_90, 40 on sm_80)
SPILL_BUDGET = 64

# Every variant on both paths; sm_90 without the "a" (mma.sync, a larger spill than sm_80)
# for the two variants with the most live state; qk_norm over the dtype x head_dim matrix.
_MATRIX = [(v, "bfloat16", 128, a) for v in CPU_HEAVY_IDS for a in ("sm_90a", "sm_80")]
_MATRIX += [(v, "bfloat16", 128, "sm_90") for v in ("kitchen_sink", "rope_norm_window")]
_MATRIX += [("qk_norm", d, hd, a) for d in config.DTYPES for hd in config.HEAD_DIMS
            for a in ("sm_90a", "sm_80") if (d, hd) != ("bfloat16", 128)]
# MLA's head dims (queries and keys 192, values 128), on both paths. (Not qk_norm: a key hook
# with rope on 24 elements per lane beside the O registers spills, 330 bytes on mma.sync and
# 28 on wgmma; benchmarks/NOTES.md, MLA.)
_MATRIX += [(v, "bfloat16", "192/128", a) for v in ("causal", "kitchen_sink", "rope_norm_window")
            for a in ("sm_90a", "sm_80")]


@needs_nvrtc
@pytest.mark.parametrize("variant, dtype, head_dim, arch", _MATRIX,
                         ids=["-".join(map(str, m)) for m in _MATRIX])
def test_prefill_compiles_without_spills(variant, dtype, head_dim, arch):
    check_prefill_compile(variant, dtype, head_dim, arch)


# An fp8 cache's kernels (the dequantisation on each path: the copying thread's on mma.sync
# and head dim 64, the computing warps' beside a producer).
_FP8 = [(v, "bfloat16", hd, a) for v in ("causal", "kitchen_sink", "spec_tree", "t5_bias")
        for hd, a in ((128, "sm_90a"), (256, "sm_90a"), (64, "sm_90a"), (128, "sm_80"))]


@needs_nvrtc
@pytest.mark.parametrize("variant, dtype, head_dim, arch", _FP8,
                         ids=["-".join(map(str, m)) for m in _FP8])
def test_fp8_cache_prefill_compiles_within_the_budget(variant, dtype, head_dim, arch):
    # T5 beside a producer parks 48 / 68 bytes (56 / 64 with a bf16 cache): the conversion's
    # addresses at the top of the tile loop; a little more budget for it. spec_tree at head
    # dim 256 (its q split into e4m3 rows: kFp8Qk) parks 56 / 104 bytes, all outside the tile
    # loop (the query pass and the epilogue, once per item: read off its SASS).
    extra = 48 if (variant, head_dim) == ("spec_tree", 256) else 32
    check_prefill_compile(variant, dtype, head_dim, arch, kv_dtype="float8_e4m3fn",
                          budget=SPILL_BUDGET + extra)


# The cascade kernel (a shared-prefix level's: prefill with kCascade) on each path.
_CASCADE = [(v, "bfloat16", hd, a) for v in ("causal", "spec_tree", "t5_bias")
            for hd, a in ((128, "sm_90a"), (64, "sm_90a"), (128, "sm_80"))]
_CASCADE += [("kitchen_sink", "bfloat16", 128, "sm_90a"), ("causal", "bfloat16", 256, "sm_90a")]


@needs_nvrtc
@pytest.mark.parametrize("variant, dtype, head_dim, arch", _CASCADE,
                         ids=["-".join(map(str, m)) for m in _CASCADE])
def test_cascade_kernel_compiles_within_the_budget(variant, dtype, head_dim, arch):
    # Each row's Index holds its own request and lengths (three registers more per fragment
    # row than one request's item): spec_tree on mma.sync parks 44 / 88 bytes.
    check_prefill_compile(variant, dtype, head_dim, arch, kind="cascade",
                          budget=SPILL_BUDGET + 32)


def test_cascade_kernel_source():
    hooks = lower(load(by_id("causal")))
    src = render(hooks, "cascade", "bfloat16", 128, "sm_90a")
    args = [name for _, name in entry_args(src, "cascade")]
    at = DECODE_ARGS.index("work_partial") + 1
    assert args == (DECODE_ARGS[:at] + ["cascade_item", "token_request", "tma_maps"] +
                    DECODE_ARGS[at:])
    assert "constexpr bool kCascade = true;" in src and "constexpr bool kWgmma = true;" in src
    assert "constexpr bool kCascade = false;" in render(hooks, "prefill", "bfloat16", 128)
    assert config.launch_config("cascade", 128, 4, arch="sm_90a") == config.launch_config(
        "prefill", 128, 4, arch="sm_90a")
    # Keys whose hook reads the request differ between a prefix's requests: no cascade.
    v = attnlang.parse("variant k\nparam shift: int[batch]\n"
                       "key = rope(k, kv_pos + shift[batch])\n")
    with pytest.raises(ValueError, match="no cascade kernel: its key or value hook reads"):
        render(lower(v), "cascade", "bfloat16", 128)


def check_prefill_compile(variant, dtype, head_dim, arch, kv_dtype=None, budget=SPILL_BUDGET,
                          kind="prefill"):
    from attnlang.runtime.compiler import compile_source

    qk, vo = head_dims(head_dim)
    v = load(by_id(variant))
    hooks = lower(attnlang.ir.with_kv_scales(v) if kv_dtype else v)
    src = render(hooks, kind, dtype, qk, arch, vo, kv_dtype)
    name, label = generated_name(hooks, kind), f"{variant} {kind} {dtype} d{head_dim}"
    # as compile_variant builds it (without TMA tiles where they spill the producer)
    cubin = module.without_spilling_tma_tiles(
        compile_source(src, arch, name=name, label=label), src, kind, head_dim=qk,
        head_dim_vo=vo, dtype=dtype, arch=arch, name=name, label=label)
    (info,) = [f for f in cubin.functions if f.name == kind]
    shape = config.template_shape("prefill", qk, dtype, arch, vo)
    if shape.wgmma:
        # ptxas reports (C75xx) when it has to serialise wgmma: that would cost the path its
        # overlap of softmax and matmuls.
        assert "C75" not in cubin.log, cubin.log
        if not shape.producer_threads:
            # S of the tile, P and O fill the registers (220-255 in the zoo) but nothing may
            # spill.
            assert info.spill_stores == 0 and info.spill_loads == 0, cubin.log
        # With a producer warpgroup the computing threads have 224 registers (setmaxnreg) and
        # a few variants park a value or two outside the tile loop (0-32 bytes in the zoo);
        # SPILL_BUDGET below bounds them.
    # 32 rows per warp fill 255 registers by design (O alone takes 128 at head_dim 128), and
    # ptxas parks a few item-invariant values in local memory: at most SPILL_BUDGET bytes,
    # reloaded outside the sub-tile loop (the SASS in benchmarks/NOTES.md, v3 prefill). More
    # means a hook or a template change pushed the hot loop itself into local memory.
    assert info.spill_stores <= budget and info.spill_loads <= budget, cubin.log
    assert info.stack_bytes <= budget, cubin.log
    # (With a producer ptxas reports the registers the CTA starts with: 65536 / 384 = 168.)
    assert info.registers <= min(255, 65536 // (shape.block_threads * shape.min_blocks))
