"""The render pass: Hooks -> full CUDA sources, and those sources through NVRTC.

Every variant renders for both kernel kinds; a matrix of them compiles for sm_90a and sm_80
with no spills and no stack frame (ptxas -v). The decode source of each variant is kept as a
golden file (tests/codegen/golden/<variant>.decode.bf16.128.cu) so a change to lowering or
templates shows its effect: regenerate with ATTNLANG_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jinja2
import pytest

import attnlang
from attnlang import paths
from attnlang.codegen import config
from attnlang.codegen.lower import LINE_RESET, lower
from attnlang.codegen.render import context, environment, generated_name, render
from tests.variant_files import CPU_HEAVY_IDS, ROOT, VARIANT_FILES, VARIANT_IDS

GOLDEN = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("ATTNLANG_UPDATE_GOLDEN", "") not in ("", "0")

# The kinds whose templates these tests cover (prefill has its own tests).
KINDS = ("decode", "merge")

# INTERNALS.md, "Kernel kinds and arguments".
DECODE_ARGS = [
    "q", "k_cache", "v_cache", "out", "lse", "qo_indptr", "kv_indptr", "kv_indices",
    "kv_last_page_len", "work_indptr", "work_request", "work_kv_head", "work_row_start",
    "work_kv_start", "work_kv_end", "work_partial", "partial_o", "partial_lse", "num_heads",
    "num_kv_heads", "page_size", "sm_scale",
]
MERGE_ARGS = [
    "merge_count", "merge_indptr", "merge_slots", "merge_token", "merge_head",
    "merge_request", "out", "lse", "partial_o", "partial_lse", "qo_indptr", "kv_indptr",
    "kv_last_page_len", "num_heads", "num_kv_heads", "page_size", "sm_scale",
]


def load(path: Path) -> attnlang.ir.Variant:
    """Parse with a repository-relative file name, so #line directives (and the golden
    files) do not depend on where the checkout lives."""
    return attnlang.parse(path.read_text(), filename=path.relative_to(ROOT).as_posix())


def by_id(name: str) -> Path:
    return VARIANT_FILES[VARIANT_IDS.index(name)]


def entry_args(src: str, kind: str) -> list[tuple[str, str]]:
    """(C type, name) of each argument of the extern "C" entry `kind`."""
    m = re.search(rf'extern "C" __global__ void __launch_bounds__\([^)]*\)\s*{kind}\((.*?)\)\s*\{{',
                  src, re.S)
    assert m, f"no extern \"C\" entry '{kind}'"
    args = []
    for decl in m.group(1).split(","):
        decl = " ".join(decl.replace("__restrict__", "").split())
        ctype, name = decl.rsplit(" ", 1)
        args.append((ctype, name))
    return args


# ---------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("path", VARIANT_FILES, ids=VARIANT_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_renders_self_contained_source(path, kind):
    hooks = lower(load(path))
    src = render(hooks, kind, "bfloat16", 128)
    includes = re.findall(r"^\s*#\s*include\s*(.*)$", src, re.M)
    assert includes == ["<cuda_fp16.h>", "<cuda_bf16.h>"]
    # no unrendered Jinja (inline PTX may legitimately hold "{%0, %1}")
    assert not re.search(r"\{\{\s*\w+\s*\}\}|\{%-?\s*(if|for|include|raw|endraw)\b", src)
    assert LINE_RESET not in src
    assert "namespace variant {" in src and "constexpr int kHeadDim = 128;" in src
    fixed = DECODE_ARGS if kind == "decode" else MERGE_ARGS
    args = entry_args(src, kind)
    assert [name for _, name in args] == fixed + [p.name for p in hooks.kernel_params]
    assert [t for t, _ in args[len(fixed):]] == [p.ctype for p in hooks.kernel_params]


def test_argument_types():
    src = render(lower(load(by_id("alibi"))), "decode", "float16", 64)
    types = dict((n, t) for t, n in entry_args(src, "decode"))
    assert types["q"] == "const half*" and types["out"] == "half*"
    assert types["lse"] == "float*" and types["partial_o"] == "float*"
    assert types["num_heads"] == "const int" and types["sm_scale"] == "const float"
    assert types["param_slopes"] == "const float*"
    src = render(lower(load(by_id("alibi"))), "merge", "bfloat16", 256)
    types = dict((n, t) for t, n in entry_args(src, "merge"))
    assert types["out"] == "__nv_bfloat16*" and types["merge_count"] == "const int*"
    assert "constexpr int kHeadDim = 256;" in src


def test_fp8_cache_arguments():
    # An fp8 cache: e4m3 bytes for k/v, the scales as the last params, kv_scales reading them.
    v = attnlang.ir.with_kv_scales(load(by_id("alibi")))
    for kind in ("decode", "prefill"):
        src = render(lower(v), kind, "bfloat16", 128, "sm_90a", None, "float8_e4m3fn")
        args = entry_args(src, kind)
        types = dict((n, t) for t, n in args)
        assert types["k_cache"] == types["v_cache"] == "const unsigned char*"
        assert types["q"] == "const __nv_bfloat16*" and types["out"] == "__nv_bfloat16*"
        assert [n for _, n in args[-3:]] == ["param_slopes", "param_k_scale", "param_v_scale"]
        assert "__ldg(p.u_k_scale + kv_head), __ldg(p.u_v_scale + kv_head)" in src
        assert "using KvT = unsigned char;" in src
    plain = render(lower(load(by_id("alibi"))), "decode", "bfloat16", 128)
    assert "using KvT = __nv_bfloat16;" in plain and "make_float2(1.0f, 1.0f)" in plain


def test_fp8_cache_render_errors():
    hooks = lower(load(by_id("causal")))
    with pytest.raises(ValueError, match=r"unsupported kv_dtype 'int8'"):
        render(hooks, "decode", "bfloat16", 128, None, None, "int8")
    with pytest.raises(ValueError, match=r"need the params k_scale, v_scale .*with_kv_scales"):
        render(hooks, "decode", "bfloat16", 128, None, None, "float8_e4m3fn")


def test_line_resets_number_the_generated_file():
    hooks = lower(load(by_id("softcap")))
    src = render(hooks, "decode", "bfloat16", 128)
    name = generated_name(hooks, "decode")
    lines = src.split("\n")
    resets = [(i, line) for i, line in enumerate(lines) if line.endswith(f'"{name}"')]
    assert resets, "no #line reset after the hooks"
    for i, line in resets:
        # `#line n` at 0-based index i names the next line, which is line i + 2.
        assert line == f'#line {i + 2} "{name}"'
    assert '#line 7 "examples/softcap.attn"' in src  # logits = cap * tanh(logits / cap)


@pytest.mark.parametrize("kind, dtype, head_dim, message", [
    ("bogus", "bfloat16", 128, "kernel kind"),
    ("decode", "float32", 128, "dtype"),
    ("decode", "bf16", 128, "dtype"),
    ("merge", "float16", 96, "head_dim"),
    ("decode", "float16", "128", "head_dim"),
])
def test_bad_render_arguments(kind, dtype, head_dim, message):
    with pytest.raises(ValueError, match=message):
        render(lower(load(by_id("causal"))), kind, dtype, head_dim)


def test_headers_are_spliced_verbatim():
    # .cuh headers are C++: Jinja-looking text in them (inline PTX operand lists) passes as is.
    src = render(lower(load(by_id("causal"))), "merge", "float16", 64)
    for header in ("common.cuh", "machine.cuh"):
        assert (Path(paths.templates_dir()) / header).read_text() in src


def test_a_broken_template_cache_only_costs_time(tmp_path):
    # Compiled templates are cached in the temp directory; a corrupt file or a directory that
    # cannot be written must not break rendering.
    from attnlang.codegen.render import _TemplateCache

    hooks = lower(load(by_id("causal")))

    def render_with(cache):
        env = environment().overlay(bytecode_cache=cache)
        return env.get_template("merge.cu.j2").render(**context(hooks, "merge", "float16", 64))

    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    first = render_with(_TemplateCache(str(cache_dir), pattern="t-%s.cache"))
    cached = list(cache_dir.iterdir())
    assert cached
    for path in cached:
        path.write_bytes(b"garbage" * 10)
    assert render_with(_TemplateCache(str(cache_dir), pattern="t-%s.cache")) == first
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert render_with(_TemplateCache(str(not_a_dir), pattern="t-%s.cache")) == first


def test_strict_undefined_catches_a_missing_value():
    ctx = context(lower(load(by_id("causal"))), "decode", "bfloat16", 128)
    del ctx["params_init"]
    with pytest.raises(jinja2.UndefinedError, match="params_init"):
        environment().get_template("decode.cu.j2").render(**ctx)


@pytest.mark.parametrize("kind", [*KINDS, "decode_mma"])
def test_templates_use_every_context_value_they_are_given_or_document_it(kind):
    # Each template's opening comment block names the values it splices.
    text = (Path(paths.templates_dir()) / f"{kind}.cu.j2").read_text()
    header = text.split("-#}")[0]
    used = set(re.findall(r"{{\s*(\w+)\s*}}", text))
    for name in used:
        assert name in header, f"{kind}.cu.j2 splices '{name}' without listing it"


# ---------------------------------------------------------------------------- launch config


def test_launch_config_decode():
    cfg = config.launch_config("decode", 128, 4)
    assert cfg == config.LaunchConfig((16, 4, 2), 4, 49152, 32)
    assert cfg.threads == 128 and not cfg.needs_smem_opt_in
    for head_dim in config.HEAD_DIMS:
        shape = config.template_shape("decode", head_dim, "bfloat16")
        for group in (1, 2, 3, 4, 5, 7, 8, 16, 32, 64):
            cfg = config.launch_config("decode", head_dim, group, "float16")
            tx, rows, tz = cfg.block
            assert tx * shape.vec == head_dim and rows == cfg.rows_per_tile
            assert rows & (rows - 1) == 0 and rows >= min(group, 16 * 8 // tx)
            assert cfg.threads % 32 == 0 and cfg.threads <= shape.max_threads
            assert rows * tz <= shape.kv_tile  # every TX-lane group copies >= 1 key per tile
            assert tz <= shape.kv_tile // shape.chunk  # every z-group gets a softmax chunk
            assert cfg.smem_bytes >= rows * tz * (head_dim + 2) * 4  # z-group merge scratch
            assert cfg.kv_tile == shape.kv_tile


def test_decode_on_tensor_cores():
    # config.decode_mma: an fp8 cache at head dim 64, 128 or 256, softmax on, no key or value
    # hook, no per-pair mask; anything else keeps decode.cu.j2.
    ok = dict(softmax=True, kv_hooks=False, pair_masks=False)
    for dims in ((64, None), (128, None), (128, 128), (256, 256)):
        assert config.decode_mma(*dims, config.KV_FP8, **ok)
    assert not config.decode_mma(128, None, "bfloat16", **ok)
    assert not config.decode_mma(128, None, None, **ok)
    assert not config.decode_mma(192, 128, config.KV_FP8, **ok)
    for flag, value in (("softmax", False), ("kv_hooks", True), ("pair_masks", True)):
        assert not config.decode_mma(128, None, config.KV_FP8, **{**ok, flag: value})
    # The renderer asks the same question of the lowered hooks.
    for variant_id, expect in (("causal", True), ("softcap", True), ("t5_bias", True),
                               ("qk_norm", False), ("flash_sigmoid", False),
                               ("spec_tree", False)):
        v = attnlang.ir.with_kv_scales(load(by_id(variant_id)))
        src = render(lower(v), "decode", "bfloat16", 128, "sm_90a", None, config.KV_FP8)
        assert ("attnlang decode kernel on tensor cores" in src) == expect, variant_id
        assert 'extern "C" __global__' in src and "decode(" in src
    # Its launches: 4 warps as TX-lane row groups, 8 rows an item whatever the group, the
    # CTA's tile of every warp's keys, two CTAs' shared memory per SM.
    for group in (1, 2, 3, 4, 6, 8, 16, 32):
        cfg = config.launch_config("decode", 128, group, "float16", "sm_90a", decode_mma=True)
        assert cfg.block == (16, 8, 1) and cfg.rows_per_tile == config.DECODE_MMA_ROWS == 8
        assert cfg.kv_tile == 128 and 2 * (cfg.smem_bytes + 1024) <= 228 * 1024
    assert config.launch_config("prefill", 128, 4, decode_mma=True) == config.launch_config(
        "prefill", 128, 4)
    with pytest.raises(ValueError, match=r"no tensor-core decode kernel at head dims 192/128"):
        config.template_shape("decode", 192, "bfloat16", head_dim_vo=128, decode_mma=True)
    for head_dim, per_sm in ((64, 3), (256, 1)):  # CTAs of 4 warps per SM
        cfg = config.launch_config("decode", head_dim, 4, decode_mma=True)
        assert cfg.block == (head_dim // 8, 1024 // head_dim, 1) and cfg.rows_per_tile == 8
        assert per_sm * (cfg.smem_bytes + 1024) <= 228 * 1024


def test_value_head_dim_shapes():
    # MLA: both vectors over TX = gcd / 8 = 8 lanes, 24 query/key and 16 value elements each.
    shape = config.template_shape("decode", 192, "bfloat16", head_dim_vo=128)
    assert (shape.tx, shape.vec, shape.vec_vo, shape.kv_tile) == (8, 24, 16, 64)
    cfg = config.launch_config("decode", 192, 1, head_dim_vo=128)
    assert cfg.smem_bytes == 3 * 64 * (192 + 128) * 2 and cfg.threads >= 128
    merge = config.template_shape("merge", 192, "bfloat16", head_dim_vo=128)
    assert (merge.tx, merge.vec_vo) == (16, 8)  # merge rows are values only
    prefill = config.template_shape("prefill", 192, "bfloat16", None, 128)
    assert not prefill.wgmma and (prefill.vec, prefill.vec_vo) == (24, 16)
    cfg = config.launch_config("prefill", 192, 4, "bfloat16", None, 128)
    assert cfg.smem_bytes <= 114 * 1024  # mma.sync: two CTAs per SM
    assert config.template_shape("prefill", 192, "bfloat16", "sm_90a", 128).wgmma
    cfg = config.launch_config("prefill", 192, 4, "bfloat16", "sm_90a", 128)
    # 208 KB and the distance table, one CTA
    assert cfg.smem_bytes == 4 * 64 * (192 + 128) * 2 + 128 * 192 * 2 + config.DISTANCE_TABLE_BYTES
    assert config.check_head_dims(64) == (64, 64)
    for qk, vo in ((192, None), (128, 192), (96, 96), (True, 128)):
        with pytest.raises(ValueError, match="unsupported head_dim"):
            config.check_head_dims(qk, vo)


def test_fine_tiles_for_pair_masks():
    # A variant with a per-pair mask takes 64-key tiles on the d128 wgmma path (its blocks
    # are skipped per tile); every other variant, and every other path, keeps its shape.
    fine = config.template_shape("prefill", 128, "bfloat16", "sm_90a", fine_tiles=True)
    plain = config.template_shape("prefill", 128, "bfloat16", "sm_90a")
    assert (fine.kv_tile, fine.stages, plain.kv_tile, plain.stages) == (64, 4, 128, 3)
    assert fine.sub_keys == 64 and fine.producer_threads == plain.producer_threads
    for dims, arch in (((256, None), "sm_90a"), ((64, None), "sm_90a"), ((128, None), None)):
        assert (config.template_shape("prefill", dims[0], "bfloat16", arch, dims[1], True)
                == config.template_shape("prefill", dims[0], "bfloat16", arch, dims[1]))
    cfg = config.launch_config("prefill", 128, 4, "bfloat16", "sm_90a", None, True)
    assert cfg.kv_tile == 64
    assert cfg.smem_bytes == 64 * 4 * 2 * 128 * 2 + 128 * 128 * 2 + config.DISTANCE_TABLE_BYTES
    # render and the runtime agree: the spliced tile is the one launch_config reports.
    tree = attnlang.load(ROOT / "examples" / "spec_tree.attn")
    causal = attnlang.load(ROOT / "examples" / "causal.attn")
    assert lower(tree).pair_masks and not lower(causal).pair_masks
    assert config.fine_tiles(tree.params) and not config.fine_tiles(causal.params)
    for variant, keys in ((tree, 64), (causal, 128)):
        ctx = context(lower(variant), "prefill", "bfloat16", 128, "sm_90a")
        assert ctx["kv_tile"] == keys
        assert ctx["kv_tile"] == config.launch_config(
            "prefill", 128, 4, "bfloat16", "sm_90a", None,
            config.fine_tiles(variant.params)).kv_tile


def test_distance_table_shape():
    # A variant with a distance term takes a K stage less on the d128 wgmma path and gives its
    # 32 KB to the distance table: the same shared memory in all, so a launch (which knows no
    # variant) sizes it right. Other paths and head dims keep their shape.
    plain = config.template_shape("prefill", 128, "bfloat16", "sm_90a")
    wide = config.template_shape("prefill", 128, "bfloat16", "sm_90a", distance_table=True)
    assert (plain.key_stages, wide.key_stages, wide.stages) == (3, 2, 3)
    assert wide.smem_bytes == plain.smem_bytes == config.launch_config(
        "prefill", 128, 4, "bfloat16", "sm_90a").smem_bytes
    assert wide.distance_table_floats == (config.DISTANCE_TABLE_BYTES + 128 * 128 * 2 - 128) // 4
    assert plain.distance_table_floats == 736
    for dims, arch, fine in (((256, None), "sm_90a", False), ((64, None), "sm_90a", False),
                             ((192, 128), "sm_90a", False), ((128, None), None, False),
                             ((128, None), "sm_90a", True)):
        assert (config.template_shape("prefill", dims[0], "bfloat16", arch, dims[1], fine, True)
                == config.template_shape("prefill", dims[0], "bfloat16", arch, dims[1], fine))
    # render splices it for T5 (a distance term), not for causal
    t5 = attnlang.load(ROOT / "examples" / "t5_bias.attn")
    causal = attnlang.load(ROOT / "examples" / "causal.attn")
    assert lower(t5).distance_table and not lower(causal).distance_table
    for variant, stages, floats in ((t5, 2, wide.distance_table_floats), (causal, 3, 736)):
        ctx = context(lower(variant), "prefill", "bfloat16", 128, "sm_90a")
        assert (ctx["key_stages"], ctx["distance_table_floats"]) == (stages, floats)


def test_launch_config_merge_and_errors():
    # 4 slot groups per merge row, their states (o, m, d) in shared memory
    cfg = config.launch_config("merge", 64, 8, "bfloat16")
    assert cfg.block == (8, 4, 4) and cfg.rows_per_tile == 4 and cfg.smem_bytes == 16 * 66 * 4
    with pytest.raises(ValueError, match="group_size"):
        config.launch_config("decode", 128, 0)
    with pytest.raises(ValueError, match="kernel kind"):
        config.launch_config("bogus", 128, 1)


# ---------------------------------------------------------------------------- golden files


@pytest.mark.parametrize("path", VARIANT_FILES, ids=VARIANT_IDS)
def test_golden_decode_source(path):
    src = render(lower(load(path)), "decode", "bfloat16", 128)
    golden = GOLDEN / f"{path.stem}.decode.bf16.128.cu"
    if UPDATE_GOLDEN:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(src)
    assert golden.is_file(), f"missing {golden}: run with ATTNLANG_UPDATE_GOLDEN=1"
    assert src == golden.read_text(), (
        f"{golden.name} differs from the rendered source; if the change is intended, "
        "regenerate with ATTNLANG_UPDATE_GOLDEN=1 and review the diff")


# ---------------------------------------------------------------------------- NVRTC


def _toolchain_problem() -> str | None:
    try:
        from attnlang.runtime import compiler

        compiler.nvrtc_version()
        compiler.cuda_include_dirs()
    except Exception as e:  # ToolchainError, ImportError, a broken CuPy install
        return str(e)
    return None


_PROBLEM = _toolchain_problem()
needs_nvrtc = pytest.mark.skipif(
    _PROBLEM is not None, reason=f"needs NVRTC and CUDA headers: {(_PROBLEM or '')[:200]}")

# One compile takes ~0.3-1 s. Every variant x kind at bf16/128/sm_90a, plus two variants
# (qk_norm: reductions + rope in query and key; kitchen_sink: every other construct) over the
# whole dtype x head_dim x arch matrix: ~100 compiles.
_MATRIX = [(v, k, "bfloat16", 128, a) for v in CPU_HEAVY_IDS for k in KINDS
           for a in ("sm_90a", "sm_80")]
_MATRIX += [(v, k, d, hd, a) for v in ("qk_norm", "kitchen_sink") for k in KINDS
            for d in config.DTYPES for hd in config.HEAD_DIMS for a in ("sm_90a", "sm_80")
            if (d, hd) != ("bfloat16", 128)]
# MLA's head dims (queries and keys 192, values 128), "192/128" below.
_MATRIX += [(v, k, "bfloat16", "192/128", a) for v in ("qk_norm", "kitchen_sink") for k in KINDS
            for a in ("sm_90a", "sm_80")]


def head_dims(head_dim) -> tuple[int, int]:
    """A matrix entry's (head_dim, head_dim_vo): 128 -> (128, 128), "192/128" -> (192, 128)."""
    qk, _, vo = str(head_dim).partition("/")
    return int(qk), int(vo or qk)


_MMA_MATRIX = [(v, d, a, hd) for v in ("causal", "t5_bias", "longformer") for d in config.DTYPES
               for a in ("sm_90a", "sm_80") for hd in config.HEAD_DIMS]


@needs_nvrtc
@pytest.mark.parametrize("variant, dtype, arch, head_dim", _MMA_MATRIX,
                         ids=["-".join(map(str, m)) for m in _MMA_MATRIX])
def test_decode_on_tensor_cores_compiles_without_spills(variant, dtype, arch, head_dim):
    from attnlang.runtime.compiler import compile_source

    hooks = lower(attnlang.ir.with_kv_scales(load(by_id(variant))))
    src = render(hooks, "decode", dtype, head_dim, arch, None, config.KV_FP8)
    assert "attnlang decode kernel on tensor cores" in src
    cubin = compile_source(src, arch, name=generated_name(hooks, "decode"),
                           label=f"{variant} decode_mma {dtype}")
    (info,) = [f for f in cubin.functions if f.name == "decode"]
    assert info.spill_stores == info.spill_loads == info.stack_bytes == 0, cubin.log
    shape = config.template_shape("decode", head_dim, dtype, arch, decode_mma=True)
    assert info.registers <= 65536 // (shape.max_threads * shape.min_blocks)


@needs_nvrtc
@pytest.mark.parametrize("variant, kind, dtype, head_dim, arch", _MATRIX,
                         ids=["-".join(map(str, m)) for m in _MATRIX])
def test_compiles_without_spills(variant, kind, dtype, head_dim, arch):
    from attnlang.runtime.compiler import compile_source

    qk, vo = head_dims(head_dim)
    hooks = lower(load(by_id(variant)))
    src = render(hooks, kind, dtype, qk, None, vo)
    cubin = compile_source(src, arch, name=generated_name(hooks, kind),
                           label=f"{variant} {kind} {dtype} d{head_dim}")
    (info,) = [f for f in cubin.functions if f.name == kind]
    assert info.spill_stores == 0 and info.spill_loads == 0, cubin.log
    assert info.stack_bytes == 0, cubin.log
    shape = config.template_shape(kind, qk, dtype, None, vo)
    assert info.registers <= 65536 // (shape.max_threads * shape.min_blocks)
