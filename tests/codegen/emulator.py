"""Run the rendered decode and merge kernels on the CPU, for tests on machines without a GPU.
(The tensor-core decode kernel, decode_mma.cu.j2, builds with emulator_prefill's warp
collectives.)

The real rendered source (`attnlang.codegen.render.render`) is compiled as C++ by g++ against
``emulator_shim.h``, which emulates the CUDA subset the templates use (threads, barriers,
group shuffles, cp.async, half/bf16); the few inline PTX statements of common.cuh and
machine.cuh are replaced by the shim's calls. Each kernel becomes a small executable that
reads its arguments from a directory of raw arrays and writes its outputs back.

What this checks: indexing, paging, tiling and pipeline order, work items and partial
states, the TZ merge, the merge kernel, masking and -inf handling, every hook's lowering.
What it does not: timing, the precision of the fast intrinsics (exact libm stands in), and
the real scheduler's interleavings (eager and lazy copy modes bracket the pipeline's).

    result = run_case(attnlang.load("examples/causal.attn"), workdir, kv_chunk_size=24)
    result.rel_err, result.lse_err
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnlang import fp8, ir, paths, reference
from attnlang.codegen.config import KV_FP8, launch_config
from attnlang.codegen.lower import lower
from attnlang.codegen.render import decode_mma, render
from attnlang.runtime import pairmask
from attnlang.runtime.planner import plan_batch

SHIM = Path(__file__).with_name("emulator_shim.h")

# Inline PTX statements of common.cuh and machine.cuh -> the shim's equivalents.
_PTX = [
    ('asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));', "y = exp2f(x);"),
    ('asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));', "y = tanhf(x);"),
    ('asm("mov.u32 %0, %%laneid;" : "=r"(lane));', "lane = emu_laneid();"),
    ('asm volatile("cp.async.commit_group;\\n" ::: "memory");', "emu_commit();"),
    ('asm volatile("cp.async.wait_group %0;\\n" :: "n"(N) : "memory");', "emu_wait(N);"),
    ('asm volatile("cp.async.wait_all;\\n" ::: "memory");', "emu_wait(0);"),
]
_CP_ASYNC = re.compile(r'asm volatile\("cp\.async\.cg\.shared\.global.*?\);', re.S)
_CP_ASYNC_8 = re.compile(r'asm volatile\("cp\.async\.ca\.shared\.global \[%0\], \[%1\], 8, '
                         r'%2;.*?\);', re.S)
# Any other inline PTX (helpers of other kernels, e.g. mma / ldmatrix) compiles to a trap.
_OTHER_ASM = re.compile(r"^(\s*)asm\s*(?:volatile\s*)?\(.*?\);", re.S | re.M)

_MAIN = r"""
#include <fstream>
#include <iterator>
#include <string>
static std::string g_dir;
static std::map<std::string, std::vector<float4>> g_bufs;  // 16-byte aligned storage
static std::map<std::string, size_t> g_sizes;
static void* buf(const char* name) {
  auto it = g_bufs.find(name);
  if (it != g_bufs.end()) return it->second.data();
  std::ifstream f(g_dir + "/" + name + ".bin", std::ios::binary);
  if (!f) { fprintf(stderr, "missing array %s\n", name); std::_Exit(7); }
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<float4> v(bytes.size() / 16 + 1);
  memcpy(v.data(), bytes.data(), bytes.size());
  g_sizes[name] = bytes.size();
  g_bufs[name] = std::move(v);
  return g_bufs[name].data();
}
static double num(const char* name) {
  std::ifstream f(g_dir + "/" + name + ".txt");
  double x;
  if (!(f >> x)) { fprintf(stderr, "missing scalar %s\n", name); std::_Exit(7); }
  return x;
}
static int ival(const char* name) { return (int)num(name); }
static float fval(const char* name) { return (float)num(name); }
int main(int argc, char** argv) {
  g_dir = argv[1];
  dim3u block{(unsigned)ival("block_x"), (unsigned)ival("block_y"), (unsigned)ival("block_z")};
  emu_launch(@KIND@, (unsigned)ival("grid"), block, (size_t)ival("smem"), @ARGS@);
  for (const char* name : {@OUTS@}) {
    if (!g_bufs.count(name)) continue;
    std::ofstream f(g_dir + "/" + name + ".out", std::ios::binary);
    f.write((const char*)g_bufs[name].data(), g_sizes[name]);
  }
  return 0;
}
"""


def available() -> str | None:
    """None if g++ can build the emulator here, else why not."""
    if shutil.which("g++") is None:
        return "g++ not found"
    probe = subprocess.run(["g++", "-std=c++17", "-x", "c++", "-fsyntax-only", "-"],
                           input="_Float16 h = 1; int main() {}", capture_output=True, text=True)
    return None if probe.returncode == 0 else "g++ lacks _Float16"


def entry_args(src: str, kind: str) -> list[tuple[str, str]]:
    """(C type, name) of each argument of the extern "C" entry `kind`."""
    m = re.search(rf'extern "C" __global__ void __launch_bounds__\([^)]*\)\s*{kind}\((.*?)\)'
                  r"\s*\{", src, re.S)
    args = []
    for decl in m.group(1).split(","):
        ctype, name = " ".join(decl.replace("__restrict__", "").split()).rsplit(" ", 1)
        args.append((ctype, name))
    return args


def _emulated_device_code(src: str) -> str:
    """Device code that includes common.cuh and machine.cuh, with the shim for CUDA's headers
    and their inline PTX (other inline PTX becomes a trap)."""
    src = src.replace("#include <cuda_fp16.h>", f'#include "{SHIM}"')
    src = src.replace("#include <cuda_bf16.h>", "")
    for ptx, emu in _PTX:
        assert ptx in src, f"{ptx!r} not found in common.cuh or machine.cuh: update the emulator"
        src = src.replace(ptx, emu)
    src, n = _CP_ASYNC.subn("emu_cp_async(smem_dst, gmem_src, valid);", src)
    src, n8 = _CP_ASYNC_8.subn("emu_cp_async(smem_dst, gmem_src, valid, 8);", src)
    assert n == 1 and n8 == 1, "machine.cuh changed: cp.async statements not found"
    return _OTHER_ASM.sub(r"\1emu_unsupported(__LINE__);", src)


def common_program(main: str) -> str:
    """common.cuh and machine.cuh alone, emulated, followed by `main` (C++ using namespace
    attnlang): unit tests of their helpers."""
    headers = "\n".join((paths.templates_dir() / name).read_text()
                        for name in ("common.cuh", "machine.cuh"))
    return _emulated_device_code(headers) + "\nusing namespace attnlang;\n" + main


def _emulated_source(src: str, kind: str) -> str:
    src = _emulated_device_code(src)
    src = src.replace("extern __shared__ __align__(16) unsigned char smem[];",
                      "unsigned char* smem = emu_smem();")
    args = entry_args(src, kind)
    # No tensor maps: the emulated kernels are the mma.sync path's (no producer, no TMA).
    calls = [f"({t})nullptr" if n == "tma_maps" else
             f'({t})buf("{n}")' if "*" in t else
             f'ival("{n}")' if "int" in t else f'fval("{n}")' for t, n in args]
    outs = [n for t, n in args if "*" in t and not t.startswith("const")]
    main = (_MAIN.replace("@KIND@", kind).replace("@ARGS@", ",\n      ".join(calls))
            .replace("@OUTS@", ", ".join(f'"{o}"' for o in outs)))
    return src + main


def build(hooks, kind: str, dtype: str, head_dim: int, bin_dir: Path,
          head_dim_vo: int | None = None, kv_dtype: str | None = None) -> Path:
    """The emulator executable of one kernel (cached in bin_dir by source hash)."""
    if kind == "decode" and decode_mma(hooks, head_dim, head_dim_vo, kv_dtype):
        from tests.codegen import emulator_prefill  # its shim has the mma warp collectives

        return emulator_prefill.build(hooks, kind, dtype, head_dim, bin_dir, head_dim_vo,
                                      kv_dtype)
    src = _emulated_source(render(hooks, kind, dtype, head_dim, None, head_dim_vo, kv_dtype),
                           kind)
    return compile_cached(src, f"{hooks.variant}_{kind}_{dtype}_{head_dim}_{head_dim_vo}",
                          bin_dir, (SHIM,))


def kv_data(rng, shape: tuple[int, ...], dtype: str, kv_dtype: str | None,
            scales: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """A random K or V cache: (its raw storage, the float64 values the kernels compute
    with). An fp8 cache (kv_dtype KV_FP8) holds values of a few magnitudes as e4m3 bytes
    over its scale per KV head (axis 2), as a cache writer quantises them (scales near
    amax / 448 use the whole e4m3 range), seen times the scale."""
    if kv_dtype != KV_FP8:
        return _to_bits(rng.standard_normal(shape), dtype)
    per_head = scales.astype(np.float64)[None, None, :, None]
    values = rng.standard_normal(shape) * np.exp2(rng.integers(-2, 2, shape))
    bits = fp8.to_e4m3(values / per_head)
    return bits, fp8.from_e4m3(bits) * per_head


def with_kv_scales(v: ir.Variant, params: dict, kv_dtype: str | None, scales) -> tuple:
    """(the variant the kernels are built from, their params): an fp8 cache adds k_scale and
    v_scale (`ir.with_kv_scales`; scales: (k, v) float32 arrays [num_kv_heads])."""
    if kv_dtype != KV_FP8:
        return v, params
    return ir.with_kv_scales(v), {**params, "k_scale": scales[0], "v_scale": scales[1]}


def compile_cached(src: str, name: str, bin_dir: Path, shims: tuple[Path, ...]) -> Path:
    """g++ of an emulated source, cached in bin_dir under name and a hash of the source and
    of the shim headers it includes."""
    text = src + "".join(shim.read_text() for shim in shims)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    exe = bin_dir / f"{name}_{digest}"
    if not exe.exists():
        bin_dir.mkdir(parents=True, exist_ok=True)
        cpp = exe.with_suffix(".cpp")
        cpp.write_text(src)
        r = subprocess.run(["g++", "-std=c++17", "-O1", "-pthread", "-w", "-o", str(exe),
                            str(cpp)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"g++ failed on {cpp}:\n{r.stderr[:4000]}")
    return exe


def _launch(exe: Path, workdir: Path, arrays: dict, scalars: dict, grid: int, cfg,
            eager: bool) -> dict[str, np.ndarray]:
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    for name, a in arrays.items():
        np.ascontiguousarray(a).tofile(workdir / f"{name}.bin")
    launch = {"grid": grid, "block_x": cfg.block[0], "block_y": cfg.block[1],
              "block_z": cfg.block[2], "smem": cfg.smem_bytes}
    for name, value in {**scalars, **launch}.items():
        text = str(int(value)) if isinstance(value, (int, np.integer)) else repr(float(value))
        (workdir / f"{name}.txt").write_text(text)
    env = {**os.environ, "EMU_EAGER": "1" if eager else "0"}
    r = subprocess.run([str(exe), str(workdir)], capture_output=True, text=True, env=env,
                       timeout=600)
    if r.returncode:
        raise RuntimeError(f"emulated kernel failed (exit {r.returncode}): {r.stderr[:2000]}")
    outs = {}
    for name, a in arrays.items():
        path = workdir / f"{name}.out"
        if path.exists():
            outs[name] = np.fromfile(path, dtype=a.dtype).reshape(a.shape)
    return outs


def _to_bits(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Round float data to dtype: (raw 16-bit storage, the rounded values in float64)."""
    x = np.asarray(x, np.float32)
    if dtype == "float16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    u = x.view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    return bits, _from_bits(bits, dtype)


def _from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _params(v: ir.Variant, rng, sizes: dict[str, dict[str, int]], kv_lens, given,
            qo_lens=()) -> dict:
    """Random run-time params; sizes: each param's named extents (`ir.extent_sizes`); a
    per-pair mask gets random 16 x 32 blocks, all true, all false or mixed (every tile class)."""
    params = {}
    for p in v.params:
        if p.is_pair:
            params[p.name] = [random_pair_mask(rng, int(q), int(k))
                              for q, k in zip(qo_lens, kv_lens, strict=True)]
            continue
        if not p.is_tensor:
            params[p.name] = p.default if p.default is not None else (
                float(rng.uniform(0.5, 2.0)) if p.type is ir.FLOAT else int(rng.integers(0, 5)))
            continue
        n = p.shape(sizes[p.name])
        if p.type is ir.BOOL:
            params[p.name] = rng.random(n) < 0.3
        elif p.type is ir.FLOAT:
            params[p.name] = ((1.0 + 0.2 * rng.standard_normal(n)) if p.extents == ("dim",)
                              else rng.uniform(0.01, 0.3, n)).astype(np.float32)
        else:
            high = int(min(kv_lens)) if p.extents == ("batch",) else 5
            params[p.name] = rng.integers(0, max(1, high), n).astype(np.int32)
    params.update(given or {})
    return params


@dataclass(frozen=True)
class Result:
    rel_err: float  # ||out - ref|| / ||ref|| over the whole output
    lse_err: float | None  # max |lse - ref| over finite rows (None: softmax off)
    lse_finite_matches: bool  # lse is finite exactly where the reference's is
    has_nan: bool
    work_items: int
    merge_rows: int


_TENSOR_DTYPE = {ir.FLOAT: np.float32, ir.INT: np.int32, ir.BOOL: np.uint8}


def random_pair_mask(rng, q: int, k: int) -> np.ndarray:
    """A [q, k] bool matrix of 16 x 32 blocks, each all true, all false or random."""
    kind = rng.integers(0, 3, (-(-q // 16), -(-k // 32)))
    kind = np.repeat(np.repeat(kind, 16, 0), 32, 1)[:q, :k]
    return np.where(kind == 2, rng.random((q, k)) < 0.5, kind == 1)


def kernel_param_values(hooks, v: ir.Variant, params: dict, scalars: dict,
                        qo_lens=(), kv_lens=()) -> dict:
    """Split the variant's run-time params into kernel arguments: scalars go into `scalars`
    (by kernel parameter name); tensor params are returned as float32 / int32 / uint8 (bool)
    arrays, a per-pair mask as plan()'s packed buffer."""
    tensors = {}
    for kp, spec in zip(hooks.kernel_params, v.params, strict=True):
        if spec.is_pair:
            masks = pairmask.normalize(params[spec.name], qo_lens, kv_lens, spec.name)
            tensors[kp.name] = pairmask.pack(masks)
        elif spec.is_tensor:
            tensors[kp.name] = np.asarray(
                params[spec.name], _TENSOR_DTYPE[spec.type])
        else:
            scalars[kp.name] = params[spec.name]
    return tensors


def run_case(v: ir.Variant, workdir: Path, *, dtype: str = "bfloat16", head_dim: int = 64,
             num_heads: int = 8, num_kv_heads: int = 2, qo_lens=(1, 3, 2),
             kv_lens=(37, 100, 5), page_size: int = 16, num_ctas: int = 4,
             kv_chunk_size: int | None = None, params: dict | None = None,
             sm_scale: float | None = None, eager: bool = False, seed: int = 0,
             head_dim_vo: int | None = None, kv_dtype: str | None = None) -> Result:
    """Plan a random paged batch, run decode (+ merge) emulated, compare with the reference.

    Pages are shuffled in memory; out, lse and the partial buffers start as NaN.
    kv_chunk_size forces split requests (partial states + the merge kernel). kv_dtype
    KV_FP8: an fp8 cache with random scales per KV head (the reference sees the values).
    """
    rng = np.random.default_rng(seed)
    group = num_heads // num_kv_heads
    qo_lens, kv_lens = np.asarray(qo_lens), np.asarray(kv_lens)
    total_q = int(qo_lens.sum())
    pages = [-(-int(n) // page_size) for n in kv_lens]
    total_pages = sum(pages) + 3  # a few unused pages
    kv_indices = rng.permutation(total_pages)[:sum(pages)].astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    # tokens in each request's last page (0 for a request without pages)
    last = np.array([int(n) - (p - 1) * page_size if p else 0
                     for n, p in zip(kv_lens, pages, strict=True)], np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    dv = head_dim if head_dim_vo is None else head_dim_vo
    q_bits, q = _to_bits(rng.standard_normal((total_q, num_heads, head_dim)), dtype)
    cache_shape = (total_pages, page_size, num_kv_heads, head_dim)
    kv_scales = rng.uniform(0.004, 0.03, (2, num_kv_heads)).astype(np.float32)
    k_bits, k = kv_data(rng, cache_shape, dtype, kv_dtype, kv_scales[0])
    v_bits, vv = kv_data(rng, cache_shape[:3] + (dv,), dtype, kv_dtype, kv_scales[1])
    sizes = ir.extent_sizes(v, num_heads, num_kv_heads, len(qo_lens), head_dim, dv)
    params = _params(v, rng, sizes, kv_lens, params, qo_lens)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    ref_o, ref_lse = reference.attention_paged(v, q, k, vv, qo_indptr, kv_indptr, kv_indices,
                                               last, params=params, sm_scale=scale)

    v, params = with_kv_scales(v, params, kv_dtype, kv_scales)
    hooks = lower(v)
    cfg = launch_config("decode", head_dim, group, dtype, head_dim_vo=dv,
                        decode_mma=decode_mma(hooks, head_dim, dv, kv_dtype))
    plan = plan_batch(qo_lens, kv_lens, num_kv_heads=num_kv_heads, group_size=group,
                      rows_per_tile=cfg.rows_per_tile, num_ctas=num_ctas,
                      kv_align=cfg.kv_tile, kv_chunk_size=kv_chunk_size)
    nan16 = np.uint16(0x7FFF if dtype == "float16" else 0x7FC0)
    partial_rows = max(1, plan.num_partial_rows)
    arrays = {
        "q": q_bits, "k_cache": k_bits, "v_cache": v_bits,
        "out": np.full((total_q, num_heads, dv), nan16, np.uint16),
        "lse": np.full((total_q, num_heads), np.nan, np.float32),
        "qo_indptr": qo_indptr, "kv_indptr": kv_indptr,
        "kv_indices": kv_indices if len(kv_indices) else np.zeros(1, np.int32),
        "kv_last_page_len": last,
        "partial_o": np.full((partial_rows, dv), np.nan, np.float32),
        "partial_lse": np.full((partial_rows,), np.nan, np.float32),
        **{name: a.astype(np.int32) for name, a in plan.work_arrays().items()},
    }
    scalars = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "page_size": page_size,
               "sm_scale": scale}
    tensor_params = kernel_param_values(hooks, v, params, scalars, qo_lens, kv_lens)
    arrays.update(tensor_params)
    bin_dir = workdir / "bin"
    res = _launch(build(hooks, "decode", dtype, head_dim, bin_dir, dv, kv_dtype),
                  workdir / "run", arrays, scalars, plan.num_ctas, cfg, eager)
    out, lse = res["out"], res["lse"]
    if plan.merge_count:
        merge_arrays = {
            "merge_count": np.array([plan.merge_count], np.int32), "out": out, "lse": lse,
            "partial_o": res["partial_o"], "partial_lse": res["partial_lse"],
            "qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_last_page_len": last,
            **{name: a.astype(np.int32) for name, a in plan.merge_arrays().items()},
            **tensor_params,
        }
        mcfg = launch_config("merge", head_dim, group, dtype, head_dim_vo=dv)
        res = _launch(build(hooks, "merge", dtype, head_dim, bin_dir, dv), workdir / "run",
                      merge_arrays, scalars, 2, mcfg, eager)
        out, lse = res["out"], res["lse"]

    o = _from_bits(out, dtype)
    has_nan = bool(np.isnan(o).any() or (ref_lse is not None and np.isnan(lse).any()))
    rel_err = float(np.linalg.norm(o - ref_o) / max(np.linalg.norm(ref_o), 1e-30))
    lse_err, finite_ok = None, True
    if ref_lse is not None:
        finite = np.isfinite(ref_lse)
        finite_ok = bool((np.isfinite(lse) == finite).all()
                         and (lse[~finite] == -np.inf).all())
        lse_err = float(np.abs(lse[finite] - ref_lse[finite]).max()) if finite.any() else 0.0
    return Result(rel_err, lse_err, finite_ok, has_nan, plan.num_work_items, plan.merge_count)
