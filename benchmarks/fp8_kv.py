"""An fp8 (e4m3) KV cache beside a bf16 one and beside FlashInfer's fp8 decode and prefill,
in one run (issue 13, part 2).

Decode workloads (batch, kv_len), as benchmarks/decode.py's uniform ones: (1, 32768),
(16, 4096), (64, 2048), (128, 2048), (32, 8192); bf16 q and out, 32 query / 8 KV heads
(GQA 4), head_dim 128, page 16, pages shuffled; and MHA (32 / 32 heads) at (32, 8192). An
fp8 cache decodes in the tensor-core decode kernel (decode_mma.cu.j2, GQA groups up to 8).
Prefill: one causal prompt of 4096 and of 16384 tokens, 32 / 8 heads.

Contenders (CUDA-graph replay but FlashInfer's fp8 decode, whose run() does not capture, and
FlashInfer's prefill: plain calls; decode inputs rotated so a cycle exceeds the L2):
- attnlang bf16 cache, attnlang fp8 cache (per-head k_scale / v_scale device tensors; for
  decode a decode loop's BatchAttention, max_qo_len=1, whose graph holds no prefill launch), and
  for the GQA decode steps the fp8 cache in the prefill kernel too (prefill_min_rows=3, the
  bf16 cache's default: the wgmma path that decoded fp8 GQA steps before decode_mma); for
  prefill the fp8 cache as plan() takes it (these prompts read each key 66 and 258 times:
  through the converted copy, runtime/dequantize.py) and converted per tile by the prefill
  kernel (plan(dequantize=False), "per tile");
- FlashInfer 0.7.2 BatchDecodeWithPagedKVCacheWrapper for decode and
  BatchPrefillWithPagedKVCacheWrapper (backend "auto", causal) for the prompts, bf16 and fp8
  caches (kv_data_type torch.float8_e4m3fn, k_scale / v_scale floats). Its bf16 prefill is the
  precompiled FA3 module; FA3 takes an fp8 cache only with fp8 q, so its fp8 prefill is FA2.
  Its fp8 modules JIT-compile with nvcc on first use (the log gives the time), or the row says
  why one is missing.

Figures: median time; for decode GB/s = the K and V bytes the batch must read (1 byte per
element for fp8, 2 for bf16) / time, and that as a fraction of the copy bandwidth measured in
the same run; "read floor": a graph-replayed kernel that only reads as many bytes as the fp8
row (`common.read_floor`: 16 loads of 16 bytes in flight per thread, one-shot blocks of 64 KB),
what a kernel that only streams them reaches with its launch, and attnlang fp8's time as a
fraction of it ("of floor": floor time / ours); fp8 / bf16 = bf16 time / fp8 time (the
tokens/s gain); attnlang / FlashInfer likewise.
Outputs are checked first against a float32 torch evaluation of the dequantised cache (rel.
L2 error).

Run from the repository root on the GPU machine:
    python3 benchmarks/fp8_kv.py [--out $OUT] [--no-peers] [--only NAME,...] [--head-dim 64|128|256]
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

try:
    import common as C
except ImportError:  # run as `python3 -m benchmarks.fp8_kv`
    from benchmarks import common as C

HQ, HKV, PAGE = 32, 8, 16
D = 128  # head dim (--head-dim)
GROUP = HQ // HKV
DECODE = {"b1_l32768": (1, 32768), "b16_l4096": (16, 4096), "b64_l2048": (64, 2048),
          "b128_l2048": (128, 2048), "b32_l8192": (32, 8192), "mha_b32_l8192": (32, 8192)}
PREFILL = {"prefill_s4096": 4096, "prefill_s16384": 16384}


def make_caches(torch, num_pages: int, kv_heads: int, nsets: int, gen):
    """nsets (k, v) pairs of bf16 caches and their fp8 versions, with one scale per tensor
    (amax / 448, as FlashInfer and vLLM take it) given to attnlang as a per-head tensor."""
    sets = []
    for _ in range(nsets):
        k = torch.randn(num_pages, PAGE, kv_heads, D, generator=gen, device="cuda",
                        dtype=torch.bfloat16)
        v = torch.randn_like(k)
        pair = []
        for x in (k, v):
            amax = x.float().abs().amax()
            scale = (amax / 448.0).expand(kv_heads).contiguous()
            bits = (x.float() / scale[None, None, :, None]).to(torch.float8_e4m3fn)
            pair.append((x, bits, scale))
        sets.append(pair)
    return sets


CHECK_ROWS = 512  # prefill: the rows checked (the prompt's last ones)


def reference(torch, q, k, v, lens, kv_indptr, kv_indices, causal: bool):
    """float32 attention of q [T, HQ, D] over each request's pages (decode: one query per
    request; prefill: one causal request, its last CHECK_ROWS queries)."""
    outs = []
    qo = 0
    for b, n in enumerate(lens):
        pages = torch.from_numpy(kv_indices[kv_indptr[b]:kv_indptr[b + 1]]).long().cuda()
        kb = k[pages].reshape(-1, k.shape[2], D)[:n].float()
        vb = v[pages].reshape(-1, v.shape[2], D)[:n].float()
        rows = min(n, CHECK_ROWS) if causal else 1
        qb = q[qo + (n - rows if causal else 0):qo + (n if causal else 1)].float()
        qo += n if causal else 1
        g = qb.shape[1] // kb.shape[1]
        kb, vb = kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qb, kb) / D**0.5
        if causal:
            s = s + torch.triu(torch.full((rows, n), float("-inf"), device="cuda"), n - rows + 1)
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vb))
    return torch.cat(outs)


@dataclasses.dataclass
class PeerCalls:
    fns: list          # one call per input set
    outs: list         # their outputs
    bench: Any         # C.bench_graph or C.bench (plain calls)


def flashinfer_calls(fi, torch, kv: str, prefill: bool, sets, qs, qo_indptr, kv_indptr,
                     kv_indices, last, batch: int) -> PeerCalls:
    """FlashInfer's calls for one workload: BatchDecodeWithPagedKVCacheWrapper (CUDA-graph
    replay for bf16; its fp8 run() does not capture, so plain calls) or, for a prompt,
    BatchPrefillWithPagedKVCacheWrapper (backend "auto": the precompiled FA3 module for bf16;
    for an fp8 cache with bf16 q FA3 is not offered and FA2 JIT-compiles; plain calls, as
    benchmarks/prefill.py times prefill)."""
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    num_pages = int(kv_indptr[-1])
    kv_data_type = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
    tables = (torch.from_numpy(kv_indptr), torch.from_numpy(kv_indices), torch.from_numpy(last))
    if prefill:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(torch.from_numpy(qo_indptr), *tables, HQ, HKV, D, PAGE, causal=True,
               q_data_type=torch.bfloat16, kv_data_type=kv_data_type)
    else:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.empty(batch + 1, **i32),
            paged_kv_indices_buffer=torch.empty(num_pages, **i32),
            paged_kv_last_page_len_buffer=torch.empty(batch, **i32))
        w.plan(*tables, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16,
               kv_data_type=kv_data_type)
    outs = [torch.empty_like(q) for q in qs]

    def call(i):
        (k, kb, ksc), (v, vb, vsc) = sets[i]
        if kv == "bf16":
            return lambda: w.run(qs[i], (k, v), out=outs[i])
        # FlashInfer takes one float per tensor (the heads' scales are one)
        return lambda: w.run(qs[i], (kb, vb), out=outs[i], k_scale=float(ksc[0]),
                             v_scale=float(vsc[0]))

    graph = kv == "bf16" and not prefill
    return PeerCalls([call(i) for i in range(len(qs))], outs,
                     C.bench_graph if graph else C.bench)


def main() -> int:
    p = C.base_parser(__doc__.split("\n\n")[0], budget=420, max_seconds=4,
                      names_help=f"Workloads: {', '.join([*DECODE, *PREFILL])}.")
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256),
                   help="head dim of q, K and V (default 128)")
    args = p.parse_args()
    global D
    D = args.head_dim
    torch = C.require_cuda()
    al = C.import_attnlang()
    reps, warmup = C.reps_and_warmup(args)
    only = C.Only(args.only)
    fi, fi_note = (None, "not asked") if args.no_peers else C.import_flashinfer()
    C.log(fi_note)
    copy_bw = C.copy_bandwidth()
    C.log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    causal = al.load(C.REPO_ROOT / "examples" / "causal.attn")
    rows, t0 = [], time.perf_counter()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)

    names = only.select([*DECODE, *PREFILL])
    for name, spec in [*DECODE.items(), *PREFILL.items()]:
        if name not in names:
            continue
        if time.perf_counter() - t0 > args.budget:
            C.log(f"{name}: skipped (budget {args.budget:g} s spent)")
            continue
        prefill = name in PREFILL
        kv_heads = HQ if name.startswith("mha") else HKV
        if prefill:
            batch, lens = 1, np.array([spec])
        else:
            batch, n = spec
            lens = np.full(batch, n)
        pages = -(-lens // PAGE)
        kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        num_pages = int(kv_indptr[-1])
        kv_indices = np.random.default_rng(1).permutation(num_pages).astype(np.int32)
        last = (lens - (pages - 1) * PAGE).astype(np.int32)
        total_q = int(lens.sum()) if prefill else batch
        qo_indptr = (np.array([0, total_q]) if prefill else np.arange(batch + 1)).astype(np.int32)
        bf16_bytes = int(lens.sum()) * kv_heads * D * 2 * 2
        nsets = 1 if prefill else C.rotation_sets(bf16_bytes // 2)
        sets = make_caches(torch, num_pages, kv_heads, nsets, gen)
        qs = [torch.randn(total_q, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
              for _ in range(nsets)]
        C.log(f"{name}: {int(lens.sum())} tokens, {nsets} input set(s)")
        (k0, k8, ks), (v0, v8, vs) = sets[0]
        ref_bf16 = reference(torch, qs[0], k0, v0, lens, kv_indptr, kv_indices, prefill)
        ref_fp8 = reference(torch, qs[0], k8.float() * ks[None, None, :, None],
                            v8.float() * vs[None, None, :, None], lens, kv_indptr, kv_indices,
                            prefill)
        row = {"workload": name}
        # fp8_pf: a GQA decode step in the prefill kernel (prefill_min_rows below its rows)
        # instead of the decode kernel that takes it by default with an fp8 cache
        # fp8_tile: a prompt's tiles converted by the prefill kernel (no converted copy)
        kinds = ["bf16", "fp8"] + (["fp8_pf"] if not prefill and kv_heads == HKV else
                                   ["fp8_tile"] if prefill else [])
        for kv in kinds:
            # a decode loop's BatchAttention: one query per request (max_qo_len), so its
            # graph holds no launch of a kernel no such plan reaches
            extra = ({"prefill_min_rows": GROUP - 1} if kv == "fp8_pf" else
                     {} if prefill else {"max_qo_len": 1})
            attn = al.BatchAttention(causal, HQ, kv_heads, D, page_size=PAGE,
                                     kv_dtype=None if kv == "bf16" else "fp8",
                                     max_batch_size=batch, max_total_q=total_q,
                                     max_kv_indices=num_pages, **extra)
            attn.plan(qo_indptr, kv_indptr, kv_indices, last,
                      dequantize=False if kv == "fp8_tile" else None)
            outs = [torch.empty_like(q) for q in qs]

            def call(i, attn=attn, kv=kv, outs=outs, sets=sets, qs=qs):
                (k, kb, ksc), (v, vb, vsc) = sets[i]
                if kv == "bf16":
                    return lambda: attn.run(qs[i], (k, v), out=outs[i])
                return lambda: attn.run(qs[i], (kb, vb), out=outs[i], k_scale=ksc, v_scale=vsc)

            fns = [call(i) for i in range(nsets)]
            fns[0]()
            err = C.rel_l2(outs[0][-len(ref_bf16):], ref_bf16 if kv == "bf16" else ref_fp8)
            t = float(C.bench_graph(fns, warmup=warmup, reps=reps, max_seconds=args.max_seconds))
            row[f"al_{kv}_ms"], row[f"al_{kv}_err"] = t * 1e3, err
            C.log(f"  attnlang {kv}: {t * 1e3:.3f} ms, err {err:.1e}")
            del attn
        if fi is not None and kv_heads == HKV:
            for kv in ("bf16", "fp8"):
                try:
                    t0_fi = time.perf_counter()
                    timed = flashinfer_calls(fi, torch, kv, prefill, sets, qs, qo_indptr,
                                             kv_indptr, kv_indices, last, batch)
                    timed.fns[0]()
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0_fi
                    C.log(f"  flashinfer {kv}: plan and first call {first:.1f} s")
                    err = C.rel_l2(timed.outs[0][-len(ref_bf16):],
                                   ref_bf16 if kv == "bf16" else ref_fp8)
                    t = float(timed.bench(timed.fns, warmup=warmup, reps=reps,
                                          max_seconds=args.max_seconds))
                    row[f"fi_{kv}_ms"], row[f"fi_{kv}_err"] = t * 1e3, err
                    C.log(f"  flashinfer {kv}: {t * 1e3:.3f} ms, err {err:.1e}")
                except Exception as e:  # noqa: BLE001 - a peer's failure is a row note
                    row[f"fi_{kv}_note"] = C.short_error(e)
                    C.log(f"  flashinfer {kv} failed: {C.short_error(e)}")
        if not prefill:  # the same bytes read by a plain kernel, as our fp8 rows rotate them
            floor = C.read_floor(bf16_bytes // 2, nsets=nsets, warmup=warmup, reps=reps,
                                 max_seconds=args.max_seconds)
            row["read_floor_ms"] = floor * 1e3
            C.log(f"  read floor (fp8 bytes): {floor * 1e3:.3f} ms")
        for kv, width in (("bf16", 2), ("fp8", 1)):
            for who in ("al", "fi"):
                ms = row.get(f"{who}_{kv}_ms")
                if ms and not prefill:  # a prompt's time is its arithmetic, not its bytes
                    gbs = bf16_bytes / 2 * width / (ms * 1e-3)
                    row[f"{who}_{kv}_gbs"] = gbs / 1e9
                    row[f"{who}_{kv}_frac"] = gbs / copy_bw
        rows.append(row)
        del sets, qs
        torch.cuda.empty_cache()

    table = []
    for r in rows:
        def cell(key, spec=".3f", r=r):
            return C.fmt(r.get(key), spec)
        table.append(dict(
            workload=r["workload"], al_bf16=cell("al_bf16_ms"), al_fp8=cell("al_fp8_ms"),
            gbs=cell("al_fp8_gbs", ".0f"), frac=C.fmt(100 * r["al_fp8_frac"], ".0f") + "%"
            if r.get("al_fp8_frac") else "-",
            floor=cell("read_floor_ms"),
            of_floor=C.fmt(100 * r["read_floor_ms"] / r["al_fp8_ms"], ".0f") + "%"
            if r.get("read_floor_ms") and r.get("al_fp8_ms") else "-",
            gain=C.fmt(C.ratio(r.get("al_bf16_ms"), r.get("al_fp8_ms")), ".2f"),
            pf=cell("al_fp8_pf_ms"), tile=cell("al_fp8_tile_ms"),
            fi_fp8=cell("fi_fp8_ms") + ("" if r.get("fi_fp8_err") is None
                                        else f" ({C.err_cell(r['fi_fp8_err'])})"),
            fi_bf16=cell("fi_bf16_ms"),
            vs_fi=C.fmt(C.ratio(r.get("fi_fp8_ms"), r.get("al_fp8_ms")), ".2f"),
            err=f"{C.err_cell(r.get('al_fp8_err'))} / {C.err_cell(r.get('al_bf16_err'))}",
            note=r.get("fi_fp8_note", "")[:60]))
    cols = [("workload", "workload"), ("al_bf16", "al bf16 ms"), ("al_fp8", "al fp8 ms"),
            ("gbs", "al fp8 GB/s"), ("frac", "of copy"), ("floor", "read floor ms"),
            ("of_floor", "of floor"), ("gain", "fp8/bf16"),
            ("pf", "al fp8 prefill-kernel ms"), ("tile", "al fp8 per tile ms"),
            ("fi_bf16", "FI bf16 ms"), ("fi_fp8", "FI fp8 ms (err, plain)"),
            ("vs_fi", "al/FI fp8"),
            ("err", "err fp8 / bf16"), ("note", "note")]
    print(C.format_table(table, cols, title=f"fp8 KV cache, head dim {D} (copy "
                                             f"{copy_bw / 1e9:.0f} GB/s; CUDA-graph replay)"))
    C.write_rows(args.out, "fp8_kv", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
