"""Pass 4, render: `Hooks` -> the full, self-contained CUDA source of one kernel kind.

The templates (``kernels_templates/<kind>.cu.j2``) only splice: every value comes from here,
computed in Python (`attnlang.codegen.config` for the layout constants, `Hooks` for the
variant). Jinja2 runs with `StrictUndefined`, so a template naming a value this module does
not pass fails loudly instead of rendering an empty string. ``common.cuh`` and ``machine.cuh``
are spliced in by includes, so the only ``#include`` lines left are CUDA's own (cuda_fp16.h,
cuda_bf16.h). Included ``.cuh`` headers are C++, never Jinja: they are spliced verbatim
(inline PTX such as ``{%0, %1}`` operand lists would otherwise read as template tags).

After rendering, each `lower.LINE_RESET` marker becomes ``#line <n> "<variant>_<kind>.cu"``
with n the marker's own position, so lines after a hook are numbered as the generated file
again (the hooks' ``#line`` directives point into the .attn file).
"""

from __future__ import annotations

import functools

import jinja2

from attnlang import paths
from attnlang.codegen import config
from attnlang.codegen.c_expr import CTYPE, TENSOR_CTYPE, member_name
from attnlang.codegen.lower import LINE_RESET, Hooks
from attnlang.ir import KV_SCALE_PARAMS, ParamSpec

__all__ = ["render", "render_dequantize", "context", "environment", "generated_name",
           "decode_mma"]


class _Loader(jinja2.FileSystemLoader):
    """Templates (``*.j2``) as Jinja; headers (``*.cuh``) as verbatim text."""

    def get_source(self, environment, template):
        source, filename, uptodate = super().get_source(environment, template)
        if template.endswith(".cuh"):
            if "{% endraw %}" in source:
                raise ValueError(f"{filename} contains '{{% endraw %}}'")
            source = "{% raw %}" + source + "{% endraw %}"
        return source, filename, uptodate


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The Jinja2 environment of the kernel templates (StrictUndefined, no autoescape).

    Compiled templates are kept in the temp directory (Jinja keys them on the template's
    source), like the parser's tables: compiling them is a third of a cache hit's time.
    """
    return jinja2.Environment(
        loader=_Loader(str(paths.templates_dir())),
        bytecode_cache=_bytecode_cache(),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=False,
        lstrip_blocks=False,
    )


class _TemplateCache(jinja2.FileSystemBytecodeCache):
    """Jinja's file cache of compiled templates, where a cache file that cannot be read or
    written only costs the time to compile the template again."""

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except (OSError, ValueError, EOFError, TypeError):
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


def _bytecode_cache() -> jinja2.BytecodeCache | None:
    try:
        return _TemplateCache(pattern="attnlang-jinja-%s.cache")
    except (OSError, RuntimeError):  # no safe temp directory: compile the templates each time
        return None


def generated_name(hooks: Hooks, kind: str) -> str:
    """The file name the generated source calls itself in #line directives."""
    return f"{hooks.variant}_{kind}.cu"


def _header(name: str) -> str:
    return (paths.templates_dir() / name).read_text()


_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}


def _wgmma_call(name: str, doc: str, n: int, ptx_type: str, a_from_registers: bool) -> str:
    """One wgmma.mma_async m64n{n}k16 wrapper (fp32 accumulators d[n / 8][4]: d[j][c] is the
    element of n-tile j, c as in an mma.sync C fragment; the register order of the PTX ISA's
    wgmma D fragment). A from shared memory (descriptor, K-major) or registers (the mma.sync
    A fragment of the warp's 16 rows); B from shared memory, K-major for the former and
    MN-major (transposed) for the latter; d = A B + (accumulate ? d : 0). ptx_type "e4m3":
    m64n{n}k32 on e4m3 operands, both from shared memory and K-major (the only layout 8-bit
    wgmma reads)."""
    acc = [f"d[{j}][{c}]" for j in range(n // 8) for c in range(4)]
    k = len(acc)  # operands %0 .. %k-1 are the accumulators, then A, B, accumulate
    if a_from_registers:
        a_decl = "const unsigned (&a)[4]"
        a_ops = ", ".join(f'"r"(a[{i}])' for i in range(4)) + ", "
        a_list = "{ " + ", ".join(f"%{k + i}" for i in range(4)) + " }"
        flags, b = "1, 1, 1", k + 4  # scale-a, scale-b, transpose-b
    else:
        a_decl, a_ops, a_list = "const unsigned long long a_desc", '"l"(a_desc), ', f"%{k}"
        flags, b = "1, 1, 0, 0", k + 1  # scale-a, scale-b, transpose-a, transpose-b
        if ptx_type == "e4m3":
            flags = "1, 1"  # scale-a, scale-b (no transposes: K-major only)
    k_step = 32 if ptx_type == "e4m3" else 16
    d_list = ", ".join(f"%{i}" for i in range(k))
    outs = ",\n        ".join(", ".join(f'"+f"({x})' for x in acc[i:i + 8])
                               for i in range(0, k, 8))
    return (
        f"// {doc}\n"
        f"__device__ __forceinline__ void {name}(float (&d)[{n // 8}][4], {a_decl},\n"
        f"    const unsigned long long b_desc, const int accumulate) {{\n"
        f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{b + 1}, 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n{n}k{k_step}.f32.{ptx_type}.{ptx_type} "\n'
        f'      "{{ {d_list} }}, {a_list}, %{b}, p, {flags};\\n}}\\n"\n'
        f"      : {outs}\n"
        f'      : {a_ops}"l"(b_desc), "r"(accumulate));\n'
        f"}}\n"
    )


def _wgmma_source(shape: config.TemplateShape) -> str:
    """The wgmma helpers (wgmma.cuh) and this instance's wrappers: wgmma_qk (S = Q K^T,
    N = sub_keys keys), wgmma_pv (O += P V, N = head_dim_vo) and wgmma_qk_e4m3 (S on e4m3
    tiles: an fp8 cache's kernel with bf16 q, prefill_shape.cuh's kFp8Qk). Spliced into every
    prefill source; only the wgmma path calls them, so other targets never emit them."""
    ptx = _PTX_TYPE[shape.dtype]
    return "\n".join((
        _header("wgmma.cuh"),
        "namespace attnlang {",
        _wgmma_call("wgmma_qk", "S (+)= Q K^T: Q and K tiles in shared memory", shape.sub_keys,
                    ptx, a_from_registers=False),
        _wgmma_call("wgmma_pv", "O (+)= P V: P in registers, V in shared memory (MN-major)",
                    shape.head_dim_vo, ptx, a_from_registers=True),
        _wgmma_call("wgmma_qk_e4m3", "S (+)= Q K^T on e4m3 tiles (an fp8 cache's raw keys, kFp8Qk)",
                    shape.sub_keys, "e4m3", a_from_registers=False),
        "}  // namespace attnlang",
    ))


def _kv_source(hooks: Hooks, kv_dtype: str | None, dtype: str) -> tuple[str, str]:
    """(the cache's C element type, ``kv_scales``: the dequantisation scales of a KV head as
    (k, v)) for a cache of kv_dtype (None: dtype, unscaled)."""
    if kv_dtype is None or kv_dtype == dtype:
        ctype = config.dtype_ctype(dtype)
        body = "return make_float2(1.0f, 1.0f);  // unused: not an fp8 cache"
    elif kv_dtype == config.KV_FP8:
        names = {p.name for p in hooks.kernel_params}
        missing = [n for n in KV_SCALE_PARAMS if f"param_{n}" not in names]
        if missing:
            raise ValueError(f"an fp8 cache's kernels need the params {', '.join(KV_SCALE_PARAMS)} "
                             "(lower ir.with_kv_scales(variant))")
        k, v = (member_name(n) for n in KV_SCALE_PARAMS)
        ctype = "unsigned char"
        body = f"return make_float2(__ldg(p.{k} + kv_head), __ldg(p.{v} + kv_head));"
    else:
        raise ValueError(f"unsupported kv_dtype {kv_dtype!r}: expected {dtype} or {config.KV_FP8}")
    source = ("namespace attnlang {\n"
              "// The KV cache's dequantisation scales of KV head kv_head: (k, v).\n"
              "__device__ __forceinline__ float2 kv_scales(const variant::Params& p, "
              "const int kv_head) {\n"
              f"  {body}\n"
              "}\n"
              "}  // namespace attnlang\n")
    return ctype, source


def decode_mma(hooks: Hooks, head_dim: int, head_dim_vo: int | None,
               kv_dtype: str | None) -> bool:
    """Is this variant's decode kernel the tensor-core one (`config.decode_mma`)?"""
    return config.decode_mma(head_dim, head_dim_vo, kv_dtype, softmax=hooks.softmax,
                             kv_hooks=hooks.has_key or hooks.has_value,
                             pair_masks=hooks.pair_masks)


def context(hooks: Hooks, kind: str, dtype: str, head_dim: int,
            arch: str | None = None, head_dim_vo: int | None = None,
            kv_dtype: str | None = None) -> dict[str, object]:
    """Every value a template splices, by name. Raises ValueError for a bad kind, dtype or
    head dims (`config.template_shape` validates them; head_dim_vo None: head_dim).

    ``hooks_source`` carries what the hooks need besides common.cuh: the interval helpers of
    ``variant::mask_tile`` (mask_tiles.cuh), spliced verbatim ahead of the hooks. arch picks
    the prefill path (`config.uses_wgmma`); ``wgmma`` is its C++ literal, ``wgmma_source``
    the Hopper helpers (prefill only). kv_dtype: the cache's element type (None: dtype);
    ``kv_ctype`` is its C type and ``kv_source`` its ``kv_scales``. ``template`` names the
    .cu.j2 file: the kind's for decode and merge (decode_mma's for a decode kernel on tensor
    cores, `decode_mma`); for prefill and cascade the instruction path's, prefill_wgmma where
    `config.uses_wgmma` holds, else prefill_mma.
    """
    shape = config.template_shape(kind, head_dim, dtype, arch, head_dim_vo, hooks.pair_masks,
                                  hooks.distance_table,
                                  kind == "decode" and decode_mma(hooks, head_dim, head_dim_vo,
                                                                  kv_dtype))
    kv_ctype, kv_source = _kv_source(hooks, kv_dtype, dtype)
    cascade = kind == "cascade"
    if cascade and hooks.kv_reads_request:
        raise ValueError(
            f"variant {hooks.variant!r} has no cascade kernel: its key or value hook reads "
            "`batch`, `qo_len` or `kv_len`, so the keys of a prefix shared by several "
            "requests differ per request; plan without cascade")
    return {
        # The kernel's template: the decode kernel's (decode.cu.j2, or decode_mma.cu.j2 on
        # tensor cores), the merge kernel's, or the prefill kernel of the instruction path
        # (prefill_wgmma.cu.j2 or prefill_mma.cu.j2; a cascade kernel is one with kCascade).
        "template": ("decode_mma" if shape.decode_mma else
                     ("prefill_wgmma" if shape.wgmma else "prefill_mma")
                     if kind in ("prefill", "cascade") else kind),
        "variant_name": hooks.variant,
        "dtype": dtype,
        "ctype": shape.ctype,
        "kv_ctype": kv_ctype,
        "kv_source": kv_source,
        "head_dim": shape.head_dim,
        "head_dim_vo": shape.head_dim_vo,
        "vec": shape.vec,
        "vec_vo": shape.vec_vo,
        "tx": shape.tx,
        "kv_tile": shape.kv_tile,
        "stages": shape.stages,
        "key_stages": shape.key_stages,
        "chunk": shape.chunk,
        "max_threads": shape.max_threads,
        "min_blocks": shape.min_blocks,
        "row_blocks": shape.row_blocks,
        "sub_keys": shape.sub_keys,
        "distance_table_floats": shape.distance_table_floats,
        "producer_threads": shape.producer_threads,
        "barrier_bytes": config.PIPELINE_BARRIER_BYTES if shape.producer_threads else 0,
        "wgmma": "true" if shape.wgmma else "false",
        "wgmma_source": _wgmma_source(shape) if kind in ("prefill", "cascade") else "",
        # The cascade kernel (a prefill kernel with kCascade): two more plan arrays.
        "entry": kind,  # the extern "C" name: the kind's
        "cascade": "true" if cascade else "false",
        "cascade_args": ("\n        const int* __restrict__ cascade_item,"
                         "\n        const int* __restrict__ token_request," if cascade else ""),
        "cascade_init": "cascade_item, token_request" if cascade else "nullptr, nullptr",
        "hooks_source": _header("mask_tiles.cuh") + "\n" + hooks.source,
        "variant_params": hooks.kernel_params_decl,
        "params_init": hooks.params_init,
    }


def _resolve_line_resets(text: str, name: str) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() == LINE_RESET:
            # `#line n` names the number of the line after the directive: 1-based i + 2.
            lines[i] = f'#line {i + 2} "{name}"'
    return "\n".join(lines)


def render(hooks: Hooks, kind: str, dtype: str, head_dim: int, arch: str | None = None,
           head_dim_vo: int | None = None, kv_dtype: str | None = None) -> str:
    """The complete CUDA source of kernel `kind` ("decode", "prefill" or "merge") for these
    hooks.

    dtype: "float16" or "bfloat16"; head_dim: 64, 128 or 256, or 192 with head_dim_vo 128
    (`config.HEAD_DIM_PAIRS`; head_dim_vo None: head_dim); arch: the compile target, which
    picks the prefill path (None: mma.sync, which every sm_80+ target runs; "sm_90a": wgmma
    at head_dim 64, 128 and 192/128). The source's ``extern "C"``
    entry is named after the kind; its arguments are INTERNALS.md's followed by
    ``hooks.kernel_params``. kv_dtype: the K/V cache's element type, None for dtype, or
    "float8_e4m3fn" (the hooks then need the scale params: `ir.with_kv_scales`). Raises
    ValueError for an unsupported kind, dtype, kv_dtype or head_dim.

    Example::

        src = render(lower(attnlang.load("examples/softcap.attn")), "decode", "bfloat16", 128)
        'extern "C" __global__' in src   # True
    """
    ctx = context(hooks, kind, dtype, head_dim, arch, head_dim_vo, kv_dtype)
    text = environment().get_template(f"{ctx['template']}.cu.j2").render(**ctx)
    return _resolve_line_resets(text, generated_name(hooks, kind))


def render_dequantize(params: tuple[ParamSpec, ...], dtype: str, head_dim: int,
                      head_dim_vo: int | None = None) -> str:
    """The CUDA source of the kernel that converts an fp8 cache's pages into `dtype` for the
    prefill kernel of a bf16/fp16 cache (dequantize.cu.j2; runtime/dequantize.py). params:
    the fp8 module's params, k_scale and v_scale last (`ir.with_kv_scales`): the kernel takes
    them all, as every kernel of the module does, and reads the two scales.

    ``'extern "C" __global__' in render_dequantize(with_kv_scales(v).params, "bfloat16", 128)``
    """
    if tuple(p.name for p in params[-2:]) != KV_SCALE_PARAMS:
        raise ValueError(f"the params must end with {', '.join(KV_SCALE_PARAMS)} (an fp8 "
                         f"module's), got {[p.name for p in params]}")
    head_dim, head_dim_vo = config.check_head_dims(head_dim, head_dim_vo)
    decls = "".join(f",\n    {TENSOR_CTYPE[p.type] if p.is_tensor else CTYPE[p.type]} "
                    f"param_{p.name}" for p in params)
    return environment().get_template("dequantize.cu.j2").render(
        dtype=dtype, ctype=config.dtype_ctype(dtype), head_dim=head_dim,
        head_dim_vo=head_dim_vo, variant_params=decls)
