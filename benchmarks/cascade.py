"""Shared-prefix cascades (issue 13, part 1): attnlang's cascade beside attnlang without one and
FlashInfer's MultiLevelCascadeAttentionWrapper, in one run.

Workload: 64 requests of one query (a decode step of parallel samples) sharing a prefix of
P tokens, each with a unique suffix of lognormal length (median 512, sigma 0.5, seeded);
bf16, 32 query / 8 KV heads, head_dim 128, page 16, the suffix pages shuffled. The prefix
pages are the same page ids at the head of every request's page list (as a paged engine
stores a shared prompt), so attnlang finds the cascade in the page table (plan()'s
cascade="auto"); FlashInfer is given its two levels (the prefix for all 64 queries at
once, each suffix for its query).

Rows: P = 32768 (the issue's target: >= 10x over no cascade, ahead of FlashInfer), then a
sweep of P from 0 to 65536 (attnlang's cascade forced, and what "auto" picks) showing where
the cascade starts to pay; then prefill: 16 requests of 256 new tokens each (their own
part: causal among themselves) over a shared prefix of 16384, where the cascade saves
reads but no tensor-core work; then small groups (2-16 one-query requests sharing 256-4096
tokens), where merging every row weighs most against the reads saved. CUDA-graph replay for
attnlang; FlashInfer as CUDA graph where its run() captures, else plain calls (the row says
which). Outputs are checked first against a float32 torch evaluation (rel. L2 error).

Run from the repository root on the GPU machine:
    python3 benchmarks/cascade.py [--out $OUT] [--no-peers] [--only target,sweep,prefill,groups]
"""

from __future__ import annotations

import time

import numpy as np

try:
    import common as C
except ImportError:  # run as `python3 -m benchmarks.cascade`
    from benchmarks import common as C

HQ, HKV, D, PAGE = 32, 8, 128, 16
REQUESTS = 64
TARGET_PREFIX = 32768
SWEEP = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
PREFILL = (16, 256, 16384)  # requests, new tokens each, shared prefix
GROUPS = ((2, 4, 8, 16), (256, 1024, 4096))  # small groups: requests x shared prefixes


def suffix_lengths(n: int) -> np.ndarray:
    rng = np.random.default_rng(13)
    return np.maximum(1, np.round(512 * np.exp(0.5 * rng.standard_normal(n)))).astype(np.int64)


def make_table(prefix: int, suffix: np.ndarray):
    """Page lists: the prefix's pages first in every list (shared ids), then the request's
    own pages (shuffled). Returns (kv_indptr, kv_indices, last, kv_lens, prefix_pages,
    suffix tables for FlashInfer's second level)."""
    assert prefix % PAGE == 0
    p_pages = prefix // PAGE
    s_pages = -(-suffix // PAGE)
    own = np.random.default_rng(5).permutation(int(s_pages.sum())).astype(np.int32) + p_pages
    lists, s_lists, at = [], [], 0
    for n in s_pages:
        mine = own[at:at + n]
        at += n
        lists.append(np.concatenate((np.arange(p_pages, dtype=np.int32), mine)))
        s_lists.append(mine)
    kv_indptr = np.concatenate(([0], np.cumsum([len(x) for x in lists]))).astype(np.int32)
    last = (suffix - (s_pages - 1) * PAGE).astype(np.int32)
    s_indptr = np.concatenate(([0], np.cumsum(s_pages))).astype(np.int32)
    return (kv_indptr, np.concatenate(lists), last, prefix + suffix, p_pages,
            (s_indptr, np.concatenate(s_lists), last))


def reference(torch, q, k, v, kv_indptr, kv_indices, kv_lens):
    """float32 attention of each request's last query (q [batch, HQ, D]) over its pages."""
    outs = []
    for b, n in enumerate(kv_lens):
        pages = torch.from_numpy(kv_indices[kv_indptr[b]:kv_indptr[b + 1]]).long().cuda()
        kb = k[pages].reshape(-1, HKV, D)[:n].float().repeat_interleave(HQ // HKV, 1)
        vb = v[pages].reshape(-1, HKV, D)[:n].float().repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("hd,khd->hk", q[b].float(), kb) / D**0.5
        outs.append(torch.einsum("hk,khd->hd", s.softmax(-1), vb))
    return torch.stack(outs)


def main() -> int:
    p = C.base_parser(__doc__.split("\n\n")[0], budget=420, max_seconds=3,
                      names_help="Workloads: target, sweep, prefill, groups.")
    args = p.parse_args()
    torch = C.require_cuda()
    al = C.import_attnlang()
    from attnlang.runtime.cascade import CASCADE_MIN_KV

    reps, warmup = C.reps_and_warmup(args)
    only = C.Only(args.only)
    fi, fi_note = (None, "not asked") if args.no_peers else C.import_flashinfer()
    C.log(fi_note)
    copy_bw = C.copy_bandwidth()
    C.log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    causal = al.load(C.REPO_ROOT / "examples" / "causal.attn")
    suffix = suffix_lengths(REQUESTS)
    max_pages = (max(SWEEP) + int(suffix.max()) + PAGE) // PAGE * REQUESTS
    attn = al.BatchAttention(causal, HQ, HKV, D, page_size=PAGE, cascade=True,
                             max_batch_size=REQUESTS, max_total_q=PREFILL[0] * PREFILL[1],
                             max_kv_indices=max_pages)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows, t0 = [], time.perf_counter()
    work = []  # (kind, prefix, requests, new tokens per request: 1 for a decode step)
    kinds = only.select(["target", "sweep", "prefill", "groups"])
    if "target" in kinds:
        work.append(("target", TARGET_PREFIX, REQUESTS, 1))
    if "sweep" in kinds:
        work += [("sweep", p, REQUESTS, 1) for p in SWEEP if p != TARGET_PREFIX or not work]
    if "prefill" in kinds:
        work.append(("prefill", PREFILL[2], PREFILL[0], PREFILL[1]))
    if "groups" in kinds:
        work += [("groups", p, n, 1) for n in GROUPS[0] for p in GROUPS[1]]
    for kind, prefix, n, qo_len in work:
        if time.perf_counter() - t0 > args.budget:
            C.log(f"P={prefix}: skipped (budget {args.budget:g} s spent)")
            continue
        own = suffix[:n] if qo_len == 1 else np.full(n, qo_len)
        kv_indptr, kv_indices, last, kv_lens, p_pages, s_table = make_table(prefix, own)
        num_pages = int(kv_indices.max()) + 1
        k = torch.randn(num_pages, PAGE, HKV, D, generator=gen, device="cuda",
                        dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(n * qo_len, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        qo_indptr = (np.arange(n + 1) * qo_len).astype(np.int32)
        last_rows = torch.from_numpy(qo_indptr[1:] - 1).long().cuda()
        ref = reference(torch, q[last_rows], k, v, kv_indptr, kv_indices, kv_lens)
        table = (qo_indptr, kv_indptr, kv_indices, last)
        kv_bytes = int(kv_lens.sum()) * HKV * D * 4
        unique_bytes = (prefix + int(own.sum())) * HKV * D * 4
        label = f"{kind} P={prefix}" + (f" {n}x{qo_len}" if qo_len > 1 or n != REQUESTS else "")
        row = {"workload": label, "prefix": prefix, "kv_gb": kv_bytes / 1e9,
               "unique_gb": unique_bytes / 1e9}
        modes = [("plain", False), ("cascade", [(0, n, prefix)] if prefix else None)]
        if kind != "target":
            modes.append(("auto", "auto"))
        out = torch.empty_like(q)
        for name, cascade in modes:
            if cascade is None:
                continue
            plan = attn.plan(*table, cascade=cascade)
            row[f"{name}_levels"] = 0 if plan.cascade is None else plan.cascade_groups.count
            attn.run(q, (k, v), out=out)
            row[f"{name}_err"] = C.rel_l2(out[last_rows], ref)
            t = float(C.bench_graph(lambda q=q, kv=(k, v), out=out: attn.run(q, kv, out=out),
                                    warmup=warmup, reps=reps, max_seconds=args.max_seconds))
            row[f"{name}_ms"] = t * 1e3
            C.log(f"P={prefix} attnlang {name}: {t * 1e3:.3f} ms "
                  f"({row[f'{name}_levels']} levels), err {row[f'{name}_err']:.1e}")
        if fi is not None and prefix and kind in ("target", "prefill"):
            try:
                ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
                w = fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
                i32 = dict(dtype=torch.int32, device="cuda")
                s_indptr, s_indices, s_last = s_table
                w.plan([torch.tensor([0, n * qo_len], **i32),
                        torch.from_numpy(qo_indptr).cuda()],
                       [torch.tensor([0, p_pages], **i32), torch.from_numpy(s_indptr).cuda()],
                       [torch.arange(p_pages, **i32), torch.from_numpy(s_indices).cuda()],
                       [torch.tensor([PAGE], **i32), torch.from_numpy(s_last).cuda()],
                       HQ, HKV, D, PAGE, causal=qo_len > 1, q_data_type=torch.bfloat16,
                       kv_data_type=torch.bfloat16)
                fo = w.run(q, (k, v))
                row["fi_err"] = C.rel_l2(fo[last_rows], ref)
                try:
                    t = float(C.bench_graph(lambda w=w, q=q, kv=(k, v): w.run(q, kv),
                                            warmup=warmup, reps=reps,
                                            max_seconds=args.max_seconds))
                    row["fi_how"] = "graph"
                except Exception as e:  # noqa: BLE001 - its run() may not capture
                    C.log(f"  flashinfer graph failed ({C.short_error(e)}): plain calls")
                    torch.cuda.synchronize()
                    t = float(C.bench(lambda w=w, q=q, kv=(k, v): w.run(q, kv),
                                      warmup=warmup,
                                      reps=reps, max_seconds=args.max_seconds))
                    row["fi_how"] = "plain"
                row["fi_ms"] = t * 1e3
                C.log(f"P={prefix} flashinfer cascade: {t * 1e3:.3f} ms ({row['fi_how']}), "
                      f"err {row['fi_err']:.1e}")
            except Exception as e:  # noqa: BLE001 - a peer's failure is a row note
                row["fi_note"] = C.short_error(e)
                C.log(f"  flashinfer failed: {C.short_error(e)}")
        rows.append(row)
        del k, v
        torch.cuda.empty_cache()

    table = []
    for r in rows:
        table.append(dict(
            workload=r["workload"], plain=C.fmt(r.get("plain_ms"), ".3f"),
            cascade=C.fmt(r.get("cascade_ms"), ".3f"),
            gain=C.fmt(C.ratio(r.get("plain_ms"), r.get("cascade_ms")), ".2f"),
            auto=(C.fmt(r.get("auto_ms"), ".3f") + f" ({r['auto_levels']})"
                  if "auto_ms" in r else "-"),
            fi=C.fmt(r.get("fi_ms"), ".3f") + (f" ({r['fi_how']})" if "fi_how" in r else ""),
            vs_fi=C.fmt(C.ratio(r.get("fi_ms"), r.get("cascade_ms")), ".2f"),
            gbs=C.fmt(r["unique_gb"] / (r["cascade_ms"] * 1e-3) if r.get("cascade_ms")
                      else None, ".0f"),
            err=" / ".join(C.err_cell(r.get(f"{m}_err")) for m in ("cascade", "plain", "fi")),
            note=r.get("fi_note", "")[:60]))
    cols = [("workload", "workload"), ("plain", "no cascade ms"), ("cascade", "cascade ms"),
            ("gain", "gain"), ("auto", "auto ms (levels)"), ("fi", "FlashInfer ms"),
            ("vs_fi", "al/FI"), ("gbs", f"cascade GB/s (distinct KV; copy {copy_bw / 1e9:.0f})"),
            ("err", "err al casc / plain / FI"), ("note", "note")]
    print(C.format_table(table, cols, title=(
        f"Shared-prefix cascade: {REQUESTS} x 1 query (prefill: {PREFILL[0]} x {PREFILL[1]}), "
        f"suffix median 512, 32/8 heads, d128, page {PAGE}, bf16 (auto: levels past "
        f"{CASCADE_MIN_KV} positions)")))
    C.write_rows(args.out, "cascade", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
