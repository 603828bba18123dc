"""Per-pair masks (bool[q, kv]) beside causal and FlashInfer's custom mask, same run (issues 13
and 14).

bf16, 32 query / 8 KV heads, head_dim 128, page 16 (pages shuffled). Workloads:
- tree: speculative decoding's verification step, 16 requests each with a 4096-token context
  and a 64-node token tree (random parents): queries are the 64 nodes, each sees the context
  and its ancestors (examples/spec_tree.attn);
- block-sparse causal: one request of 8192 tokens, a lower-triangular layout of 64 x 64
  blocks (the density of causal, at block granularity), and random layouts at half density of
  64 x 64 blocks and of 128 x 128 blocks (FlexAttention's default block size, the prefill
  kernel's tile on the H100: a whole tile visible or not).
Contenders:
- attnlang spec_tree (the mask given to plan(): packed bits, tiles skipped by the summary);
- attnlang causal on the same lengths (the same density for block-sparse causal; for the
  tree, each node sees all earlier nodes, a superset of its ancestors);
- FlashInfer 0.7.2 BatchPrefillWithPagedKVCacheWrapper with custom_mask (backend fa2; not
  precompiled: it JIT-compiles with nvcc on first use, or the row says why it could not), and
  with causal=True (precompiled).
Figures: median time (CUDA events), TFLOP/s over the pairs the mask allows (4 * pairs * 128 *
32 heads), attnlang spec_tree / causal and / FlashInfer ratios. Outputs are checked first
against attnlang.reference on the last 4 rows of up to 2 requests (float32, same inputs).

Run from the repository root on the GPU machine:
    python3 benchmarks/pair_masks.py [--out $OUT] [--no-flashinfer]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

try:
    import common as C
except ImportError:  # run as `python3 -m benchmarks.pair_masks`
    from benchmarks import common as C

ROOT = Path(__file__).resolve().parent.parent
HQ, HKV, D, PAGE = 32, 8, 128, 16


def token_tree(rng, context: int, nodes: int) -> np.ndarray:
    from attnlang.runtime.pairmask import tree_mask  # after import_attnlang put it on the path

    return tree_mask([-1] + [int(rng.integers(-1, i)) for i in range(1, nodes)], context)


def blocks(layout: np.ndarray, block: int, q: int, k: int) -> np.ndarray:
    return np.repeat(np.repeat(layout, block, 0), block, 1)[:q, :k]


def workloads(rng) -> dict:
    tree = [token_tree(rng, 4096, 64) for _ in range(16)]
    n = 8192 // 64
    tril = blocks(np.tril(np.ones((n, n), bool)), 64, 8192, 8192)
    half = blocks(rng.random((n, n)) < 0.5, 64, 8192, 8192)
    half128 = blocks(rng.random((n // 2, n // 2)) < 0.5, 128, 8192, 8192)
    return {"tree 16 x (4096 + 64)": ([64] * 16, [4096 + 64] * 16, tree),
            "block-sparse causal S8192": ([8192], [8192], [tril]),
            "block-sparse random 50% S8192": ([8192], [8192], [half]),
            "block-sparse random 50% 128-blocks S8192": ([8192], [8192], [half128])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-flashinfer", action="store_true")
    args = parser.parse_args()
    torch = C.require_cuda()
    al = C.import_attnlang()
    fi, fi_note = (None, "not asked") if args.no_flashinfer else C.import_flashinfer()
    C.log(fi_note)
    tree_v = al.load(ROOT / "examples" / "spec_tree.attn")
    causal_v = al.load(ROOT / "examples" / "causal.attn")
    rng = np.random.default_rng(0)
    rows = []
    for wl, (qo, kv, masks) in workloads(rng).items():
        qo, kv = np.array(qo), np.array(kv)
        pages_per = -(-kv // PAGE)
        num_pages = int(pages_per.sum())
        k_cache = torch.randn(num_pages, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(int(qo.sum()), HQ, D, dtype=torch.bfloat16, device="cuda")
        perm = rng.permutation(num_pages).astype(np.int32)
        qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        kv_indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
        last = (kv - (pages_per - 1) * PAGE).astype(np.int32)
        table = (qo_indptr, kv_indptr, perm, last)
        allowed = int(sum(int(m.sum()) for m in masks))
        causal_pairs = int(sum(q_ * (2 * k_ - q_ + 1) // 2 for q_, k_ in zip(qo, kv, strict=True)))
        out = torch.empty_like(q)
        timings = {}
        for name, variant in (("attnlang spec_tree", tree_v), ("attnlang causal", causal_v)):
            attn = al.BatchAttention(variant, HQ, HKV, D, page_size=PAGE,
                                     max_total_q=max(8192, int(qo.sum())))
            t0 = time.perf_counter()
            attn.plan(*table, params={"allowed": masks} if variant is tree_v else None)
            plan_ms = (time.perf_counter() - t0) * 1e3

            def call(attn=attn, q=q, kv=(k_cache, v_cache), out=out):
                attn.run(q, kv, out=out)

            call()
            params = {"allowed": masks} if variant is tree_v else {}
            err = check(al, torch, variant, out, q, k_cache, v_cache, table, params)
            t = float(C.bench(call, warmup=3, reps=30))
            pairs = allowed if variant is tree_v else causal_pairs
            timings[name] = t
            rows.append(row(wl, name, t, pairs, err, plan_ms))
        if fi is not None:
            for name, kw in (("flashinfer custom_mask (fa2)", "mask"),
                             ("flashinfer causal", "causal")):
                try:
                    t0 = time.perf_counter()
                    fn = flashinfer_call(fi, torch, q, k_cache, v_cache, table, masks, kw)
                    fn()
                    torch.cuda.synchronize()
                    setup_s = time.perf_counter() - t0
                    t = float(C.bench(fn, warmup=3, reps=30))
                    pairs = allowed if kw == "mask" else causal_pairs
                    r = row(wl, name, t, pairs, None, None)
                    r["setup_s"] = setup_s
                    timings[name] = t
                    rows.append(r)
                except Exception as e:  # the row says why (JIT failed, API refused)
                    rows.append({"workload": wl, "contender": name, "ms": None,
                                 "why": C.short_error(e, 120)})
        base = timings.get("attnlang spec_tree")
        for r in rows:
            if r["workload"] == wl and r.get("ms"):
                r["spec_tree_speedup"] = r["ms"] / 1e3 / base if base else None
    print()
    print("| workload | contender | time (ms) | TFLOP/s | others' time / spec_tree | rel. err |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r.get("ms") is None:
            print(f"| {r['workload']} | {r['contender']} | - | - | - | {r['why']} |")
            continue
        err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
        print(f"| {r['workload']} | {r['contender']} | {r['ms']:.3f} | {r['TFLOP/s']:.0f} | "
              f"{r['spec_tree_speedup']:.2f} | {err} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "pair_masks.json").write_text(json.dumps(rows, indent=1))
    return 0


def row(wl, name, seconds, pairs, err, plan_ms) -> dict:
    r = {"workload": wl, "contender": name, "ms": seconds * 1e3, "rel_err": err,
         "TFLOP/s": 4 * pairs * D * HQ / seconds / 1e12, "plan_ms": plan_ms}
    C.log(f"{wl:30s} {name:30s} {r['ms']:8.3f} ms  {r['TFLOP/s']:6.0f} TFLOP/s  err {err}"
          + (f"  plan {plan_ms:.1f} ms" if plan_ms is not None else ""))
    return r


def flashinfer_call(fi, torch, q, k_cache, v_cache, table, masks, kind):
    qo_indptr, kv_indptr, perm, last = (torch.from_numpy(np.asarray(a)) for a in table)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(q)
    kw = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    if kind == "mask":
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        flat = torch.from_numpy(np.concatenate([m.reshape(-1) for m in masks])).cuda()
        w.plan(qo_indptr, kv_indptr, perm, last, HQ, HKV, D, PAGE, custom_mask=flat, **kw)
    else:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(qo_indptr, kv_indptr, perm, last, HQ, HKV, D, PAGE, causal=True, **kw)

    def fn(w=w, keep=(ws,)):
        return w.run(q, (k_cache, v_cache), out=out)

    return fn


def check(al, torch, variant, out, q, k_cache, v_cache, table, params) -> float:
    """Max rel. L2 error of the last 4 rows of up to 2 requests against the reference."""
    qo_indptr, kv_indptr, perm, last = table
    errs = []
    for b in range(min(2, len(qo_indptr) - 1)):
        pages = torch.as_tensor(perm[kv_indptr[b]:kv_indptr[b + 1]].astype(np.int64),
                                device="cuda")
        kv_len = (len(pages) - 1) * PAGE + int(last[b])
        k = k_cache[pages].reshape(-1, HKV, D)[:kv_len].float().cpu().numpy()
        v = v_cache[pages].reshape(-1, HKV, D)[:kv_len].float().cpu().numpy()
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        rows = slice(max(q0, q1 - 4), q1)
        own = {}
        if "allowed" in params:  # the rows' part of the request's matrix
            own["allowed"] = [params["allowed"][b][rows.start - q0:]]
        ref, _ = al.reference.attention(variant, q[rows].float().cpu().numpy(), k, v, None,
                                        None, own, precision="float32")
        got = out[rows].float().cpu().numpy()
        errs.append(float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)))
    return max(errs)


if __name__ == "__main__":
    sys.exit(main())
