"""Prefill attention, side by side in one run on the same inputs (issue 4).

bf16, head_dim 128 (`--head-dim 64|256`: the same workloads at another head dim), every query
row of every prompt (qo_len = kv_len). Workloads:
- causal and full at (batch, heads, seq) = (1, 32, 4096), (1, 32, 16384), (8, 32, 2048);
- causal GQA 32 query / 8 KV heads at 8192;
- at 16384, causal, 32 heads: a sliding window of 1024 (a variant generated into a temp dir:
  `mask = causal and q_pos - kv_pos < window`, window 1024), soft-cap 30
  (examples/softcap.attn), ALiBi with geometric slopes (examples/alibi.attn);
- a ragged causal batch of 16 prompts, lengths numpy.geomspace(128, 8192, 16) rounded up to
  multiples of 16 (33504 tokens), 32 heads.

Contenders:
- attnlang_paged: BatchAttention over a paged cache (page 16, pages shuffled);
  attnlang_ragged: the same kernel on the packed K/V FlashInfer's ragged wrapper reads
  ([tokens, heads, D], `kv_layout="ragged"`: request b's keys are rows kv_indptr[b]: of
  it, copied by TMA from any row). On an H100 both run
  the wgmma path (compiled for sm_90a); attnlang_mma_sync is attnlang_paged compiled for
  plain sm_90, i.e. the mma.sync path every sm_80+ GPU runs.
- FlashInfer 0.7.2: BatchPrefillWithPagedKVCacheWrapper with backend "fa3" and "fa2" (same
  page table), BatchPrefillWithRaggedKVCacheWrapper with "fa3". Only its precompiled modules
  are used: FA3 plain / soft-cap / window, FA2 plain (no ALiBi, no FA2 soft-cap or window:
  those would JIT-compile with nvcc for minutes). Window 1024 = FlashInfer window_left 1023
  (its left bound is inclusive).
- torch SDPA, cuDNN and flash backends (is_causal; enable_gqa for GQA), on the uniform
  causal/full workloads (it has no ragged batches, and soft-cap, ALiBi or a window would need a
  dense [S, S] mask).
- FlexAttention under torch.compile: causal / window block masks, soft-cap and ALiBi as
  score_mods, a document mask over the packed ragged batch.

Figures: TFLOP/s counting only unmasked (query, key) pairs, 4 * pairs * head_dim * heads
(two matmuls, 2 flops per multiply-add); the fraction of the bf16 8192^3 matmul rate measured
in the same run; attnlang/peer = the peer's time / attnlang's time (above 1: attnlang is
faster), for attnlang_paged and attnlang_ragged alike. Plain calls only (prefill kernels run
for milliseconds, so launch overhead and CUDA graphs do not matter). One input set: prefill is
compute-bound, so L2 rotation would not change the figures (see common.py).

Before timing, every contender's output is compared, on a sample of query rows of every
request (the first 8, the last 8 and 16 spread between), with a float32 torch evaluation of
the same bf16 inputs (rel. L2 error; over 1e-2 flags the row with '!'). `--max-seconds` bounds
each contender's timing (fewer reps, row marked). The tables are printed last.

Run from the repository root on the GPU machine (see benchmarks/README.md):
    python3 benchmarks/prefill.py [--quick] [--only NAME,...] [--out $OUT] [--no-peers]
                                  [--head-dim 64|128|256]
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

try:
    import common as C
except ImportError:  # run as `python3 -m benchmarks.prefill`
    from benchmarks import common as C

HEAD_DIM, PAGE = 128, 16  # HEAD_DIM: --head-dim sets it before anything is built
WINDOW, CAP = 1024, 30.0
W1024_SOURCE = ("variant w1024\nconst window: int = 1024\n"
                "mask = causal and q_pos - kv_pos < window\n")
EXPAND_LIMIT_BYTES = 16 << 30


def ragged_lengths() -> tuple[int, ...]:
    """geomspace(128, 8192, 16), rounded to integers, then up to multiples of 16."""
    g = np.round(np.geomspace(128, 8192, 16)).astype(np.int64)
    lens = (g + PAGE - 1) // PAGE * PAGE
    if int(lens.sum()) != 33504:
        C.log(f"note: ragged lengths sum to {int(lens.sum())}, not 33504")
    return tuple(int(x) for x in lens)


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # causal | full | window | softcap | alibi
    lens: tuple[int, ...]
    hq: int = 32
    hkv: int = 32

    @property
    def causal(self) -> bool:
        return self.kind != "full"

    @property
    def uniform(self) -> bool:
        return len(set(self.lens)) == 1

    def pairs(self) -> int:
        """Unmasked (query, key) pairs of one head."""
        total = 0
        for s in self.lens:
            if self.kind == "full":
                total += s * s
            elif self.kind == "window" and s > WINDOW:
                total += WINDOW * (WINDOW + 1) // 2 + (s - WINDOW) * WINDOW
            else:
                total += s * (s + 1) // 2
        return total

    def flops(self) -> int:
        return 4 * self.pairs() * HEAD_DIM * self.hq


SPECS = [
    Spec("causal_s4096", "causal", (4096,)),
    Spec("full_s4096", "full", (4096,)),
    Spec("causal_s16384", "causal", (16384,)),
    Spec("full_s16384", "full", (16384,)),
    Spec("causal_b8_s2048", "causal", (2048,) * 8),
    Spec("full_b8_s2048", "full", (2048,) * 8),
    Spec("gqa_causal_s8192", "causal", (8192,), 32, 8),
    Spec("window1024_s16384", "window", (16384,)),
    Spec("softcap_s16384", "softcap", (16384,)),
    Spec("alibi_s16384", "alibi", (16384,)),
    Spec("ragged16", "causal", ()),  # lengths filled in by specs()
]
QUICK = ["causal_s4096", "causal_b8_s2048", "gqa_causal_s8192", "softcap_s16384", "ragged16"]
CONTENDERS = ["attnlang_paged", "attnlang_ragged", "attnlang_mma_sync", "flashinfer_fa3_paged",
              "flashinfer_fa3_ragged", "flashinfer_fa2_paged", "sdpa_cudnn", "sdpa_flash", "flex"]
PEERS = CONTENDERS[3:]
ATTNLANG = CONTENDERS[:2]  # always run; the ratios are taken against them
MMA_SYNC_ARCH = "sm_90"  # no 'a': the prefill kernel takes the mma.sync path
EXAMPLE = {"causal": "causal.attn", "full": "full.attn", "softcap": "softcap.attn",
           "alibi": "alibi.attn"}


def specs() -> dict[str, Spec]:
    out = {}
    for s in SPECS:
        if s.name == "ragged16":
            s = Spec(s.name, s.kind, ragged_lengths(), s.hq, s.hkv)
        out[s.name] = s
    return out


# ---------------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    spec: Spec
    lens: np.ndarray
    qo_indptr: np.ndarray  # int32 [B+1], tokens (also the ragged kv_indptr)
    q: Any  # [T, hq, D]
    k: Any  # [T, hkv, D] (packed, ragged: FlashInfer's ragged wrapper reads these)
    v: Any
    kv_indptr: np.ndarray  # int32 [B+1], pages of 16
    kv_indices: np.ndarray  # int32, shuffled pages
    last_page_len: np.ndarray  # int32 [B]
    k_paged: Any  # [P, 16, hkv, D]
    v_paged: Any
    rows: Any  # long [N]: the packed query rows checked
    ref: Any = None  # float32 [N, hq, D]
    extra: dict[str, Any] = field(default_factory=dict)  # lazily built layouts

    @property
    def batch(self) -> int:
        return int(self.lens.shape[0])

    @property
    def total(self) -> int:
        return int(self.qo_indptr[-1])

    def bhsd(self):
        """(q, k, v) as [B, heads, S, D] contiguous (uniform batches) or [1, heads, T, D]
        (the packed ragged batch, for FlexAttention's document mask)."""
        if "bhsd" not in self.extra:
            s = self.spec
            b, length = (self.batch, int(self.lens[0])) if s.uniform else (1, self.total)

            def t(x, h):
                return x.view(b, length, h, HEAD_DIM).transpose(1, 2).contiguous()

            self.extra["bhsd"] = (t(self.q, s.hq), t(self.k, s.hkv), t(self.v, s.hkv))
        return self.extra["bhsd"]


def sample_rows(length: int) -> np.ndarray:
    first = np.arange(min(8, length))
    last = np.arange(max(0, length - 8), length)
    spread = np.linspace(0, length - 1, 16).round().astype(np.int64)
    return np.unique(np.concatenate([first, last, spread]))


def build_inputs(torch, spec: Spec, seed: int, slopes) -> Inputs:
    lens = np.asarray(spec.lens, dtype=np.int64)
    batch, total = lens.shape[0], int(lens.sum())
    qo = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    gen = torch.Generator(device=C.DEVICE)
    gen.manual_seed(seed)
    dev, bf16 = C.DEVICE, torch.bfloat16
    q = torch.randn(total, spec.hq, HEAD_DIM, generator=gen, device=dev, dtype=bf16)
    k = torch.randn(total, spec.hkv, HEAD_DIM, generator=gen, device=dev, dtype=bf16)
    v = torch.randn(total, spec.hkv, HEAD_DIM, generator=gen, device=dev, dtype=bf16)
    pages = -(-lens // PAGE)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    num_pages = int(kv_indptr[-1])
    kv_indices = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    last = (lens - (pages - 1) * PAGE).astype(np.int32)
    kp = torch.zeros(num_pages, PAGE, spec.hkv, HEAD_DIM, device=dev, dtype=bf16)
    vp = torch.zeros_like(kp)
    idx = torch.from_numpy(kv_indices.astype(np.int64)).to(dev)
    for b in range(batch):
        start, n = int(qo[b]), int(lens[b])
        sel = idx[int(kv_indptr[b]):int(kv_indptr[b + 1])]
        full, rem = divmod(n, PAGE)
        kp[sel[:full]] = k[start:start + full * PAGE].view(full, PAGE, spec.hkv, HEAD_DIM)
        vp[sel[:full]] = v[start:start + full * PAGE].view(full, PAGE, spec.hkv, HEAD_DIM)
        if rem:
            kp[sel[full], :rem] = k[start + full * PAGE:start + n]
            vp[sel[full], :rem] = v[start + full * PAGE:start + n]
    # Reference rows: float32 torch on the same bf16 inputs.
    rows, refs = [], []
    for b in range(batch):
        start, n = int(qo[b]), int(lens[b])
        local = sample_rows(n)
        packed = torch.from_numpy(start + local).to(dev)
        refs.append(C.reference_rows(
            q[packed], torch.from_numpy(local), k[start:start + n], v[start:start + n],
            causal=spec.causal, window=WINDOW if spec.kind == "window" else None,
            cap=CAP if spec.kind == "softcap" else None,
            slopes=slopes if spec.kind == "alibi" else None))
        rows.append(packed)
    inputs = Inputs(spec, lens, qo, q, k, v, kv_indptr, kv_indices, last, kp, vp,
                    torch.cat(rows), torch.cat(refs))
    torch.cuda.synchronize()
    C.log(f"{spec.name}: {batch} request(s), {total} tokens, {spec.hq}/{spec.hkv} heads, "
          f"{num_pages} pages, {spec.flops() / 1e12:.2f} TFLOP per call")
    return inputs


# ---------------------------------------------------------------------------- contenders


@dataclass
class Prepared:
    fn: Callable[[], Any]
    packed: Callable[[Any], Any] = lambda o: o  # output -> [T, hq, D]
    context: Callable[[], Any] = nullcontext
    poison: Callable[[], None] = lambda: None
    note: str = ""
    keep: list[Any] = field(default_factory=list)
    out: Any = None  # the fixed output buffer, if any


def prep_attnlang(al, torch, x: Inputs, variant, params, *, ragged: bool,
                  arch: str | None = None) -> Prepared:
    s = x.spec
    if ragged:  # kv_layout="ragged": the packed k, v FlashInfer's ragged wrapper reads
        kc, vc = x.k, x.v
        layout = dict(kv_layout="ragged", max_kv_indices=x.total)
        plan = (x.qo_indptr, x.qo_indptr)
    else:
        kc, vc = x.k_paged, x.v_paged
        layout = dict(page_size=PAGE, max_kv_indices=max(len(x.kv_indices), 1))
        plan = (x.qo_indptr, x.kv_indptr, x.kv_indices, x.last_page_len)
    attn = C.make_batch_attention(
        al, variant, num_qo_heads=s.hq, num_kv_heads=s.hkv, head_dim=HEAD_DIM,
        dtype="bfloat16", max_batch_size=x.batch, max_total_q=x.total, **layout,
        **({"arch": arch} if arch else {}))
    attn.plan(*plan)
    out = torch.empty_like(x.q)
    kw: dict[str, Any] = {}
    if params:
        kw["params"] = params
    if "out" in C.filter_kwargs(attn.run, {"out": None})[0]:
        kw["out"] = out
    return Prepared(lambda: attn.run(x.q, (kc, vc), **kw),
                    poison=lambda: out.fill_(float("nan")), keep=[attn, out], out=out)


def flashinfer_args(spec: Spec, backend: str) -> dict[str, Any] | str:
    """plan() keyword arguments for this workload, or why it is not run (not precompiled)."""
    if spec.kind == "alibi":
        return "ALiBi is not among the precompiled FlashInfer modules (would JIT-compile)"
    if backend == "fa2" and spec.kind in ("window", "softcap"):
        return f"FA2 {spec.kind} is not precompiled (would JIT-compile)"
    return dict(causal=spec.causal, window_left=WINDOW - 1 if spec.kind == "window" else -1,
                logits_soft_cap=CAP if spec.kind == "softcap" else 0.0)


def prep_flashinfer(fi, torch, x: Inputs, backend: str, *, paged: bool) -> Prepared:
    s = x.spec
    kw = flashinfer_args(s, backend)
    if isinstance(kw, str):
        raise NotImplementedError(kw)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=C.DEVICE)
    qo = torch.from_numpy(x.qo_indptr)
    dtypes = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out = torch.empty_like(x.q)
    if paged:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(qo, torch.from_numpy(x.kv_indptr), torch.from_numpy(x.kv_indices),
               torch.from_numpy(x.last_page_len), s.hq, s.hkv, HEAD_DIM, PAGE, **kw, **dtypes)

        def fn():
            return w.run(x.q, (x.k_paged, x.v_paged), out=out)
    else:
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(qo, qo.clone(), s.hq, s.hkv, HEAD_DIM, **kw, **dtypes)

        def fn():
            return w.run(x.q, x.k, x.v, out=out)
    return Prepared(fn, poison=lambda: out.fill_(float("nan")), keep=[w, ws, out],
                    out=out)


def prep_sdpa(torch, x: Inputs, name: str) -> Prepared:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s = x.spec
    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_flash": SDPBackend.FLASH_ATTENTION}[name]
    q4, k4, v4 = x.bhsd()
    batch, length = q4.shape[0], q4.shape[2]

    def packed(o):
        return o.transpose(1, 2).reshape(batch * length, s.hq, HEAD_DIM)

    tries = [(k4, v4, s.hq != s.hkv, "")]
    if s.hq != s.hkv and 2 * k4.numel() * (s.hq // s.hkv) * 2 <= EXPAND_LIMIT_BYTES:
        tries.append((None, None, False, "K/V expanded to all query heads"))
    errors = []
    for k, v, gqa, note in tries:
        try:
            if k is None:
                group = s.hq // s.hkv
                k, v = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)

            def fn(k=k, v=v, gqa=gqa):
                return F.scaled_dot_product_attention(q4, k, v, is_causal=s.causal,
                                                      enable_gqa=gqa)

            with sdpa_kernel([backend]):
                fn()
            torch.cuda.synchronize()
            return Prepared(fn, packed=packed, context=lambda: sdpa_kernel([backend]),
                            note=note, keep=[k, v])
        except Exception as e:
            errors.append(C.short_error(e, 100))
            C.after_failure(torch)
    raise RuntimeError(" / ".join(errors))


_FLEX: dict[str, Any] = {}


def block_mask_for(create_block_mask, mask_mod, length: int):
    """A FlexAttention block mask over [length, length], broadcast over batch and heads. Long
    sequences build it compiled (no dense [length, length] intermediates), falling back to
    the eager build if that fails."""
    if length > 8192:
        try:
            return create_block_mask(mask_mod, None, None, length, length, device=C.DEVICE,
                                     _compile=True)
        except Exception as e:
            C.log(f"  compiled create_block_mask failed ({C.short_error(e, 80)}); eager build")
    return create_block_mask(mask_mod, None, None, length, length, device=C.DEVICE)


def prep_flex(torch, x: Inputs, slopes) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    s = x.spec
    q4, k4, v4 = x.bhsd()
    batch, length = q4.shape[0], q4.shape[2]

    if s.uniform:
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
    else:
        doc = torch.repeat_interleave(
            torch.arange(x.batch, device=C.DEVICE, dtype=torch.int32),
            torch.from_numpy(x.lens).to(C.DEVICE))

        def causal(b, h, q_idx, kv_idx):  # document mask: causal within each prompt
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    def softcap(score, b, h, q_idx, kv_idx):
        return CAP * torch.tanh(score / CAP)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    mask_mod = {"full": None, "window": window}.get(s.kind, causal)
    score_mod = {"softcap": softcap, "alibi": alibi}.get(s.kind)
    block_mask = None
    if mask_mod is not None:
        block_mask = block_mask_for(create_block_mask, mask_mod, length)
    gqa = s.hq != s.hkv

    def fn():
        return flex(q4, k4, v4, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)

    def packed(o):
        return o.transpose(1, 2).reshape(batch * length, s.hq, HEAD_DIM)

    return Prepared(fn, packed=packed, keep=[block_mask])


# ---------------------------------------------------------------------------- measuring


class Prefill:
    def __init__(self, args):
        self.args = args
        self.torch = C.require_cuda()
        self.only = C.Only(args.only)
        self.run = C.Runner("prefill", args, self.torch, tables=self.tables)
        self.rows = self.run.results.rows
        self.specs = specs()
        self.inputs: dict[str, Inputs] = {}
        self.mm_tflops: float | None = None
        self.al = None
        self.fi = None
        self.fi_note = ""
        self.variants: dict[str, Any] = {}
        self.slopes = None
        self._tmp = tempfile.TemporaryDirectory(prefix="attnlang-bench-")

    def variant(self, kind: str):
        if kind not in self.variants:
            if kind == "window":
                path = Path(self._tmp.name) / "w1024.attn"
                path.write_text(W1024_SOURCE)
            else:
                path = C.REPO_ROOT / "examples" / EXAMPLE[kind]
            self.variants[kind] = self.al.load(str(path))
        return self.variants[kind]

    def params(self, kind: str):
        if kind == "softcap":
            return {"cap": CAP}
        if kind == "alibi":
            return {"slopes": self.slopes}
        return None

    def get_inputs(self, name: str) -> Inputs:
        if name not in self.inputs:
            seed = 2000 + list(self.specs).index(name)
            self.inputs[name] = build_inputs(self.torch, self.specs[name], seed, self.slopes)
        return self.inputs[name]

    def applicable(self, spec: Spec, contender: str) -> bool:
        if contender.startswith("sdpa"):
            return spec.uniform and spec.kind in ("causal", "full")
        return True

    def measure(self, x: Inputs, contender: str, make: Callable, *, need: float) -> None:
        run = self.run
        label = f"{x.spec.name} {contender}"
        t0 = time.perf_counter()
        prep, note = run.step(f"{label} setup", make, need=need)
        if prep is None:
            self.add(x, contender, None, None, note)
            return
        setup_s = time.perf_counter() - t0
        t, tnote = None, ""
        with prep.context():
            err, cnote = run.step(f"{label} check", lambda: self.check(prep, x))
            if not cnote:  # the first call raised: timing it would only raise again
                t, tnote = run.step(f"{label} time", lambda: run.time_plain(prep.fn))
        notes = [prep.note, cnote and f"check: {cnote}", tnote,
                 t.note if isinstance(t, C.Timing) else ""]
        self.add(x, contender, t, None if cnote else err, "; ".join(n for n in notes if n),
                 setup_s=round(setup_s, 2))

    def check(self, prep: Prepared, x: Inputs) -> float:
        prep.poison()
        out = prep.fn()
        out = prep.out if out is None or isinstance(out, tuple) else out
        self.torch.cuda.synchronize()
        return C.rel_l2(prep.packed(out)[x.rows], x.ref)

    def add(self, x: Inputs, contender: str, t, err, note: str, **more) -> None:
        secs = float(t) if t is not None else None
        tflops = x.spec.flops() / secs / 1e12 if secs else None
        row = dict(workload=x.spec.name, kind=x.spec.kind, contender=contender,
                   time_ms=secs * 1e3 if secs else None, tflops=tflops,
                   frac_matmul=C.ratio(tflops, self.mm_tflops), rel_err=err,
                   flagged=bool(err is not None and not err < C.REL_ERR_LIMIT),
                   reps=t.reps if isinstance(t, C.Timing) else None,
                   spread=round(t.spread, 3) if isinstance(t, C.Timing) else None,
                   flops=x.spec.flops(), note=note, **more)
        self.run.results.add(**row)
        msg = f"{secs * 1e3:9.3f} ms  {tflops:6.1f} TFLOP/s" if secs else "        -"
        C.log(f"  {x.spec.name:<18} {contender:<22} {msg}  err {C.err_cell(err)}"
              + (f"  ({note})" if note else ""))

    def maker(self, x: Inputs, c: str) -> Callable[[], Prepared] | str:
        """A zero-argument setup for contender c on x, or why it does not run."""
        torch, spec = self.torch, x.spec
        if c.startswith("attnlang"):
            if self.al is None:
                return "attnlang not importable"
            return partial(self._prep_attnlang, x, ragged=c.endswith("ragged"),
                           arch=MMA_SYNC_ARCH if c == "attnlang_mma_sync" else None)
        if c.startswith("flashinfer"):
            if self.fi is None:
                return self.fi_note
            backend = "fa2" if "_fa2_" in c else "fa3"
            why = flashinfer_args(spec, backend)
            if isinstance(why, str):
                return why
            return partial(prep_flashinfer, self.fi, torch, x, backend,
                           paged=c.endswith("paged"))
        if c == "flex":
            return partial(prep_flex, torch, x, self.slopes)
        return partial(prep_sdpa, torch, x, c)

    def _prep_attnlang(self, x: Inputs, *, ragged: bool, arch: str | None) -> Prepared:
        return prep_attnlang(self.al, self.torch, x, self.variant(x.spec.kind),
                             self.params(x.spec.kind), ragged=ragged, arch=arch)

    def contender_pass(self, names: list[str], contenders: list[str]) -> None:
        for name in names:
            spec = self.specs[name]
            x, note = self.run.step(f"{name} inputs", partial(self.get_inputs, name), need=15)
            if x is None:
                C.log(f"{name}: no inputs ({note})")
                continue
            for c in contenders:
                if c == "flex" or not self.applicable(spec, c):
                    continue
                make = self.maker(x, c)
                if isinstance(make, str):
                    if c in ATTNLANG or self.fi is None:
                        self.add(x, c, None, None, make)
                    else:
                        C.log(f"  {name:<18} {c:<22} not run: {make}")
                    continue
                self.measure(x, c, make, need=20 if c in ATTNLANG else 5)

    def flex_pass(self, names: list[str]) -> None:
        for name in names:
            x = self.inputs.get(name)
            if x is None:
                continue
            self.measure(x, "flex", self.maker(x, "flex"), need=30)

    def main(self) -> int:
        args, torch = self.args, self.torch
        env = C.environment(torch)
        self.run.results.set(env=env, head_dim=HEAD_DIM)
        C.log(f"prefill benchmark (d{HEAD_DIM}) on {env.get('gpu')} (torch {env.get('torch')}, "
              f"cupy {env.get('cupy')}, git {env.get('git')}); budget {args.budget:g} s")
        names = self.only.select(QUICK if args.quick else list(self.specs))
        contenders = ATTNLANG if args.no_peers else self.only.select(CONTENDERS,
                                                                     always=ATTNLANG)
        if self.only.unused():
            C.log(f"--only: no workload or contender starts with {self.only.unused()}")
        C.log(f"workloads {names}; contenders {contenders}")
        C.raise_dynamo_limits()
        self.mm_tflops = self.run.ceilings(matmul=True)["matmul_tflops"]
        self.slopes = C.alibi_slopes(32)
        self.al, note = self.run.step("import attnlang", C.import_attnlang)
        if self.al is None:
            C.log(f"attnlang rows will be empty: {note}")
        if any(c.startswith("flashinfer") for c in contenders):
            self.fi, note = C.import_flashinfer()
            C.log(note)
            self.run.results.set(flashinfer=note)
            self.fi_note = "FlashInfer not importable (see the log / json meta)"
        self.contender_pass(names, contenders)
        if "flex" in contenders:
            self.flex_pass(names)
        self.run.finish()
        self._tmp.cleanup()
        return 0

    # -- tables

    def ratios(self) -> None:
        for who in ATTNLANG:
            base = {r["workload"]: r.get("time_ms") for r in self.rows if r["contender"] == who}
            for r in self.rows:
                if r["contender"] not in ATTNLANG:
                    r[f"{who}_over_peer"] = C.ratio(r.get("time_ms"), base.get(r["workload"]))

    def tables(self) -> str:
        self.ratios()
        self.run.results.flush()
        rows = self.rows
        mm = f"matmul {C.fmt(self.mm_tflops, '.0f')} TFLOP/s"
        if not rows:
            return "(no results)"
        shown = [r for r in rows if not (r.get("time_ms") is None
                                         and self.fi_note and r.get("note") == self.fi_note)]
        detail = C.format_table([dict(
            workload=r["workload"], contender=r["contender"].replace("flashinfer", "fi"),
            ms=C.fmt(r.get("time_ms"), ".3f"),
            tf=C.fmt(r.get("tflops"), ".0f"),
            mm=C.fmt(100 * r["frac_matmul"], ".0f") + "%" if r.get("frac_matmul") else "-",
            paged=C.fmt(r.get("attnlang_paged_over_peer"), ".2f"),
            ragged=C.fmt(r.get("attnlang_ragged_over_peer"), ".2f"),
            err=C.err_cell(r.get("rel_err")), note=(r.get("note") or "")[:44]) for r in shown],
            [("workload", "workload"), ("contender", "contender"), ("ms", "ms"),
             ("tf", "TFLOP/s"), ("mm", "of mm"), ("paged", "paged/peer"),
             ("ragged", "ragged/peer"), ("err", "rel err"), ("note", "note")],
            title=f"Prefill, bf16 d{HEAD_DIM} ({mm}); TFLOP/s of unmasked pairs; X/peer = peer "
                  "time / attnlang X time")
        short = {"flashinfer_fa3_paged": "FA3p", "flashinfer_fa3_ragged": "FA3r",
                 "flashinfer_fa2_paged": "FA2p", "sdpa_cudnn": "cuDNN", "sdpa_flash": "flash",
                 "flex": "flex"}
        summary = []
        for name in [n for n in self.specs if any(r["workload"] == n for r in rows)]:
            def get(contender, key, name=name):
                return next((r.get(key) for r in rows if r["workload"] == name
                             and r["contender"] == contender), None)

            frac = get("attnlang_paged", "frac_matmul")
            cells = dict(workload=name, paged=C.fmt(get("attnlang_paged", "tflops"), ".0f"),
                         ragged=C.fmt(get("attnlang_ragged", "tflops"), ".0f"),
                         sync=C.fmt(get("attnlang_mma_sync", "tflops"), ".0f"),
                         mm=C.fmt(100 * frac, ".0f") + "%" if frac else "-",
                         err=C.err_cell(get("attnlang_paged", "rel_err")))
            for peer in PEERS:
                cells[peer] = C.fmt(get(peer, "attnlang_paged_over_peer"), ".2f")
            summary.append(cells)
        cols = [("workload", "workload"), ("paged", "al paged TF/s"), ("ragged", "al ragged"),
                ("sync", "al mma.sync"), ("mm", "paged/mm"), ("err", "al err")]
        cols += [(p, "x" + short[p]) for p in PEERS]
        table = C.format_table(
            summary, cols,
            title=f"SUMMARY prefill d{HEAD_DIM} ({mm}): attnlang TFLOP/s and attnlang_paged/peer "
                  "speed ratios (>1 = attnlang faster)")
        if len(shown) < len(rows):
            detail += f"\n({len(rows) - len(shown)} FlashInfer rows left out: {self.fi_note})"
        return detail + "\n\n" + table


def parse_args(argv=None):
    names = ", ".join(s.name for s in SPECS)
    p = C.base_parser(
        __doc__.split("\n\n")[0], budget=540, max_seconds=20,
        names_help=f"Workloads: {names}; contenders: {', '.join(CONTENDERS)} "
                   "(attnlang_paged and attnlang_ragged always run).")
    p.add_argument("--head-dim", type=int, choices=(64, 128, 256), default=128,
                   help="head dim of every workload (default 128)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    global HEAD_DIM
    args = parse_args(argv)
    HEAD_DIM = args.head_dim
    return Prefill(args).main()


if __name__ == "__main__":
    raise SystemExit(main())
