"""Per-CTA timestamps of one kernel launch: when each CTA of the decode or prefill kernel got
past its wait for the kernel before, when it finished, and on which SM; read back after a
CUDA-graph replay. Event timing sees only a kernel's total; this shows its tail (CTAs with
equal work ending microseconds apart: benchmarks/NOTES.md, "Where fp8 decode's last 10-15%
go") and how the time splits between the kernel and the rest of the graph.

The kernels are compiled from a patched copy of kernels_templates/: a `__device__` array and
two %globaltimer reads per CTA (`patch_templates`), so the figures include that small cost. The
tensor-core decode kernel (an fp8 cache) and the prefill kernel's wgmma path (which also runs
bf16 GQA decode steps) are stamped; other kernels report no stamps.

Workloads: decode as benchmarks/fp8_kv.py's (32/8 heads, d128, page 16, pages shuffled, one
input set), prefill as benchmarks/prefill.py's specs (causal variants only; bf16).

Run from the repository root on the GPU machine:
    python3 benchmarks/cta_stamps.py decode [--kv fp8|bf16] [--only b1_l32768,...]
                                            [--chunks auto,512]
    python3 benchmarks/cta_stamps.py prefill [--only causal_s4096,...]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

try:
    import common as C
except ImportError:  # run as `python3 -m benchmarks.cta_stamps`
    from benchmarks import common as C

MAX_CTAS = 4096  # CTAs stamped (a launch's first MAX_CTAS)
STAMPS = "attnlang_cta_stamps"

_PRELUDE = f"""// cta_stamps.py: per-CTA [passed the wait, finished, SM] in %globaltimer ns.
__device__ unsigned long long {STAMPS}[{MAX_CTAS}][3];
__device__ __forceinline__ unsigned long long attnlang_now() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}}
__device__ __forceinline__ void attnlang_stamp(const unsigned long long start) {{
  if (blockIdx.x < {MAX_CTAS}) {{
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    {STAMPS}[blockIdx.x][0] = start;
    {STAMPS}[blockIdx.x][1] = attnlang_now();
    {STAMPS}[blockIdx.x][2] = sm;
  }}
}}
"""
_ENTRY = 'extern "C" __global__'
_START = "  const unsigned long long stamp_start = attnlang_now();\n"
_WAIT = ("  wait_for_prerequisites();  // ... and this one reads nothing else before the one "
         "before is done\n")
_LAST_ITEM_END = ("                                   num_kv_heads, params);\n"
                  "    }\n  }\n")
_ITEM_END = ("        named_arrive(kItemBarrier, kThreads + kProducerThreads);\n"
             "      }\n    }\n  }\n")

# file -> [(anchor, replacement)]; each anchor must occur exactly once.
PATCHES: dict[str, list[tuple[str, str]]] = {
    "decode_mma.cu.j2": [
        (_ENTRY, _PRELUDE + _ENTRY),
        ("  wait_for_prerequisites();\n", "  wait_for_prerequisites();\n" + _START),
        (_LAST_ITEM_END + "}", _LAST_ITEM_END + "  if (tid == 0) attnlang_stamp(stamp_start);\n}"),
    ],
    "prefill_entry.cu.j2": [
        (_ENTRY, _PRELUDE + _ENTRY),
        (_WAIT, _WAIT + _START),
    ],
    "prefill_wgmma.cu.j2": [
        # thread 0 computes (the producer's threads returned before the item loop)
        (_ITEM_END + "}", _ITEM_END + "  if (tid == 0) attnlang_stamp(stamp_start);\n}"),
    ],
}


def patch_templates(src: Path, dst: Path) -> None:
    """Copy the template directory src to dst with the stamps added (PATCHES). Raises
    ValueError naming the file when an anchor is not found exactly once (the templates
    changed: update PATCHES)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for name, edits in PATCHES.items():
        path = dst / name
        text = path.read_text()
        for anchor, replacement in edits:
            n = text.count(anchor)
            if n != 1:
                raise ValueError(f"cta_stamps: {name} holds {n} copies of the anchor "
                                 f"{anchor[:60]!r}; update PATCHES")
            text = text.replace(anchor, replacement)
        path.write_text(text)


def use_patched_templates(workdir: Path) -> None:
    """Point attnlang's renderer at a stamped copy of its templates (before anything renders)."""
    from attnlang import paths
    from attnlang.codegen import render

    dst = workdir / "kernels_templates"
    patch_templates(paths.templates_dir(), dst)
    paths.templates_dir = lambda: dst
    render.environment.cache_clear()


def read_stamps(attn, kind: str):
    """[n, 3] int64 stamps of `kind`'s kernel as BatchAttention `attn` loaded it (None where
    the kernel is not loaded or not stamped); rows of CTAs that did not stamp are dropped."""
    import cupy

    loaded = attn.module._loaded.get(attn.device, {}).get(kind)  # (module, function, smem)
    if loaded is None:
        return None
    try:
        ptr = loaded[0].get_global_var(STAMPS)
    except Exception:  # noqa: BLE001 - a kernel built without the stamps
        return None
    ptr = ptr[0] if isinstance(ptr, tuple) else ptr
    mem = cupy.cuda.UnownedMemory(int(ptr), MAX_CTAS * 3 * 8, loaded[0])
    view = cupy.ndarray((MAX_CTAS, 3), dtype=cupy.uint64, memptr=cupy.cuda.MemoryPointer(mem, 0))
    out = view.get().astype(np.int64)
    view.fill(0)  # the next launch's CTAs write their own rows
    return out[out[:, 1] > 0]


def summary(stamps: np.ndarray) -> dict:
    """Figures of one launch's stamps (us, from the earliest wait)."""
    t0 = stamps[:, 0].min()
    ends = (stamps[:, 1] - t0) / 1e3
    span = float(ends.max())
    by_sm: dict[int, float] = {}
    for end, sm in zip(ends, stamps[:, 2], strict=True):
        by_sm[int(sm)] = max(by_sm.get(int(sm), 0.0), float(end))
    sm_ends = np.array([by_sm[k] for k in sorted(by_sm)])
    return dict(ctas=len(stamps), span=span, p10=float(np.percentile(ends, 10)),
                p50=float(np.median(ends)), mean_over_max=float(ends.mean()) / span,
                at90=float((ends > 0.9 * span).mean()), at95=float((ends > 0.95 * span).mean()),
                sm_min=float(sm_ends.min()), sm_med=float(np.median(sm_ends)))


def _call(attn, q, kv, out, **scales):
    return lambda: attn.run(q, kv, out=out, **scales)


def decode_runs(torch, al, args):
    import fp8_kv as F  # the decode workloads and caches of the fp8 benchmark

    causal = al.load(C.REPO_ROOT / "examples" / "causal.attn")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    chunks = [None if c == "auto" else int(c) for c in args.chunks.split(",")]
    for name in C.Only(args.only).select([n for n in F.DECODE if not n.startswith("mha")]):
        batch, n = F.DECODE[name]
        lens = np.full(batch, n)
        pages = -(-lens // F.PAGE)
        kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        num_pages = int(kv_indptr[-1])
        kv_indices = np.random.default_rng(1).permutation(num_pages).astype(np.int32)
        last = (lens - (pages - 1) * F.PAGE).astype(np.int32)
        (k, k8, ks), (v, v8, vs) = F.make_caches(torch, num_pages, F.HKV, 1, gen)[0]
        q = torch.randn(batch, F.HQ, F.D, generator=gen, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        for chunk in chunks:
            attn = al.BatchAttention(causal, F.HQ, F.HKV, F.D, page_size=F.PAGE,
                                     kv_dtype="fp8" if args.kv == "fp8" else None,
                                     max_batch_size=batch, max_total_q=batch,
                                     max_kv_indices=num_pages, max_work_items=1 << 14,
                                     max_partial_rows=1 << 16, max_merge_rows=1 << 16)
            attn.plan(np.arange(batch + 1, dtype=np.int32), kv_indptr, kv_indices, last,
                      kv_chunk_size=chunk)
            fn = (_call(attn, q, (k8, v8), out, k_scale=ks, v_scale=vs) if args.kv == "fp8"
                  else _call(attn, q, (k, v), out))
            yield f"{name} chunk {chunk or 'planner'}", attn, fn


def prefill_runs(torch, al, args):
    import prefill as P

    causal = al.load(C.REPO_ROOT / "examples" / "causal.attn")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    specs = {s.name: s for s in P.SPECS if s.kind == "causal"}
    for name in C.Only(args.only).select(list(specs)):
        s = specs[name]
        lens = np.array(P.ragged_lengths() if name == "ragged16" else s.lens)
        pages = -(-lens // P.PAGE)
        kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        num_pages = int(kv_indptr[-1])
        last = (lens - (pages - 1) * P.PAGE).astype(np.int32)
        total = int(lens.sum())
        k = torch.randn(num_pages, P.PAGE, s.hkv, P.HEAD_DIM, generator=gen, device="cuda",
                        dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(total, s.hq, P.HEAD_DIM, generator=gen, device="cuda",
                        dtype=torch.bfloat16)
        out = torch.empty_like(q)
        attn = al.BatchAttention(causal, s.hq, s.hkv, P.HEAD_DIM, page_size=P.PAGE,
                                 max_batch_size=len(lens), max_total_q=total,
                                 max_kv_indices=num_pages)
        attn.plan(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), kv_indptr,
                  np.arange(num_pages, dtype=np.int32), last)
        yield name, attn, _call(attn, q, (k, v), out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("decode", "prefill"))
    p.add_argument("--kv", choices=("fp8", "bf16"), default="fp8", help="decode: the cache")
    p.add_argument("--only", default=None, help="comma-separated workload names")
    p.add_argument("--chunks", default="auto",
                   help="decode: kv_chunk_size values for plan(), 'auto' = the planner's")
    args = p.parse_args()
    torch = C.require_cuda()
    al = C.import_attnlang()
    with tempfile.TemporaryDirectory() as tmp:
        use_patched_templates(Path(tmp))  # before anything renders
        runs = (decode_runs if args.what == "decode" else prefill_runs)(torch, al, args)
        rows = []
        for label, attn, fn in runs:
            graph = C.capture_graph(fn)
            timing = C.bench([graph.replay], warmup=3, reps=30)
            for kind in ("decode", "prefill"):
                read_stamps(attn, kind)  # clear
            graph.replay()
            torch.cuda.synchronize()
            for kind in ("decode", "prefill"):
                stamps = read_stamps(attn, kind)
                if stamps is not None and len(stamps):
                    f = summary(stamps)
                    rows.append(dict(workload=label, kernel=kind, graph=f"{timing * 1e6:.1f}",
                                     span=f"{f['span']:.1f}",
                                     ends=f"{f['p10']:.1f} / {f['p50']:.1f}",
                                     mean=f"{f['mean_over_max']:.3f}",
                                     late=f"{f['at90']:.2f} / {f['at95']:.2f}",
                                     sms=f"{f['sm_min']:.1f} / {f['sm_med']:.1f}",
                                     ctas=str(f["ctas"])))
                    C.log(f"{label}: {kind} {f}")
            del attn, graph
    cols = [("workload", "workload"), ("kernel", "kernel"), ("ctas", "CTAs"),
            ("graph", "graph us"), ("span", "span us (wait -> last end)"),
            ("ends", "CTA ends 10% / 50%"), ("mean", "mean end / last"),
            ("late", "running at 90% / 95% of span"), ("sms", "SMs' last ends min / median")]
    print(C.format_table(rows, cols,
                         title="Per-CTA stamps (one graph replay; us from the first wait)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
