"""The language's table-driven and let-written ports against plain causal, same run (issue 14).

bf16, head_dim 128, page 16 (pages shuffled), 32 query / 8 KV heads. Each variant runs on the
same inputs as `causal`, with its own params:
- t5_bias: a random float[heads, 32] bias table, sm_scale 1/sqrt(128) (as the others);
- longformer: window 256 either side, bool[batch, 16384] with 3 global tokens per request;
- sandwich: a 64-term sum of cosines of the distance (computed, not looked up: a distance
  term, tabulated per KV tile by the prefill kernel);
- natten_tiled: a 64x64 image (4096 tokens), 7x7 neighbourhoods (S4096 and decode only).
Longformer and NATTEN see other pairs than causal: their ratio says what the mask costs.
Workloads: prefill (qo_len = kv_len) at 1 x 4096 and 1 x 16384, and decode (one query per
request) at 64 requests x 4096 keys, CUDA graph replay (decode is launch-bound otherwise).

Figures: median time (CUDA events), GB/s of K/V read for decode, and causal's time / the
variant's (1.00 = as fast). Every variant's output is checked first against
attnlang.reference on the last 4 query rows of each request (rel. L2 error, float32
evaluation of the same bf16 inputs).

Run from the repository root on the GPU machine:
    python3 benchmarks/variants.py [--out $OUT] [--variants causal,softcap,alibi]
                                   [--workloads decode]
(alibi gets geometric slopes, qk_norm weights near 1; other variants their params' defaults.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

try:
    import common as C
except ImportError:  # run as `python3 -m benchmarks.variants`
    from benchmarks import common as C

ROOT = Path(__file__).resolve().parent.parent
HQ, HKV, D, PAGE = 32, 8, 128, 16
VARIANTS = ("causal", "t5_bias", "sandwich", "longformer", "natten_tiled")
WORKLOADS = {  # name: (requests, qo_len, kv_len)
    "prefill S4096": (1, 4096, 4096),
    "prefill S16384": (1, 16384, 16384),
    "decode B64 L4096": (64, 1, 4096),
}


def params_for(torch, name: str, batch: int, rng) -> dict:
    if name == "t5_bias":
        return {"bias": torch.tensor(rng.standard_normal((HQ, 32)) * 0.5,
                                     dtype=torch.float32, device="cuda")}
    if name == "alibi":
        return {"slopes": torch.tensor(2.0 ** (-8.0 * np.arange(1, HQ + 1) / HQ),
                                       dtype=torch.float32, device="cuda")}
    if name == "qk_norm":
        return {w: torch.tensor(1.0 + 0.1 * rng.standard_normal(D), dtype=torch.float32,
                                device="cuda") for w in ("wq", "wk")}
    if name == "longformer":
        g = np.zeros((batch, 16384), bool)
        g[:, [0, 1, 2]] = True
        return {"is_global": torch.tensor(g, device="cuda")}
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="examples/<name>.attn to run, comma-separated; causal first "
                             "(the ratios' base)")
    parser.add_argument("--workloads", default="",
                        help="only the workloads whose name contains this (e.g. decode)")
    args = parser.parse_args()
    names = [n for n in args.variants.split(",") if n]
    if not names or names[0] != "causal":
        parser.error("--variants must start with causal (the ratios are against it)")
    torch = C.torch_module()
    C.require_cuda()
    al = C.import_attnlang()
    rng = np.random.default_rng(0)
    rows = []
    for wl_name, (batch, qo_len, kv_len) in WORKLOADS.items():
        if args.workloads not in wl_name:
            continue
        pages_per = -(-kv_len // PAGE)
        num_pages = batch * pages_per
        k_cache = torch.randn(num_pages, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(batch * qo_len, HQ, D, dtype=torch.bfloat16, device="cuda")
        perm = rng.permutation(num_pages).astype(np.int32)
        qo_indptr = np.arange(batch + 1, dtype=np.int32) * qo_len
        kv_indptr = np.arange(batch + 1, dtype=np.int32) * pages_per
        last = np.full(batch, kv_len - (pages_per - 1) * PAGE, np.int32)
        base = None
        for name in names:
            if name == "natten_tiled" and kv_len != 4096:
                continue
            variant = al.load(ROOT / "examples" / f"{name}.attn")
            params = params_for(torch, name, batch, rng)
            attn = al.BatchAttention(variant, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                     dtype="bfloat16", page_size=PAGE,
                                     max_total_q=max(8192, batch * qo_len))
            attn.plan(qo_indptr, kv_indptr, perm, last)
            out = torch.empty_like(q)

            def call(attn=attn, params=params, out=out, q=q, kv=(k_cache, v_cache)):
                attn.run(q, kv, params, out=out)

            err = check(al, torch, variant, attn, q, k_cache, v_cache, perm, qo_indptr,
                        kv_indptr, last, params)
            if qo_len == 1:
                t = C.bench_graph(call, warmup=5, reps=50)
            else:
                t = C.bench(call, warmup=3, reps=20)
            if name == "causal":
                base = float(t)
            row = {"workload": wl_name, "variant": name, "ms": float(t) * 1e3, "GB/s": None,
                   "vs_causal": base / float(t), "rel_err": err}
            if qo_len == 1:
                kv_bytes = 2 * batch * kv_len * HKV * D * 2
                row["GB/s"] = kv_bytes / float(t) / 1e9
            rows.append(row)
            C.log(f"{wl_name:18s} {name:14s} {row['ms']:8.3f} ms  x{row['vs_causal']:.3f}  "
                  f"err {err:.2e}")
    print()
    print("| workload | variant | time (ms) | causal / variant | GB/s | rel. err |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        gbs = f"{r['GB/s']:.0f}" if r["GB/s"] else "-"
        print(f"| {r['workload']} | {r['variant']} | {r['ms']:.3f} | {r['vs_causal']:.3f} | "
              f"{gbs} | {r['rel_err']:.1e} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "variants.json").write_text(json.dumps(rows, indent=1))
    return 0


def check(al, torch, variant, attn, q, k_cache, v_cache, perm, qo_indptr, kv_indptr, last,
          params) -> float:
    """Max rel. L2 error of the last 4 query rows of each request (up to 8 requests) against
    attnlang.reference in float32 on the same bf16 inputs: those rows, as a request of their
    own over all its keys, keep their positions (q_pos = kv_len - qo_len + i)."""
    out = attn.run(q, (k_cache, v_cache), params)
    torch.cuda.synchronize()
    host = {n: a.cpu().numpy() for n, a in params.items()}
    errs = []
    for b in range(min(8, len(qo_indptr) - 1)):
        pages = torch.as_tensor(perm[kv_indptr[b]:kv_indptr[b + 1]].astype(np.int64),
                                device="cuda")
        kv_len = (len(pages) - 1) * PAGE + int(last[b])
        k = k_cache[pages].reshape(-1, HKV, D)[:kv_len].float().cpu().numpy()
        v = v_cache[pages].reshape(-1, HKV, D)[:kv_len].float().cpu().numpy()
        q1 = int(qo_indptr[b + 1])
        q0 = max(int(qo_indptr[b]), q1 - 4)
        own = {n: a[b:b + 1] if variant.param(n).extents[0] == "batch" else a
               for n, a in host.items()}
        ref, _ = al.reference.attention(variant, q[q0:q1].float().cpu().numpy(), k, v, None,
                                        None, own, precision="float32")
        got = out[q0:q1].float().cpu().numpy()
        errs.append(float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)))
    return max(errs)


if __name__ == "__main__":
    sys.exit(main())
