"""Decode attention, side by side in one run on the same inputs (issue 3).

Workloads (batch, kv_len): (1, 32768), (16, 4096), (64, 2048), (128, 2048), (32, 8192) and a
skewed batch of 64 (lognormal lengths around 1024, sigma 1, clipped to [64, 32768]; 105058
tokens). bf16, 32 query / 8 KV heads, head_dim 128, one query token per request.

Contenders:
- attnlang: paged KV, page 16, pages in a shuffled order; plain run() and CUDA-graph replay
  (a decode loop's BatchAttention: max_qo_len=1, so a graph holds only the kernels a decode
  step reaches).
- FlashInfer 0.7.2 BatchDecodeWithPagedKVCacheWrapper on the same page table and caches:
  plain run() (plan outside the timed region) and, through a second wrapper built with
  use_cuda_graph=True and fixed index buffers, CUDA-graph replay.
- torch SDPA with the cuDNN and the flash backends on contiguous KV [B, 8, L, 128]
  (enable_gqa=True; K/V expanded to 32 heads only if a backend refuses GQA), padded to the
  longest request in the skewed case (with a padding mask where the backend takes one).
- FlexAttention under torch.compile (a padding block mask in the skewed case).

Figures: GB/s = K and V bytes the batch must read (sum(kv_len) * 8 heads * 128 * 2 bytes *
2) / median time; the fraction of the device-to-device copy bandwidth measured in the same
run; attnlang/peer = the peer's time / attnlang's time (above 1: attnlang is faster), plain
against plain and replay against replay. Padding is never counted as bytes read.

Then: plan() host time (median of 30, with a synchronize) of attnlang and FlashInfer on the
B128 batch, and attnlang's variants on (32, 8192): causal, softcap (cap 30), alibi
(geometric slopes), sliding_window (its example's const window 4096), as GB/s and ratio to
causal (the window variant needs only the last 4096 positions of each request: its bytes
count those).

Before timing, every contender's output is compared with a float32 torch evaluation of the
same bf16 inputs (rel. L2 error; over 1e-2 flags the row with '!'; attnlang's output buffer
is poisoned with NaN first). The tables are printed last.

Run from the repository root on the GPU machine (see benchmarks/README.md):
    python3 benchmarks/decode.py [--quick] [--only NAME,...] [--out $OUT] [--no-peers]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import common as C
except ImportError:  # run as `python3 -m benchmarks.decode`
    from benchmarks import common as C

HQ, HKV, HEAD_DIM, PAGE = 32, 8, 128, 16
GROUP = HQ // HKV
BYTES_PER_TOKEN = HKV * HEAD_DIM * 2 * 2  # K and V rows of one token, bf16
WINDOW = 4096  # examples/sliding_window.attn: const window: int = 4096
EXPAND_LIMIT_BYTES = 16 << 30  # never materialise 32-head K/V copies larger than this

MAIN = ["b1_l32768", "b16_l4096", "b64_l2048", "b128_l2048", "b32_l8192", "b64_skewed"]
QUICK = ["b1_l32768", "b64_l2048", "b64_skewed"]
SECTIONS = ["plan", "variants"]
PLAN_WORKLOAD = "b128_l2048"
VARIANT_WORKLOAD = "b32_l8192"
PEERS = ["flashinfer", "sdpa_cudnn", "sdpa_flash", "flex"]
CONTENDERS = ["attnlang"] + PEERS
# variant name, example file, params kind, reference semantics
VARIANTS = [
    ("causal", "causal.attn", None, {}),
    ("softcap", "softcap.attn", "cap", {"cap": 30.0}),
    ("alibi", "alibi.attn", "slopes", {}),
    ("sliding_window", "sliding_window.attn", None, {"window": WINDOW}),
]


def skewed_lengths() -> np.ndarray:
    """64 lognormal lengths (median 1024, sigma 1, seed 0) clipped to [64, 32768]."""
    x = np.random.default_rng(0).lognormal(np.log(1024), 1.0, 64)
    lens = np.clip(np.round(x), 64, 32768).astype(np.int64)
    if int(lens.sum()) != 105058:
        C.log(f"note: skewed lengths sum to {int(lens.sum())}, not 105058 (NumPy differs)")
    return lens


def workload_lengths(name: str) -> np.ndarray:
    if name == "b64_skewed":
        return skewed_lengths()
    b, length = name.split("_")
    return np.full(int(b[1:]), int(length[1:]), dtype=np.int64)


# ---------------------------------------------------------------------------- inputs


@dataclass
class InputSet:
    q: Any  # [B, HQ, D] bf16
    k_dense: Any  # [B, HKV, Lpad, D] bf16, contiguous (SDPA, Flex, the reference)
    v_dense: Any
    k_cache: Any  # [num_pages, PAGE, HKV, D] bf16: the same values, paged, pages shuffled
    v_cache: Any


@dataclass
class Workload:
    name: str
    lens: np.ndarray
    lpad: int
    qo_indptr: np.ndarray  # int32 [B+1]
    kv_indptr: np.ndarray  # int32 [B+1], pages
    kv_indices: np.ndarray  # int32 [num_pages], a permutation: pages in shuffled order
    kv_last_page_len: np.ndarray  # int32 [B]
    sets: list[InputSet]
    refs: dict[str, Any] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return int(self.lens.shape[0])

    @property
    def num_pages(self) -> int:
        return int(self.kv_indices.shape[0])

    @property
    def uniform(self) -> bool:
        return bool((self.lens == self.lens[0]).all())

    def kv_bytes(self, window: int | None = None) -> int:
        """K+V bytes attention must read: real tokens only (the last `window` ones)."""
        lens = self.lens if window is None else np.minimum(self.lens, window)
        return int(lens.sum()) * BYTES_PER_TOKEN


def build_workload(torch, name: str, seed: int) -> Workload:
    lens = workload_lengths(name)
    batch = lens.shape[0]
    pages = -(-lens // PAGE)
    lpad = int(pages.max()) * PAGE
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    num_pages = int(kv_indptr[-1])
    kv_indices = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    last = (lens - (pages - 1) * PAGE).astype(np.int32)
    paged_bytes = num_pages * PAGE * BYTES_PER_TOKEN
    nsets = C.rotation_sets(paged_bytes)
    gen = torch.Generator(device=C.DEVICE)
    gen.manual_seed(seed)
    dev, bf16 = C.DEVICE, torch.bfloat16
    idx = torch.from_numpy(kv_indices.astype(np.int64)).to(dev)
    sets = []
    for _ in range(nsets):
        q = torch.randn(batch, HQ, HEAD_DIM, generator=gen, device=dev, dtype=bf16)
        kd = torch.randn(batch, HKV, lpad, HEAD_DIM, generator=gen, device=dev, dtype=bf16)
        vd = torch.randn(batch, HKV, lpad, HEAD_DIM, generator=gen, device=dev, dtype=bf16)
        kc = torch.empty(num_pages, PAGE, HKV, HEAD_DIM, device=dev, dtype=bf16)
        vc = torch.empty_like(kc)
        for b in range(batch):
            n = int(pages[b])
            sel = idx[int(kv_indptr[b]):int(kv_indptr[b + 1])]
            kc[sel] = kd[b, :, : n * PAGE].permute(1, 0, 2).reshape(n, PAGE, HKV, HEAD_DIM)
            vc[sel] = vd[b, :, : n * PAGE].permute(1, 0, 2).reshape(n, PAGE, HKV, HEAD_DIM)
        sets.append(InputSet(q, kd, vd, kc, vc))
    torch.cuda.synchronize()
    qo = np.arange(batch + 1, dtype=np.int32)
    C.log(f"{name}: batch {batch}, {int(lens.sum())} tokens (max {int(lens.max())}), "
          f"{num_pages} pages, K+V {lens.sum() * BYTES_PER_TOKEN / 1e6:.0f} MB, "
          f"{nsets} input set(s) rotated")
    return Workload(name, lens, lpad, qo, kv_indptr, kv_indices, last, sets)


def reference(torch, wl: Workload, key: str, *, window=None, cap=None, slopes=None):
    """float32 decode output [B, HQ, D] of input set 0 (cached under `key`)."""
    if key not in wl.refs:
        s = wl.sets[0]
        out = torch.empty(wl.batch, HQ, HEAD_DIM, device=C.DEVICE, dtype=torch.float32)
        for b, n in enumerate(wl.lens.tolist()):
            k = s.k_dense[b, :, :n].transpose(0, 1)
            v = s.v_dense[b, :, :n].transpose(0, 1)
            out[b] = C.reference_rows(s.q[b:b + 1], [n - 1], k, v, causal=True, window=window,
                                      cap=cap, slopes=slopes)[0]
        wl.refs[key] = out
    return wl.refs[key]


# ---------------------------------------------------------------------------- contenders


@dataclass
class Prepared:
    """A contender ready to run: one callable per input set, each returning its output."""

    fns: list[Callable[[], Any]]
    packed: Callable[[Any], Any] = lambda o: o  # output -> [B, HQ, D]
    context: Callable[[], Any] = nullcontext  # entered around checks and timings
    poison: Callable[[], None] = lambda: None  # fill fixed output buffers with NaN
    check: bool = True  # False: output not comparable (timing only)
    note: str = ""
    keep: list[Any] = field(default_factory=list)  # objects to keep alive (wrappers, buffers)
    out: Any = None  # the fixed output buffer of input set 0, if any
    err: float | None = None  # set by the check
    check_note: str = ""


def prep_attnlang(al, torch, wl: Workload, variant, params=None) -> Prepared:
    attn = C.make_batch_attention(
        al, variant, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, dtype="bfloat16",
        page_size=PAGE, max_batch_size=wl.batch, max_total_q=wl.batch, max_qo_len=1,
        max_kv_indices=wl.num_pages)
    attn.plan(wl.qo_indptr, wl.kv_indptr, wl.kv_indices, wl.kv_last_page_len)
    outs = [torch.empty_like(s.q) for s in wl.sets]
    takes_out = "out" in C.filter_kwargs(attn.run, {"out": None})[0]

    def make(i: int):
        s, kw = wl.sets[i], {}
        if params:
            kw["params"] = params
        if takes_out:
            kw["out"] = outs[i]
        return lambda: attn.run(s.q, (s.k_cache, s.v_cache), **kw)

    def poison():
        for o in outs:
            o.fill_(float("nan"))

    return Prepared([make(i) for i in range(len(wl.sets))], poison=poison, keep=[attn, outs],
                    out=outs[0])


def prep_flashinfer(fi, torch, wl: Workload, *, graph: bool) -> Prepared:
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=C.DEVICE)
    indptr = torch.from_numpy(wl.kv_indptr)
    indices = torch.from_numpy(wl.kv_indices)
    last = torch.from_numpy(wl.kv_last_page_len)
    if graph:
        i32 = dict(dtype=torch.int32, device=C.DEVICE)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.empty(wl.batch + 1, **i32),
            paged_kv_indices_buffer=torch.empty(wl.num_pages, **i32),
            paged_kv_last_page_len_buffer=torch.empty(wl.batch, **i32))
    else:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(indptr, indices, last, HQ, HKV, HEAD_DIM, PAGE,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    outs = [torch.empty_like(s.q) for s in wl.sets]

    def make(i: int):
        s, o = wl.sets[i], outs[i]
        return lambda: w.run(s.q, (s.k_cache, s.v_cache), out=o)

    def poison():
        for o in outs:
            o.fill_(float("nan"))

    return Prepared([make(i) for i in range(len(wl.sets))], poison=poison, keep=[w, ws, outs],
                    out=outs[0])


def prep_sdpa(torch, wl: Workload, backend_name: str) -> Prepared:
    """SDPA on padded contiguous KV; tries GQA, then K/V expanded to 32 heads; with a padding
    mask in the skewed case, then (timing only) without one."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    batch = wl.batch
    mask = None
    if not wl.uniform:
        lens = torch.from_numpy(wl.lens).to(C.DEVICE)
        mask = (torch.arange(wl.lpad, device=C.DEVICE).view(1, -1) < lens.view(-1, 1))
        mask = mask.view(batch, 1, 1, wl.lpad)
    expanded_bytes = 2 * len(wl.sets) * batch * HQ * wl.lpad * HEAD_DIM * 2
    tries = [(True, mask, "")]
    if expanded_bytes <= EXPAND_LIMIT_BYTES:
        tries.append((False, mask, "K/V expanded to 32 heads (4x the bytes read)"))
    if mask is not None:
        tries.append((True, None, "padded, no mask (backend takes none): timing only"))
    errors = []
    for gqa, m, note in tries:
        try:
            if gqa:
                kvs = [(s.k_dense, s.v_dense) for s in wl.sets]
            else:
                kvs = [(s.k_dense.repeat_interleave(GROUP, dim=1),
                        s.v_dense.repeat_interleave(GROUP, dim=1)) for s in wl.sets]

            def make(i: int, kvs=kvs, gqa=gqa, m=m):
                q4 = wl.sets[i].q.view(batch, HQ, 1, HEAD_DIM)
                k, v = kvs[i]
                return lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=m,
                                                              enable_gqa=gqa)

            fns = [make(i) for i in range(len(wl.sets))]
            with sdpa_kernel([backend]):
                fns[0]()
            torch.cuda.synchronize()
            return Prepared(fns, packed=lambda o: o.reshape(batch, HQ, HEAD_DIM),
                            context=lambda: sdpa_kernel([backend]),
                            check=not (mask is not None and m is None), note=note,
                            keep=[kvs, m])
        except Exception as e:
            errors.append(C.short_error(e, 100))
            C.after_failure(torch)
    raise RuntimeError(" / ".join(errors))


_FLEX: dict[str, Any] = {}


def flex_compiled(torch):
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def prep_flex(torch, wl: Workload) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask

    flex = flex_compiled(torch)
    batch = wl.batch
    block_mask = None
    if not wl.uniform:
        lens = torch.from_numpy(wl.lens.astype(np.int32)).to(C.DEVICE)

        def padding(b, h, q_idx, kv_idx):
            return kv_idx < lens[b]

        block_mask = create_block_mask(padding, batch, None, 1, wl.lpad, device=C.DEVICE)

    def make(i: int):
        s = wl.sets[i]
        q4 = s.q.view(batch, HQ, 1, HEAD_DIM)
        return lambda: flex(q4, s.k_dense, s.v_dense, block_mask=block_mask, enable_gqa=True)

    return Prepared([make(i) for i in range(len(wl.sets))],
                    packed=lambda o: o.reshape(batch, HQ, HEAD_DIM), keep=[block_mask])


# ---------------------------------------------------------------------------- measuring


class Decode:
    def __init__(self, args):
        self.args = args
        self.torch = C.require_cuda()
        self.only = C.Only(args.only)
        self.run = C.Runner("decode", args, self.torch, tables=self.tables)
        self.rows = self.run.results.rows
        self.workloads: dict[str, Workload] = {}
        self.copy_gbps: float | None = None
        self.al = None
        self.fi = None
        self.fi_note = ""

    # -- inputs

    def workload(self, name: str) -> Workload:
        if name not in self.workloads:
            seed = 1000 + (MAIN.index(name) if name in MAIN else 99)
            self.workloads[name] = build_workload(self.torch, name, seed)
        return self.workloads[name]

    # -- one contender on one workload, plain and graph

    def measure(self, section: str, wl: Workload, contender: str, make_plain: Callable,
                make_graph: Callable | None, *, ref, nbytes: int, extra: dict | None = None,
                need: float = 5.0) -> None:
        """Set up, check, time plain calls, then CUDA-graph replays (of a second setup from
        make_graph when given, e.g. FlashInfer's use_cuda_graph wrapper); one row per mode."""
        base = dict(section=section, workload=wl.name, contender=contender, **(extra or {}))
        label = f"{wl.name} {contender}" + (f" [{extra['variant']}]" if extra else "")
        t0 = time.perf_counter()
        prep, note = self.run.step(f"{label} setup", make_plain, need=need)
        if prep is None:
            for mode in ("plain", "graph"):
                self.add(base, mode, None, nbytes, None, note)
            return
        setup_s = round(time.perf_counter() - t0, 2)
        self.one_mode(base, "plain", label, prep, ref, nbytes, setup_s=setup_s)
        gprep, note = prep, ""
        if make_graph is not None:
            gprep, note = self.run.step(f"{label} graph setup", make_graph)
        if gprep is None:
            self.add(base, "graph", None, nbytes, None, f"graph setup: {note}")
            return
        self.one_mode(base, "graph", label, gprep, ref, nbytes, recheck=gprep is not prep)

    def one_mode(self, base: dict, mode: str, label: str, prep: Prepared, ref, nbytes: int,
                 *, recheck: bool = True, **more) -> None:
        run = self.run
        timing, err, notes = None, None, [prep.note]
        with prep.context():
            if recheck or mode == "plain":
                err, cnote = run.step(f"{label} check", lambda: self.check(prep, ref))
                prep.err, prep.check_note = err, cnote
            else:
                err, cnote = prep.err, prep.check_note
            if cnote:  # the first call raised: timing it would only raise again
                notes.append(cnote)
            else:
                timer = run.time_plain if mode == "plain" else run.time_graph
                timing, tnote = run.step(f"{label} {mode}", lambda: timer(prep.fns))
                if tnote and mode == "graph" and not tnote.startswith("skipped"):
                    tnote = "capture failed: " + tnote
                notes += [tnote, self.tnote(timing)]
                if mode == "graph" and timing is not None and prep.out is not None:
                    # the replayed graph must compute what the plain call does
                    rerr, rnote = run.step(f"{label} replay check",
                                           lambda: self.check_replay(prep, timing, ref))
                    err = rerr if rerr is not None else err
                    notes.append(rnote and f"replay check: {rnote}")
        if not prep.check:
            err = None
            notes.append("unchecked")
        self.add(base, mode, timing, nbytes, err, "; ".join(n for n in notes if n), **more)

    def ref(self, wl: Workload, key: str, **semantics):
        """The float32 reference of wl for one variant, or None (rows then go unchecked)."""
        ref, note = self.run.step(f"{wl.name} reference [{key}]",
                                  lambda: reference(self.torch, wl, key, **semantics))
        return ref

    def check(self, prep: Prepared, ref) -> float | None:
        if ref is None:
            return None
        prep.poison()
        out = prep.fns[0]()
        out = prep.out if out is None or isinstance(out, tuple) else out
        self.torch.cuda.synchronize()
        return C.rel_l2(prep.packed(out), ref)

    def check_replay(self, prep: Prepared, timing, ref) -> float | None:
        graphs = getattr(timing, "graphs", None)
        if ref is None or not graphs:
            return None
        prep.poison()
        graphs[0].replay()
        self.torch.cuda.synchronize()
        return C.rel_l2(prep.packed(prep.out), ref)

    @staticmethod
    def tnote(t) -> str:
        return t.note if isinstance(t, C.Timing) else ""

    def add(self, base: dict, mode: str, t, nbytes: int, err, note: str, **more) -> None:
        secs = float(t) if t is not None else None
        gbps = nbytes / secs / 1e9 if secs else None
        row = dict(base, mode=mode, time_us=secs * 1e6 if secs else None, gbps=gbps,
                   frac_copy=C.ratio(gbps, self.copy_gbps), rel_err=err,
                   flagged=bool(err is not None and not err < C.REL_ERR_LIMIT),
                   reps=t.reps if isinstance(t, C.Timing) else None,
                   spread=round(t.spread, 3) if isinstance(t, C.Timing) else None,
                   bytes=nbytes, note=note, **more)
        self.run.results.add(**row)
        msg = (f"{secs * 1e6:9.1f} us  {gbps:7.0f} GB/s" if secs else "        -")
        C.log(f"  {row['workload']:<11} {row['contender']:<11} "
              f"{row.get('variant', ''):<14} {mode:<5} {msg}  err {C.err_cell(err)}"
              + (f"  ({note})" if note else ""))

    # -- sections

    def main_pass(self, workloads: list[str], contenders: list[str]) -> None:
        torch = self.torch
        v_causal = None
        if self.al is not None:
            v_causal, note = self.run.step("load causal.attn", lambda: self.al.load(
                str(C.REPO_ROOT / "examples" / "causal.attn")))
        # Pass 1: attnlang and FlashInfer (the comparison that matters most) on every workload.
        for name in workloads:
            wl, note = self.run.step(f"{name} inputs", lambda name=name: self.workload(name),
                                     need=10)
            if wl is None:
                C.log(f"{name}: no inputs ({note})")
                continue
            ref = self.ref(wl, "causal")
            nbytes = wl.kv_bytes()
            if "attnlang" in contenders:
                if self.al is None or v_causal is None:
                    for mode in ("plain", "graph"):
                        self.add(dict(section="decode", workload=name, contender="attnlang"),
                                 mode, None, nbytes, None, "attnlang not importable")
                else:
                    self.measure("decode", wl, "attnlang",
                                 lambda wl=wl: prep_attnlang(self.al, torch, wl, v_causal), None,
                                 ref=ref, nbytes=nbytes, need=20)
            if "flashinfer" in contenders:
                if self.fi is None:
                    for mode in ("plain", "graph"):
                        self.add(dict(section="decode", workload=name, contender="flashinfer"),
                                 mode, None, nbytes, None, self.fi_note)
                else:
                    self.measure(
                        "decode", wl, "flashinfer",
                        lambda wl=wl: prep_flashinfer(self.fi, torch, wl, graph=False),
                        lambda wl=wl: prep_flashinfer(self.fi, torch, wl, graph=True),
                        ref=ref, nbytes=nbytes, need=10)

    def peers_pass(self, workloads: list[str], contenders: list[str]) -> None:
        torch = self.torch
        for peer in ("sdpa_cudnn", "sdpa_flash", "flex"):
            if peer not in contenders:
                continue
            for name in workloads:
                wl = self.workloads.get(name)
                if wl is None:
                    continue
                ref = self.ref(wl, "causal")
                if peer == "flex":
                    make = lambda wl=wl: prep_flex(torch, wl)  # noqa: E731
                else:
                    make = lambda wl=wl, peer=peer: prep_sdpa(torch, wl, peer)  # noqa: E731
                self.measure("decode", wl, peer, make, None, ref=ref, nbytes=wl.kv_bytes(),
                             need=30 if peer == "flex" else 5)

    def plan_pass(self, contenders: list[str]) -> None:
        torch = self.torch
        wl, note = self.run.step("plan inputs", lambda: self.workload(PLAN_WORKLOAD), need=10)
        if wl is None:
            return
        results = {}
        if self.al is not None and "attnlang" in contenders:
            def al_plan():
                v = self.al.load(str(C.REPO_ROOT / "examples" / "causal.attn"))
                attn = prep_attnlang(self.al, torch, wl, v).keep[0]
                args = (wl.qo_indptr, wl.kv_indptr, wl.kv_indices, wl.kv_last_page_len)
                return C.host_time(lambda: attn.plan(*args), reps=30)

            results["attnlang"] = self.run.step("attnlang plan()", al_plan)
        if self.fi is not None and "flashinfer" in contenders:
            def fi_plan():
                w = prep_flashinfer(self.fi, torch, wl, graph=False).keep[0]
                args = (torch.from_numpy(wl.kv_indptr), torch.from_numpy(wl.kv_indices),
                        torch.from_numpy(wl.kv_last_page_len), HQ, HKV, HEAD_DIM, PAGE)
                return C.host_time(lambda: w.plan(*args, q_data_type=torch.bfloat16,
                                                  kv_data_type=torch.bfloat16), reps=30)

            results["flashinfer"] = self.run.step("flashinfer plan()", fi_plan)
        for who, (t, note) in results.items():
            self.run.results.add(section="plan", workload=wl.name, contender=who, mode="plan",
                                 time_us=float(t) * 1e6 if t is not None else None,
                                 reps=t.reps if t is not None else None, note=note)
            C.log(f"  plan() {who}: " + (f"{float(t) * 1e6:.0f} us" if t is not None else note))

    def variants_pass(self) -> None:
        torch = self.torch
        if self.al is None:
            return
        wl, note = self.run.step("variant inputs", lambda: self.workload(VARIANT_WORKLOAD),
                                 need=10)
        if wl is None:
            return
        slopes = C.alibi_slopes(HQ)
        for vname, file, pkind, sem in VARIANTS:
            v, note = self.run.step(f"load {file}",
                                    lambda file=file: self.al.load(
                                        str(C.REPO_ROOT / "examples" / file)))
            params = {"cap": 30.0} if pkind == "cap" else (
                {"slopes": slopes} if pkind == "slopes" else None)
            window = sem.get("window")
            ref = self.ref(wl, vname, window=window, cap=sem.get("cap"),
                           slopes=slopes if pkind == "slopes" else None)
            nbytes = wl.kv_bytes(window)
            extra = {"variant": vname}
            if v is None:
                for mode in ("plain", "graph"):
                    self.add(dict(section="variants", workload=wl.name, contender="attnlang",
                                  **extra), mode, None, nbytes, None, note)
                continue
            self.measure("variants", wl, "attnlang",
                         lambda v=v, params=params: prep_attnlang(self.al, torch, wl, v, params),
                         None, ref=ref, nbytes=nbytes, extra=extra, need=20)

    # -- the whole run

    def main(self) -> int:
        args, torch = self.args, self.torch
        env = C.environment(torch)
        self.run.results.set(env=env)
        C.log(f"decode benchmark on {env.get('gpu')} (torch {env.get('torch')}, "
              f"cupy {env.get('cupy')}, git {env.get('git')}); budget {args.budget:g} s")
        units = self.only.select((QUICK if args.quick else MAIN) + SECTIONS)
        contenders = ["attnlang"] if args.no_peers else self.only.select(
            CONTENDERS, always=["attnlang"])
        if self.only.unused():
            C.log(f"--only: no workload or contender starts with {self.only.unused()}")
        workloads = [u for u in units if u in MAIN]
        C.log(f"workloads {workloads}; sections {[u for u in units if u in SECTIONS]}; "
              f"contenders {contenders}")
        C.raise_dynamo_limits()
        self.copy_gbps = self.run.ceilings(matmul=False)["copy_gbps"]
        al, note = self.run.step("import attnlang", C.import_attnlang)
        self.al = al
        if al is None:
            C.log(f"attnlang rows will be empty: {note}")
        if "flashinfer" in contenders:
            self.fi, note = C.import_flashinfer()
            C.log(note)
            self.run.results.set(flashinfer=note)
            self.fi_note = "FlashInfer not importable (see the log / json meta)"
        self.main_pass(workloads, contenders)
        if "plan" in units:
            self.plan_pass(contenders)
        if "variants" in units:
            self.variants_pass()
        self.peers_pass(workloads, contenders)
        self.run.finish()
        return 0

    # -- tables

    def ratios(self) -> None:
        """attnlang/peer (peer time / attnlang time) on every row, like against like."""
        base = {(r["section"], r["workload"], r.get("variant"), r["mode"]): r.get("time_us")
                for r in self.rows if r.get("contender") == "attnlang"}
        causal = {r["mode"]: r.get("gbps") for r in self.rows
                  if r.get("section") == "variants" and r.get("variant") == "causal"}
        for r in self.rows:
            if r.get("section") == "plan":
                continue
            key = (r["section"], r["workload"], r.get("variant"), r["mode"])
            if r.get("contender") != "attnlang":
                r["attnlang_over_peer"] = C.ratio(r.get("time_us"), base.get(key))
            if r.get("section") == "variants":
                r["gbps_vs_causal"] = C.ratio(r.get("gbps"), causal.get(r["mode"]))

    def tables(self) -> str:
        self.ratios()
        self.run.results.flush()
        rows = self.rows
        ceil = f"copy {C.fmt(self.copy_gbps, '.0f')} GB/s"
        out = []
        main = [r for r in rows if r.get("section") == "decode"]
        shown = [r for r in main if not (r.get("time_us") is None
                                         and self.fi_note and r.get("note") == self.fi_note)]
        if shown:
            out.append(C.format_table([dict(
                workload=r["workload"], contender=r["contender"], mode=r["mode"],
                us=C.fmt(r.get("time_us"), ".1f"), gbps=C.fmt(r.get("gbps"), ".0f"),
                copy=C.fmt(100 * r["frac_copy"], ".0f") + "%" if r.get("frac_copy") else "-",
                ratio=C.fmt(r.get("attnlang_over_peer"), ".2f"),
                err=C.err_cell(r.get("rel_err")), note=(r.get("note") or "")[:44])
                for r in shown],
                [("workload", "workload"), ("contender", "contender"), ("mode", "mode"),
                 ("us", "us"), ("gbps", "GB/s"), ("copy", "of copy"),
                 ("ratio", "attnlang/peer"), ("err", "rel err"), ("note", "note")],
                title=f"Decode, bf16 32/8 heads d128 page 16 ({ceil}); attnlang/peer = peer "
                      "time / attnlang time, plain vs plain, graph vs graph"))
            if len(shown) < len(main):
                out[-1] += (f"\n({len(main) - len(shown)} FlashInfer rows left out: "
                            f"{self.fi_note})")
        plan = [r for r in rows if r.get("section") == "plan"]
        if plan:
            al = next((r.get("time_us") for r in plan if r["contender"] == "attnlang"), None)
            out.append(C.format_table([dict(
                who=r["contender"], us=C.fmt(r.get("time_us"), ".0f"),
                ratio=C.fmt(C.ratio(al, r.get("time_us")), ".2f"),
                note=(r.get("note") or "")[:44]) for r in plan],
                [("who", "plan()"), ("us", "us (host, median)"),
                 ("ratio", "attnlang/this"), ("note", "note")],
                title=f"plan() on {PLAN_WORKLOAD} (host wall clock with a synchronize)"))
        var = [r for r in rows if r.get("section") == "variants"]
        if var:
            out.append(C.format_table([dict(
                variant=r.get("variant"), mode=r["mode"], us=C.fmt(r.get("time_us"), ".1f"),
                gbps=C.fmt(r.get("gbps"), ".0f"),
                copy=C.fmt(100 * r["frac_copy"], ".0f") + "%" if r.get("frac_copy") else "-",
                vs=C.fmt(r.get("gbps_vs_causal"), ".2f"), err=C.err_cell(r.get("rel_err")),
                note=(r.get("note") or "")[:44]) for r in var],
                [("variant", "variant"), ("mode", "mode"), ("us", "us"), ("gbps", "GB/s"),
                 ("copy", "of copy"), ("vs", "GB/s vs causal"), ("err", "rel err"),
                 ("note", "note")],
                title=f"attnlang variants on {VARIANT_WORKLOAD} (window: bytes of the last "
                      f"{WINDOW} positions)"))
        summary = []
        for name in [n for n in MAIN if any(r["workload"] == n for r in main)]:
            def get(contender, mode, key, name=name):
                return next((r.get(key) for r in main if r["workload"] == name
                             and r["contender"] == contender and r["mode"] == mode), None)

            cells = dict(workload=name,
                         plain=C.fmt(get("attnlang", "plain", "gbps"), ".0f"),
                         graph=C.fmt(get("attnlang", "graph", "gbps"), ".0f"),
                         copy=(C.fmt(100 * get("attnlang", "graph", "frac_copy"), ".0f") + "%"
                               if get("attnlang", "graph", "frac_copy") else "-"),
                         err=C.err_cell(get("attnlang", "plain", "rel_err")))
            for peer in PEERS:
                for mode in ("plain", "graph"):
                    cells[f"{peer}_{mode}"] = C.fmt(
                        get(peer, mode, "attnlang_over_peer"), ".2f")
            summary.append(cells)
        if summary:
            cols = [("workload", "workload"), ("plain", "al GB/s"), ("graph", "al graph"),
                    ("copy", "graph/copy"), ("err", "al err")]
            short = {"flashinfer": "FI", "sdpa_cudnn": "cuDNN", "sdpa_flash": "flash",
                     "flex": "flex"}
            for peer in PEERS:
                cols += [(f"{peer}_plain", f"x{short[peer]}"),
                         (f"{peer}_graph", f"x{short[peer]} g")]
            out.append(C.format_table(
                summary, cols,
                title=f"SUMMARY decode ({ceil}): attnlang GB/s and attnlang/peer speed ratios "
                      "(xPEER = plain calls, 'g' = CUDA-graph replays; >1 = attnlang faster)"))
        return "\n\n".join(out) if out else "(no results)"


def parse_args(argv=None):
    p = C.base_parser(
        __doc__.split("\n\n")[0], budget=540, max_seconds=15,
        names_help=f"Workloads: {', '.join(MAIN)}; sections: {', '.join(SECTIONS)}; "
                   f"contenders: {', '.join(CONTENDERS)} (attnlang always runs).")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return Decode(args).main()


if __name__ == "__main__":
    raise SystemExit(main())
