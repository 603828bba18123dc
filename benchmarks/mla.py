"""MLA's head dims (queries and keys 192, values 128) beside head dim 128, same run (issue 14).

bf16, 16 query heads and 16 KV heads (DeepSeek-V3's 128 heads over 8 GPUs), page 16 with
pages in a shuffled order, causal (examples/mla.attn). Workloads: prefill (qo_len = kv_len)
of one request of 4096 and of 16384 tokens, and decode (one query per request, the CUDA-core
decode kernel: group 1) of 32 requests x 8192 keys, timed as CUDA-graph replay.

Contenders on the same inputs:
- attnlang d192/128: BatchAttention(head_dim=192, head_dim_vo=128) over the paged cache;
- attnlang d128: causal at head_dim 128 on the same shape (the ratio says what the extra 64
  query-key dims cost);
- torch SDPA, cuDNN and flash backends, on contiguous K/V [1, 16, S, D] (prefill only; a
  backend that refuses the shape says so).
FlashInfer is not in the row: its precompiled bundle has no 192/128 module (it would
JIT-compile with nvcc for minutes).

Figures: prefill TFLOP/s over the causal pairs (2 * pairs * (Dqk + Dv) * heads) and as a
fraction of the 759 TFLOP/s matmul ceiling; decode GB/s of K and V read (tokens * heads *
(Dqk + Dv) * 2 bytes). Before timing, attnlang's output is compared with attnlang.reference
(float32, same bf16 inputs) on the last 4 query rows of each checked request.

Run from the repository root on the GPU machine:
    python3 benchmarks/mla.py [--out $OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

try:
    import common as C
except ImportError:  # run as `python3 -m benchmarks.mla`
    from benchmarks import common as C

ROOT = Path(__file__).resolve().parent.parent
H, PAGE, MATMUL_PEAK = 16, 16, 759e12
DIMS = {"attnlang d192/128": (192, 128), "attnlang d128": (128, 128)}
WORKLOADS = {  # name: (requests, qo_len, kv_len)
    "prefill S4096": (1, 4096, 4096),
    "prefill S16384": (1, 16384, 16384),
    "decode B32 L8192": (32, 1, 8192),
}


def paged_inputs(torch, rng, batch, qo_len, kv_len, dqk, dv):
    pages_per = -(-kv_len // PAGE)
    num_pages = batch * pages_per
    x = {
        "q": torch.randn(batch * qo_len, H, dqk, dtype=torch.bfloat16, device="cuda"),
        "k": torch.randn(num_pages, PAGE, H, dqk, dtype=torch.bfloat16, device="cuda"),
        "v": torch.randn(num_pages, PAGE, H, dv, dtype=torch.bfloat16, device="cuda"),
        "table": (np.arange(batch + 1, dtype=np.int32) * qo_len,
                  np.arange(batch + 1, dtype=np.int32) * pages_per,
                  rng.permutation(num_pages).astype(np.int32),
                  np.full(batch, kv_len - (pages_per - 1) * PAGE, np.int32)),
    }
    return x


def check(al, torch, variant, out, x) -> float:
    """Rel. L2 error of the last 4 query rows of up to 4 requests against the reference."""
    qo_indptr, kv_indptr, perm, last = x["table"]
    errs = []
    for b in range(min(4, len(qo_indptr) - 1)):
        pages = torch.as_tensor(perm[kv_indptr[b]:kv_indptr[b + 1]].astype(np.int64),
                                device="cuda")
        kv_len = (len(pages) - 1) * PAGE + int(last[b])
        k = x["k"][pages].reshape(-1, H, x["k"].shape[-1])[:kv_len].float().cpu().numpy()
        v = x["v"][pages].reshape(-1, H, x["v"].shape[-1])[:kv_len].float().cpu().numpy()
        q1 = int(qo_indptr[b + 1])
        q0 = max(int(qo_indptr[b]), q1 - 4)
        ref, _ = al.reference.attention(variant, x["q"][q0:q1].float().cpu().numpy(), k, v,
                                        precision="float32")
        got = out[q0:q1].float().cpu().numpy()
        errs.append(float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)))
    return max(errs)


def sdpa(torch, backend_name, x, batch, qo_len, kv_len):
    """A callable running SDPA on contiguous copies of request 0, or why it cannot."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[
        backend_name]
    if batch != 1:
        return None, "prefill only"
    q = x["q"].view(1, qo_len, H, -1).transpose(1, 2).contiguous()
    perm = torch.as_tensor(x["table"][2].astype(np.int64), device="cuda")
    k = x["k"][perm].reshape(1, -1, H, x["k"].shape[-1])[:, :kv_len].transpose(1, 2).contiguous()
    v = x["v"][perm].reshape(1, -1, H, x["v"].shape[-1])[:, :kv_len].transpose(1, 2).contiguous()

    def call():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    try:
        call()
        torch.cuda.synchronize()
    except Exception as e:  # the backend refuses the shape: the row says why
        return None, C.short_error(e, 90)
    return call, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch = C.require_cuda()
    al = C.import_attnlang()
    variant = al.load(ROOT / "examples" / "mla.attn")
    rng = np.random.default_rng(0)
    rows = []
    for wl, (batch, qo_len, kv_len) in WORKLOADS.items():
        pairs = batch * (qo_len * (2 * kv_len - qo_len + 1) // 2)  # causal (query, key) pairs
        for name, (dqk, dv) in DIMS.items():
            x = paged_inputs(torch, rng, batch, qo_len, kv_len, dqk, dv)
            attn = al.BatchAttention(variant, num_qo_heads=H, num_kv_heads=H, head_dim=dqk,
                                     head_dim_vo=dv, dtype="bfloat16", page_size=PAGE,
                                     max_total_q=max(8192, batch * qo_len),
                                     prefill_min_rows=None if qo_len > 1 else 16)
            attn.plan(*x["table"])
            out = torch.empty(batch * qo_len, H, dv, dtype=torch.bfloat16, device="cuda")

            def call(attn=attn, x=x, out=out):
                attn.run(x["q"], (x["k"], x["v"]), out=out)

            call()
            err = check(al, torch, variant, out, x)
            t = C.bench_graph(call, reps=50) if qo_len == 1 else C.bench(call, warmup=3, reps=20)
            rows.append(row(wl, name, float(t), pairs, batch, kv_len, dqk, dv, err, qo_len))
            if qo_len > 1 and dqk == 192:
                for backend in ("cudnn", "flash"):
                    fn, why = sdpa(torch, backend, x, batch, qo_len, kv_len)
                    if fn is None:
                        rows.append({"workload": wl, "contender": f"sdpa {backend}", "ms": None,
                                     "why": why})
                        continue
                    t = C.bench(fn, warmup=3, reps=20)
                    rows.append(row(wl, f"sdpa {backend} d192/128", float(t), pairs, batch,
                                    kv_len, dqk, dv, None, qo_len))
            del x, attn, out
            torch.cuda.empty_cache()
    print()
    print("| workload | contender | time (ms) | TFLOP/s | GB/s | of ceiling | rel. err |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["ms"] is None:
            print(f"| {r['workload']} | {r['contender']} | - | - | - | - | {r['why']} |")
            continue
        err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "-"
        print(f"| {r['workload']} | {r['contender']} | {r['ms']:.3f} | {C.fmt(r['TFLOP/s'])} | "
              f"{C.fmt(r['GB/s'], '.0f')} | {r['of_ceiling']:.0%} | {err} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "mla.json").write_text(json.dumps(rows, indent=1))
    return 0


def row(wl, name, seconds, pairs, batch, kv_len, dqk, dv, err, qo_len) -> dict:
    r = {"workload": wl, "contender": name, "ms": seconds * 1e3, "rel_err": err,
         "TFLOP/s": None, "GB/s": None}
    if qo_len > 1:
        r["TFLOP/s"] = 2 * pairs * (dqk + dv) * H / seconds / 1e12
        r["of_ceiling"] = r["TFLOP/s"] * 1e12 / MATMUL_PEAK
    else:
        r["GB/s"] = batch * kv_len * H * (dqk + dv) * 2 / seconds / 1e9
        r["of_ceiling"] = r["GB/s"] / 2994
    C.log(f"{wl:18s} {name:22s} {r['ms']:8.3f} ms  err {err}")
    return r


if __name__ == "__main__":
    sys.exit(main())
