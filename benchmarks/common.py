"""Shared machinery of attnlang's side-by-side benchmarks (decode.py, prefill.py).

Everything a benchmark needs besides its workloads and contenders:

- timing: `bench(fn)` (CUDA events around each call after a synchronized warm-up, median of
  the reps) and `bench_graph(fn)` (the same over replays of a torch CUDA graph captured
  around fn). Both take a list of callables instead of one to rotate among input sets, and a
  `max_seconds` bound that caps the number of reps from the warm-up's measured call time, so
  one slow contender cannot eat the run's time budget (its row is then marked).
- ceilings measured in the same run: device-to-device copy bandwidth (bytes read + written)
  and the bf16 8192^3 matrix-product rate, so every figure is also a fraction of what this
  GPU, in its current state, can do.
- the FlashInfer peer: `import_flashinfer()` imports it, or unpacks the precompiled copy in
  `.peers/flashinfer/` (see shared/peers/flashinfer/README.md) into /tmp/fisite first; it
  returns None with a note when neither works, and the benchmarks skip its rows.
- robustness: a run budget, a watchdog that prints what was measured if the run hangs, a
  check for a CUDA context broken by an earlier error, short one-line error notes.
- output: aligned plain-text tables, and JSON + CSV files rewritten after every row.

L2 and rotation. The H100 has 50 MB of L2. A working set that fits in it, timed over and over,
measures the cache, not HBM. `rotation_sets(bytes)` says how many input copies a timing must
cycle through so that one cycle touches at least ROTATE_BYTES (4x L2). Decode is memory-bound
and its B1 L32768 case reads 128 MB of K/V, so it is given two copies; every other decode
case reads 268 MB to 1 GB per call and needs none. Prefill is compute-bound (each K/V tile is
re-read by every query tile of its request, from L2, by design), so rotation would not change
its figures: prefill.py times one input set.

torch is imported lazily, so `--help` works on machines without it.
"""

from __future__ import annotations

import argparse
import csv
import faulthandler
import importlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_DIR = REPO_ROOT / ".peers" / "flashinfer"
FISITE = Path("/tmp/fisite")
DEVICE = "cuda"  # where inputs live (a CPU dry run of the plumbing may change it)

L2_BYTES = 50 * 10**6  # H100 SXM: 50 MB
ROTATE_BYTES = 4 * L2_BYTES  # one rotation cycle touches at least this much
MAX_ROTATION_SETS = 8

_T0 = time.perf_counter()


# ---------------------------------------------------------------------------- small helpers


def log(msg: str) -> None:
    """A progress line with the seconds since start, flushed at once."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def short_error(exc: BaseException, limit: int = 160) -> str:
    """'TypeName: first line of the message', at most `limit` characters."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def torch_module():
    """torch, imported on first use (benchmarks must import and parse args without it)."""
    import torch

    return torch


def require_cuda():
    """Import torch and check for a CUDA device; exit with a clear message otherwise.

    Also pins float32 matmuls to full precision (the correctness references use them).
    Returns the torch module.
    """
    try:
        torch = torch_module()
    except Exception as e:
        sys.exit(f"error: these benchmarks need PyTorch with CUDA; `import torch` failed: "
                 f"{short_error(e)}")
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device visible to torch (torch.cuda.is_available() is False): "
                 "run this on the GPU machine (see /work/shared/gpu/README.md)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    warnings.filterwarnings("once")
    return torch


def raise_dynamo_limits(limit: int = 64) -> None:
    """Let torch.compile keep one FlexAttention graph per shape and variant (the default
    recompile limit of 8 would fall back to eager FlexAttention mid-run)."""
    try:
        import torch._dynamo.config as cfg

        cfg.cache_size_limit = max(limit, getattr(cfg, "cache_size_limit", 0))
        if hasattr(cfg, "accumulated_cache_size_limit"):
            cfg.accumulated_cache_size_limit = max(8 * limit, cfg.accumulated_cache_size_limit)
    except Exception as e:
        log(f"could not raise torch._dynamo's recompile limit: {short_error(e)}")


def import_attnlang():
    """attnlang from this checkout (REPO_ROOT first on sys.path)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import attnlang

    return attnlang


def forget_compiled_modules() -> None:
    """Drop attnlang's in-process memo of compiled modules (keyed by variant, head_dim,
    dtype, arch): the tuning scripts change layout constants between runs, which changes the
    rendered source (the disk cache keys on it) but not that memo's key."""
    from attnlang.runtime import module

    with module._MODULES_LOCK:
        module._MODULES.clear()


def filter_kwargs(fn: Callable, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The kwargs that fn's signature accepts, and the names it does not (its API may lag)."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return dict(kwargs), []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(kwargs), []
    kept = {k: v for k, v in kwargs.items() if k in sig.parameters}
    return kept, [k for k in kwargs if k not in kept]


def fmt(x: Any, spec: str = ".1f") -> str:
    """A table cell: '-' for None/NaN, else format(x, spec) (strings pass through)."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    try:
        if isinstance(x, float) and not math.isfinite(x):
            return "-" if math.isnan(x) else str(x)
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or not b:
        return None
    return a / b


# ---------------------------------------------------------------------------- --only filter


class Only:
    """The `--only NAME[,NAME]` filter. A token selects the names it equals or that continue
    it after an underscore (`b1` selects b1_l32768 but not b16_l4096; `b64` selects b64_l2048
    and b64_skewed; `sdpa` both SDPA backends; `flashinfer` every FlashInfer contender); a
    token that selects nothing that way selects the names it merely prefixes. Each kind of
    name (workloads, contenders) is filtered only by the tokens that select some name of that
    kind; a kind that no token selects is not filtered."""

    def __init__(self, spec: str | None):
        self.tokens = [t.strip().lower() for t in (spec or "").split(",") if t.strip()]
        self._used: set[str] = set()

    @staticmethod
    def _matches(token: str, names: list[str]) -> list[str]:
        hits = [n for n in names if n.lower() == token or n.lower().startswith(token + "_")]
        return hits or [n for n in names if n.lower().startswith(token)]

    def select(self, names: Iterable[str], *, always: Iterable[str] = ()) -> list[str]:
        names, always = list(names), set(always)
        chosen: set[str] = set()
        for t in self.tokens:
            hits = self._matches(t, names)
            if hits:
                self._used.add(t)
                chosen.update(hits)
        if not chosen:
            return names
        return [n for n in names if n in chosen or n in always]

    def unused(self) -> list[str]:
        return [t for t in self.tokens if t not in self._used]


# ---------------------------------------------------------------------------- argparse


def base_parser(description: str, *, budget: float, max_seconds: float,
                names_help: str) -> argparse.ArgumentParser:
    """The flags both benchmarks share."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="fewer reps and a smaller set of workloads (a smoke run)")
    p.add_argument("--only", default="", metavar="NAME[,NAME]",
                   help="run only these workloads/contenders (prefix match). " + names_help)
    p.add_argument("--out", default=None, metavar="PATH",
                   help="write results: a .json path (a .csv is written beside it) or a "
                        "directory such as $OUT; rewritten after every row")
    p.add_argument("--no-peers", action="store_true",
                   help="attnlang only (no FlashInfer, SDPA or FlexAttention)")
    p.add_argument("--budget", type=float, default=budget, metavar="S",
                   help=f"hard wall-clock budget of the whole run in seconds (default {budget:g}):"
                        " steps that no longer fit are skipped and marked, the tables still print")
    p.add_argument("--max-seconds", type=float, default=max_seconds, metavar="S",
                   help=f"time budget of one contender's timing (warm-up + reps, default "
                        f"{max_seconds:g}); fewer reps are run and the row is marked when exceeded")
    p.add_argument("--reps", type=int, default=None,
                   help="timed reps (default 30; 10 with --quick)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up calls before timing (default 5; 2 with --quick)")
    p.add_argument("--verbose", action="store_true", help="print full tracebacks of failures")
    return p


def reps_and_warmup(args: argparse.Namespace) -> tuple[int, int]:
    reps = args.reps if args.reps is not None else (10 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    return max(1, reps), max(1, warmup)


# ---------------------------------------------------------------------------- budget / safety


class Budget:
    """The run's wall-clock budget."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, need: float) -> bool:
        return self.left() >= need


class Watchdog:
    """If the run is still going `seconds` from now (a hang), print what was measured
    (`on_timeout`, from a helper thread) and exit with status 3. A hang inside C code that
    holds the GIL blocks that thread; faulthandler then dumps every thread's stack and exits
    20 s later."""

    def __init__(self, seconds: float, on_timeout: Callable[[], None]):
        self._done = threading.Event()
        self._on_timeout = on_timeout
        self._seconds = seconds
        faulthandler.dump_traceback_later(seconds + 20, exit=True)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        if self._done.wait(self._seconds):
            return
        print(f"\nWATCHDOG: the run passed its budget + grace ({self._seconds:.0f} s) and seems "
              "stuck; printing what was measured and exiting", flush=True)
        try:
            self._on_timeout()
        except Exception as e:
            print(f"(could not print the tables: {short_error(e)})", flush=True)
        sys.stdout.flush()
        os._exit(3)

    def cancel(self) -> None:
        self._done.set()
        faulthandler.cancel_dump_traceback_later()


def cuda_healthy(torch) -> bool:
    """False when the CUDA context is broken (a sticky error such as an illegal address):
    every later GPU call would fail too."""
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def after_failure(torch) -> bool:
    """Clean up after a failed contender; returns whether the GPU is still usable."""
    ok = cuda_healthy(torch)
    if ok:
        try:
            torch.cuda.empty_cache()
        except Exception:
            pass
    return ok


# ---------------------------------------------------------------------------- timing


class Timing(float):
    """A median time in seconds (a float) that also carries how it was taken.

    samples: the per-rep seconds; requested: the reps asked for; note: why fewer were run.
    """

    samples: list[float]
    requested: int
    note: str

    def __new__(cls, median: float, samples: Sequence[float], requested: int, note: str = ""):
        obj = float.__new__(cls, median)
        obj.samples = list(samples)
        obj.requested = int(requested)
        obj.note = note
        return obj

    @property
    def reps(self) -> int:
        return len(self.samples)

    @property
    def truncated(self) -> bool:
        return self.reps < self.requested

    @property
    def spread(self) -> float:
        """(p90 - p10) / median of the samples (0 for fewer than 3)."""
        if len(self.samples) < 3 or not float(self):
            return 0.0
        s = sorted(self.samples)
        lo, hi = s[int(0.1 * (len(s) - 1))], s[int(math.ceil(0.9 * (len(s) - 1)))]
        return (hi - lo) / float(self)


def _as_list(fn: Callable | Sequence[Callable]) -> list[Callable]:
    return list(fn) if isinstance(fn, (list, tuple)) else [fn]


# bench(queue_ahead=True): the GPU sleeps this long per timed rep before the first, while the
# host queues them all (a graph replay's host cost is ~10-30 us per rep with its events).
QUEUE_AHEAD_SECONDS_PER_REP = 100e-6
SLEEP_CYCLES_PER_SECOND = 2.0e9  # torch.cuda._sleep counts clock cycles (H100: ~1.98 GHz)


def bench(fn: Callable | Sequence[Callable], *, warmup: int = 5, reps: int = 30,
          max_seconds: float | None = None, queue_ahead: bool = False) -> Timing:
    """Median seconds of one call of fn, timed with CUDA events on the current stream.

    fn: a zero-argument callable issuing GPU work on torch's current stream, or a list of
    them (one per input set) called in turn, so that consecutive calls touch different
    memory (L2 rotation). Warm-up calls are synchronized and host-timed; their last time
    bounds the reps to `max_seconds` (warm-up included). Each timed rep is bracketed by its
    own pair of events without synchronizing in between, so back-to-back GPU work is timed
    as the GPU runs it, and a call whose host-side cost exceeds its GPU time shows that
    cost (which is what a plain call costs). Calls slower than 2 ms are synchronized one by
    one so the wall-clock bound holds.

    queue_ahead: the timed reps are queued behind a GPU sleep long enough to hold them all,
    so the GPU runs them back to back whatever the host loop costs: the figure is the GPU's
    time (bench_graph: a replay's Python and event calls would otherwise bound graphs
    shorter than them; benchmarks/NOTES.md, "The read floor, measured again").
    """
    torch = torch_module()
    fns = _as_list(fn)
    t_start = time.perf_counter()
    est = 0.0
    for i in range(max(1, warmup)):
        t = time.perf_counter()
        fns[i % len(fns)]()
        torch.cuda.synchronize()
        est = time.perf_counter() - t
        if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
            break
    want = reps
    if max_seconds is not None:
        left = max_seconds - (time.perf_counter() - t_start)
        want = min(reps, int(left / est) if est > 0 else reps)
        if want < 1:
            return Timing(est, [est], reps, note=f"budget: 1 host-timed call ({max_seconds:g} s)")
    sync_each = est > 2e-3
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(want)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(want)]
    sleep = getattr(torch.cuda, "_sleep", None)  # private; absent, the reps are not queued
    if queue_ahead and not sync_each and sleep is not None:
        sleep(int(want * QUEUE_AHEAD_SECONDS_PER_REP * SLEEP_CYCLES_PER_SECOND))
    done = 0
    for i in range(want):
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
        done += 1
        if sync_each:
            ends[i].synchronize()
            if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
                break
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) * 1e-3 for s, e in zip(starts[:done], ends[:done], strict=True)]
    note = f"budget: {done}/{reps} reps ({max_seconds:g} s)" if done < reps else ""
    return Timing(statistics.median(samples), samples, reps, note=note)


def capture_graph(fn: Callable, *, warmup_calls: int = 2, mode: str = "global"):
    """A torch.cuda.CUDAGraph captured around one call of fn (after warm-up calls on a side
    stream, as torch's docs ask). fn must issue its work on torch's current stream and use
    fixed buffers (its output too). mode: torch's capture_error_mode."""
    torch = torch_module()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        fn()
    torch.cuda.synchronize()
    return graph


def bench_graph(fn: Callable | Sequence[Callable], *, warmup: int = 5, reps: int = 30,
                max_seconds: float | None = None) -> Timing:
    """Like bench(), over replays of CUDA graphs: one graph captured per callable (per input
    set), replayed in turn, queued ahead (bench's queue_ahead: the GPU's time, not the host
    loop's). Raises if capture fails (the caller reports plain calls only)."""
    note = ""
    try:
        graphs = [capture_graph(f) for f in _as_list(fn)]
    except Exception as e:
        # "global" forbids CUDA calls such as cudaMalloc from any thread during capture;
        # "relaxed" allows them. Say which one worked: the difference matters to the caller.
        note = f"captured in relaxed mode (global: {short_error(e, 60)})"
        torch_module().cuda.synchronize()
        graphs = [capture_graph(f, mode="relaxed") for f in _as_list(fn)]
    timing = bench([g.replay for g in graphs], warmup=warmup, reps=reps, max_seconds=max_seconds,
                   queue_ahead=True)
    timing.note = "; ".join(n for n in (note, timing.note) if n)
    timing.graphs = graphs  # keep them (and their memory pools) alive with the result
    return timing


def host_time(fn: Callable, *, reps: int = 30, warmup: int = 3) -> Timing:
    """Median host wall-clock seconds of fn() followed by a device synchronize (for plan())."""
    torch = torch_module()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    return Timing(statistics.median(samples), samples, reps)


def rotation_sets(working_set_bytes: int) -> int:
    """How many input copies to cycle so that one cycle touches >= ROTATE_BYTES."""
    if working_set_bytes <= 0:
        return 1
    return max(1, min(MAX_ROTATION_SETS, math.ceil(ROTATE_BYTES / working_set_bytes)))


# ---------------------------------------------------------------------------- ceilings


def copy_bandwidth(*, nbytes: int = 1 << 30, reps: int = 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (H100 SXM:
    ~2994 GB/s measured on the test machine). Random data, 1 GiB each way."""
    torch = torch_module()
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), warmup=3, reps=reps)
    return 2 * nbytes / float(t)


# The read floor's kernel: block b reads the 64 KB [b * 64 KB, (b + 1) * 64 KB), each thread
# 16 loads of 16 bytes issued before the first is used (volatile asm, and launch bounds that
# ask for as little as one block per SM and so lift ptxas's register budget, keep them
# together; the xor and the store keep ptxas from dropping them). One-shot blocks let the
# hardware hand more of them to the SMs that drain faster, as a streaming read should. On the
# H100 it reads 67 MB in 24-25 us (90-93% of the copy bandwidth) where torch's float32 sum took
# 31-34 us, and 537 MB at 103% (benchmarks/NOTES.md, "The read floor, measured again").
_READ_THREADS, _READ_LOADS = 256, 16
_READ_BLOCK_BYTES = _READ_THREADS * _READ_LOADS * 16
_READ_SOURCE = r"""
// THREADS and LOADS: _READ_THREADS and _READ_LOADS, given as macros.
extern "C" __global__ void __launch_bounds__(THREADS, 1) read_bytes(const uint4* __restrict__ src,
                                                                    unsigned* sink) {
  const long long first = (long long)blockIdx.x * THREADS * LOADS + threadIdx.x;
  uint4 v[LOADS];
#pragma unroll
  for (int u = 0; u < LOADS; ++u)
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                 : "l"(src + first + u * THREADS));
  unsigned acc = 0;
#pragma unroll
  for (int u = 0; u < LOADS; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; nobody reads the sink
}
"""


def _cupy_stream(torch):
    """torch's current stream as a CuPy stream."""
    from attnlang.runtime.arrays import external_stream

    return external_stream(torch.cuda.current_stream().cuda_stream, torch.cuda.current_device())


def read_floor(nbytes: int, *, nsets: int = 1, warmup: int = 5, reps: int = 30,
               max_seconds: float | None = None) -> float:
    """Median seconds a graph-replayed kernel that only reads nbytes takes (`_READ_SOURCE`:
    every byte read once, 64 KB per one-shot block, nbytes rounded up to whole blocks), nsets
    buffers replayed in turn as bench_graph rotates input sets. What a kernel that only
    streams a memory-bound row's bytes reaches, its launch included: the floor for that row."""
    import cupy

    torch = torch_module()
    kernel = cupy.RawKernel(_READ_SOURCE, "read_bytes",
                            options=(f"-DTHREADS={_READ_THREADS}", f"-DLOADS={_READ_LOADS}"))
    blocks = max(1, math.ceil(nbytes / _READ_BLOCK_BYTES))
    bufs = [torch.randint(0, 256, (blocks * _READ_BLOCK_BYTES,), dtype=torch.uint8, device=DEVICE)
            for _ in range(nsets)]
    sink = cupy.zeros(1, dtype=cupy.uint32)

    def reader(buf):
        src = cupy.asarray(buf)
        return lambda: kernel((blocks,), (_READ_THREADS,), (src, sink), stream=_cupy_stream(torch))

    return float(bench_graph([reader(b) for b in bufs], warmup=warmup, reps=reps,
                             max_seconds=max_seconds))


def matmul_flops(*, n: int = 8192, reps: int = 30) -> float:
    """bf16 n^3 matrix-product rate in FLOP/s (2 n^3 per product; ~759 TFLOP/s measured on
    the H100 test machine). Random inputs (zeros run faster than real data)."""
    torch = torch_module()
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=DEVICE)
    t = bench(lambda: torch.mm(a, b, out=c), warmup=3, reps=reps)
    return 2 * n**3 / float(t)


# ---------------------------------------------------------------------------- correctness


def rel_l2(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has a NaN/inf (unwritten or broken)."""
    torch = torch_module()
    o = out.detach().to(torch.float64)
    r = ref.detach().to(o.device, torch.float64)
    if not bool(torch.isfinite(o).all()):
        return math.inf
    den = float(torch.linalg.vector_norm(r))
    return float(torch.linalg.vector_norm(o - r)) / (den if den else 1.0)


REL_ERR_LIMIT = 1e-2  # LANGUAGE.md section 7, bf16


def err_cell(err: float | None) -> str:
    """The error as a table cell; '!' marks one over REL_ERR_LIMIT (a flagged row)."""
    if err is None:
        return "-"
    if not math.isfinite(err):
        return "NaN!"
    return f"{err:.1e}" + ("!" if err >= REL_ERR_LIMIT else "")


def reference_rows(q_rows, q_pos, k, v, *, causal: bool = True, window: int | None = None,
                   cap: float | None = None, slopes=None, sm_scale: float | None = None):
    """float32 attention of some query rows of one request (LANGUAGE.md section 6), with the
    few variants the benchmarks run: causal mask, causal window (q_pos - kv_pos < window),
    logit soft-cap (cap * tanh(logits / cap)) and ALiBi (logits - slopes[head] * (q_pos -
    kv_pos)), all on logits already scaled by sm_scale (default 1/sqrt(head_dim)).

    q_rows [n, Hq, D] (the bf16 inputs, upcast here); q_pos [n] positions of those rows in
    the request's KV sequence; k, v [L, Hkv, D]; slopes [Hq] or None. Query head h reads KV
    head h // (Hq / Hkv). Returns [n, Hq, D] float32.
    """
    torch = torch_module()
    n, hq, d = q_rows.shape
    kv_len, hkv, _ = k.shape
    g = hq // hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    dev = q_rows.device
    qf = q_rows.float().reshape(n, hkv, g, d)
    s = torch.einsum("nkgd,lkd->kgnl", qf, k.float()) * scale  # [Hkv, g, n, L]
    rel = (torch.as_tensor(q_pos, device=dev).view(n, 1).long()
           - torch.arange(kv_len, device=dev).view(1, kv_len))  # q_pos - kv_pos, [n, L]
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if slopes is not None:
        s = s - slopes.to(dev).float().view(hkv, g, 1, 1) * rel.float()
    keep = torch.ones_like(rel, dtype=torch.bool)
    if causal:
        keep &= rel >= 0
    if window is not None:
        keep &= rel < window
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("kgnl,lkd->nkgd", p, v.float())
    return o.reshape(n, hq, d)


def alibi_slopes(num_heads: int):
    """ALiBi's geometric slopes 2^(-8 (h + 1) / H) (Press et al. 2022), float32 on the GPU."""
    torch = torch_module()
    h = torch.arange(1, num_heads + 1, dtype=torch.float64)
    return torch.pow(2.0, -8.0 * h / num_heads).to(torch.float32).to(DEVICE)


def make_batch_attention(al, variant, **kwargs):
    """al.BatchAttention(variant, **kwargs), passing only the keyword arguments its
    constructor accepts (capacities such as max_kv_indices may not exist in every version)."""
    kept, dropped = filter_kwargs(al.BatchAttention, kwargs)
    if dropped:
        log(f"attnlang.BatchAttention does not take {', '.join(dropped)}; left out")
    return al.BatchAttention(variant, **kept)


# ---------------------------------------------------------------------------- FlashInfer


def import_flashinfer(peer_dir: Path = PEER_DIR, site: Path = FISITE) -> tuple[Any, str]:
    """(flashinfer module or None, a one-line note).

    `import flashinfer`; if that fails, unpack the precompiled peer exactly as
    shared/peers/flashinfer/README.md says (pip install --target the tvm-ffi wheel, extract
    the tar.xz into the same folder) and put the folder first on sys.path. An unpacked
    /tmp/fisite from an earlier run on the same machine is reused.
    """
    try:
        import flashinfer

        return flashinfer, f"flashinfer {getattr(flashinfer, '__version__', '?')} (importable)"
    except Exception as e:
        first = short_error(e, 100)
    wheels = sorted(peer_dir.glob("apache_tvm_ffi-*.whl"))
    tars = sorted(peer_dir.glob("flashinfer-*.tar.xz"))
    if not wheels or not tars:
        return None, (f"FlashInfer skipped: `import flashinfer` failed ({first}) and "
                      f"{peer_dir} lacks the peer package (run `bash ../shared/gpu/prepare.sh` "
                      "here and carry .peers/)")
    note = ""
    # A /tmp/fisite left by an earlier run is tried first; if it does not import (a partial
    # extraction, say), it is unpacked afresh once.
    unpacked = False
    for fresh in (False, True):
        if fresh and unpacked:
            break  # just unpacked: a second unpack would fail the same way
        try:
            ready = ((site / "flashinfer" / "__init__.py").is_file()
                     and (site / "tvm_ffi").is_dir())
            if fresh or not ready:
                error = _unpack_flashinfer(wheels[-1], tars[-1], site)
                unpacked = True
                if error:
                    return None, f"FlashInfer skipped: {error}"
            if str(site) not in sys.path:
                sys.path.insert(0, str(site))
            importlib.invalidate_caches()
            for name in [m for m in sys.modules if m.split(".")[0] in ("flashinfer", "tvm_ffi")]:
                del sys.modules[name]
            import flashinfer

            return flashinfer, (f"flashinfer {getattr(flashinfer, '__version__', '?')} "
                                f"from {tars[-1].name}, unpacked in {site}")
        except Exception as e:
            note = short_error(e)
            if not fresh:
                log(f"FlashInfer from {site} did not import ({note}); unpacking afresh")
    return None, f"FlashInfer skipped: importing the unpacked peer failed: {note}"


def _unpack_flashinfer(wheel: Path, tar: Path, site: Path) -> str:
    """Unpack the peer as its README says; '' on success, else why not."""
    log(f"unpacking the FlashInfer peer into {site} ...")
    shutil.rmtree(site, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--no-compile", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout or "").strip().splitlines()
        return f"pip install of {wheel.name} failed: {err[-1] if err else proc.returncode}"
    with tarfile.open(tar) as tf:
        try:
            tf.extractall(site, filter="data")
        except TypeError:  # Python without tarfile extraction filters
            tf.extractall(site)
    return ""


# ---------------------------------------------------------------------------- environment


def environment(torch) -> dict[str, Any]:
    """What ran: GPU, versions, git revision (best effort)."""
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": getattr(torch.version, "cuda", None),
                           "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1))
    except Exception as e:
        env["gpu"] = f"? ({short_error(e)})"
    for mod in ("cupy", "triton"):
        try:
            env[mod] = importlib.import_module(mod).__version__
        except Exception:
            env[mod] = None
    try:
        rev = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10)
        if rev.returncode == 0:
            env["git"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:
        env["git"] = None
    return env


# ---------------------------------------------------------------------------- tables


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]],
                 title: str | None = None) -> str:
    """Plain aligned text. columns: (key, header); cells are str(row[key]) ('-' if missing);
    a column whose cells all look numeric is right-aligned."""
    cells = [[("-" if r.get(k) is None else str(r.get(k))) for k, _ in columns] for r in rows]
    heads = [h for _, h in columns]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]

    def numeric(s: str) -> bool:
        t = s.rstrip("%x").lstrip("<>~")
        try:
            float(t)
            return True
        except ValueError:
            return s == "-"

    right = [all(numeric(c[i]) for c in cells) and bool(cells) for i in range(len(heads))]

    def line(vals: Sequence[str]) -> str:
        out = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(vals, widths, right, strict=True)]
        return "  ".join(out).rstrip()

    text = [title] if title else []
    text += [line(heads), line(["-" * w for w in widths])]
    text += [line(c) for c in cells]
    return "\n".join(text)


# ---------------------------------------------------------------------------- results


def write_rows(out: str | None, name: str, rows: Any) -> None:
    """A benchmark's rows as JSON at --out: a folder (then NAME.json in it) or a .json path;
    nothing without --out."""
    if not out:
        return
    path = Path(out)
    if path.suffix != ".json":
        path = path / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1, default=float))


def _json_default(x: Any) -> Any:
    if isinstance(x, Timing):
        return {"median_s": float(x), "reps": x.reps, "requested": x.requested,
                "spread": x.spread, "note": x.note}
    if isinstance(x, Path):
        return str(x)
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    return str(x)


class Results:
    """Rows of one benchmark run plus run-level facts; rewritten to JSON and CSV after every
    change, so a run cut short still leaves its numbers under --out."""

    def __init__(self, name: str, out: str | None, meta: dict[str, Any] | None = None):
        self.name = name
        self.meta: dict[str, Any] = dict(meta or {})
        self.rows: list[dict[str, Any]] = []
        self.paths = self._paths(out)

    def _paths(self, out: str | None) -> tuple[Path, Path] | None:
        if not out:
            return None
        p = Path(out)
        if p.suffix.lower() == ".json":
            return p, p.with_suffix(".csv")
        return p / f"{self.name}.json", p / f"{self.name}.csv"

    def add(self, **row: Any) -> dict[str, Any]:
        self.rows.append(row)
        self.flush()
        return row

    def set(self, **facts: Any) -> None:
        self.meta.update(facts)
        self.flush()

    def flush(self) -> None:
        if self.paths is None:
            return
        json_path, csv_path = self.paths
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = json_path.with_name(json_path.name + ".tmp")
            tmp.write_text(json.dumps({"benchmark": self.name, "meta": self.meta,
                                       "rows": self.rows}, indent=1, default=_json_default))
            tmp.replace(json_path)
            keys: list[str] = []
            for r in self.rows:
                keys += [k for k in r if k not in keys]
            tmp = csv_path.with_name(csv_path.name + ".tmp")
            with tmp.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
                w.writeheader()
                for r in self.rows:
                    w.writerow({k: (float(v) if isinstance(v, Timing) else v)
                                for k, v in r.items()})
            tmp.replace(csv_path)
        except Exception as e:
            log(f"could not write results to {json_path}: {short_error(e)}")
            self.paths = None


# ---------------------------------------------------------------------------- the run


class Runner:
    """One benchmark run: args, budget, results, the watchdog, and `step()`, which runs one
    piece of work (a contender's setup, check or timing) so that a failure costs one line.

    `tables` is a callable returning the final text; it is printed last by `finish()`, or by
    the watchdog if the run hangs.
    """

    def __init__(self, name: str, args: argparse.Namespace, torch, *,
                 tables: Callable[[], str]):
        self.name = name
        self.args = args
        self.torch = torch
        self.reps, self.warmup = reps_and_warmup(args)
        self.budget = Budget(args.budget)
        self.results = Results(name, args.out, {"args": vars(args)})
        self.healthy = True
        self.tables = tables
        self.watchdog = Watchdog(args.budget + 30, self.print_tables)

    def step(self, label: str, fn: Callable[[], Any], *, need: float = 5.0) -> tuple[Any, str]:
        """(fn(), "") or (None, note): skipped when the run budget has less than `need`
        seconds left or the CUDA context is broken; a failure is logged in one line."""
        if not self.healthy:
            return None, "skipped: CUDA context broken by an earlier error"
        if not self.budget.allows(need):
            return None, f"skipped: run budget ({self.budget.seconds:g} s) spent"
        try:
            return fn(), ""
        except Exception as e:
            note = short_error(e)
            log(f"{label}: FAILED {note}")
            if self.args.verbose:
                import traceback

                traceback.print_exc()
            if not after_failure(self.torch):
                self.healthy = False
                log("the CUDA context is broken (a sticky error): every later GPU step is "
                    "skipped; rerun with --only to isolate the failing contender")
            return None, note

    def time_plain(self, fns: Callable | Sequence[Callable]) -> Timing:
        return bench(fns, warmup=self.warmup, reps=self.reps, max_seconds=self.args.max_seconds)

    def time_graph(self, fns: Callable | Sequence[Callable]) -> Timing:
        return bench_graph(fns, warmup=self.warmup, reps=self.reps,
                           max_seconds=self.args.max_seconds)

    def ceilings(self, *, matmul: bool) -> dict[str, float | None]:
        """Copy bandwidth (and the bf16 matmul rate) measured now, logged and recorded."""
        out: dict[str, float | None] = {"copy_gbps": None, "matmul_tflops": None}
        bw, note = self.step("copy bandwidth", lambda: copy_bandwidth(), need=5)
        if bw:
            out["copy_gbps"] = bw / 1e9
            log(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write; H100 ref 2994)")
        if matmul:
            fl, note = self.step("matmul ceiling", lambda: matmul_flops(), need=5)
            if fl:
                out["matmul_tflops"] = fl / 1e12
                log(f"bf16 8192^3 matmul: {fl / 1e12:.0f} TFLOP/s (H100 ref 759)")
        self.results.set(**out)
        return out

    def print_tables(self) -> None:
        print("\n" + self.tables(), flush=True)
        if self.results.paths:
            print(f"results: {self.results.paths[0]} and {self.results.paths[1]}", flush=True)

    def finish(self) -> None:
        self.watchdog.cancel()
        self.results.set(elapsed_s=round(self.budget.elapsed(), 1))
        self.print_tables()
