"""Host cost of attnlang's run() and plan() in a model's decode loop, beside FlashInfer.

The loop is one decode step of a 32-layer model as every real model runs it: one plan() for
the step, then one run() per layer, each layer with its own q and its own K/V cache (B16, 1024
tokens of context, 32 query / 8 KV heads, head_dim 128, bf16, page 16). Reported:

- run() host time: CPU time spent inside each run() call (perf_counter around the call, no
  synchronize inside the step), median over all calls of all timed steps. For attnlang with
  torch tensors (the users' case), with CuPy arrays, and with a preallocated out=, on its C
  path (runtime/hostpath.c) and, for comparison, its Python path (ATTNLANG_HOST_PATH=python);
  the same with an fp8 cache (e4m3, per-head scales as device tensors: tensor params), on
  both paths; for FlashInfer's BatchDecodeWithPagedKVCacheWrapper.run (out= preallocated, as
  its users do).
- step wall time: plan + 32 runs + a synchronize, median over steps.
- kernel time: the 32 runs captured in one CUDA graph and replayed (CUDA events), per layer.
- plan() host time for 1, 2, 4, ..., 256 requests of 1024 tokens, each with its copy to the
  device and a synchronize, as a plan must be before it is used.

    python3 benchmarks/host.py [--quick] [--steps N] [--out DIR] [--no-peers]

Prints a short table last and writes host.json to --out (default $OUT, else no file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

LAYERS, BATCH, CONTEXT, HQ, HKV, HEAD_DIM, PAGE = 32, 16, 1024, 32, 8, 128, 16


def decode_layout(np, batch: int, context: int = CONTEXT):
    pages = context // PAGE
    return (np.arange(batch + 1, dtype=np.int32), np.arange(batch + 1, dtype=np.int32) * pages,
            np.arange(batch * pages, dtype=np.int32), np.full(batch, PAGE, dtype=np.int32))


def on_python_path(make):
    """make() while ATTNLANG_HOST_PATH=python (a BatchAttention reads it when it is made)."""
    chosen = os.environ.get("ATTNLANG_HOST_PATH")
    os.environ["ATTNLANG_HOST_PATH"] = "python"
    try:
        return make()
    finally:
        if chosen is None:
            del os.environ["ATTNLANG_HOST_PATH"]
        else:
            os.environ["ATTNLANG_HOST_PATH"] = chosen


def time_steps(plan, runs, steps: int, sync) -> tuple[float, float]:
    """(median host us per run() call, median step wall ms) over `steps` steps."""
    per_call, walls = [], []
    for step in range(steps + 3):  # 3 warm-up steps
        t0 = time.perf_counter()
        plan()
        calls = []
        for run in runs:
            t = time.perf_counter()
            run()
            calls.append(time.perf_counter() - t)
        sync()
        if step >= 3:
            walls.append(time.perf_counter() - t0)
            per_call += calls
    return statistics.median(per_call) * 1e6, statistics.median(walls) * 1e3


def kernel_us(torch, runs) -> float:
    """Per-layer GPU time: the step's runs in one CUDA graph, replayed (median of 30)."""
    graph = C.capture_graph(lambda: [run() for run in runs])
    timing = C.bench(graph.replay, warmup=5, reps=30)
    return float(timing) * 1e6 / len(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="10 steps, plan sizes 1/16/256")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--no-peers", action="store_true", help="attnlang only")
    args = parser.parse_args()
    steps = 10 if args.quick else args.steps

    torch = C.torch_module()
    C.require_cuda()
    import cupy
    import numpy as np

    al = C.import_attnlang()
    fi, fi_note = (None, "not asked for") if args.no_peers else C.import_flashinfer()
    C.log(f"FlashInfer: {fi_note}")
    dev = dict(device="cuda", dtype=torch.bfloat16)
    layout = decode_layout(np, BATCH)
    num_pages = BATCH * CONTEXT // PAGE
    caches = [(torch.randn(num_pages, PAGE, HKV, HEAD_DIM, **dev),
               torch.randn(num_pages, PAGE, HKV, HEAD_DIM, **dev)) for _ in range(LAYERS)]
    qs = [torch.randn(BATCH, HQ, HEAD_DIM, **dev) for _ in range(LAYERS)]
    outs = [torch.empty_like(q) for q in qs]
    rows, results = [], {"environment": C.environment(torch), "flashinfer": fi_note}

    from attnlang.runtime import hostpath

    causal = al.load(str(C.REPO_ROOT / "examples" / "causal.attn"))
    attn = al.BatchAttention(causal, HQ, HKV, HEAD_DIM, "bfloat16", PAGE)
    attn_py = on_python_path(lambda: al.BatchAttention(causal, HQ, HKV, HEAD_DIM, "bfloat16",
                                                       PAGE))
    # An fp8 cache: the same values in e4m3 over one scale per KV head (device tensors).
    fp8 = al.BatchAttention(causal, HQ, HKV, HEAD_DIM, "bfloat16", PAGE, kv_dtype="fp8")
    fp8_py = on_python_path(lambda: al.BatchAttention(causal, HQ, HKV, HEAD_DIM, "bfloat16",
                                                      PAGE, kv_dtype="fp8"))
    scale = torch.full((HKV,), 4.0 / 448.0, device="cuda")
    fp8_caches = [tuple((x / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
                        for x in kv) for kv in caches]
    c_path = attn._hostpath is not None
    C.log(f"run()'s C path: {'built' if c_path else hostpath.unavailable_reason()}")
    results["c_path"] = c_path

    def al_plan():
        attn.plan(*layout)

    def py_plan():
        attn_py.plan(*layout)

    def fp8_plan():
        fp8.plan(*layout)

    def fp8_py_plan():
        fp8_py.plan(*layout)

    # Correctness first: every layer, twice (the second time through the C path when it is
    # built), equal to the Python path's calls, which validate each signature in full.
    al_plan()
    py_plan()
    fp8_plan()
    fp8_py_plan()
    for _ in range(2):
        for i in range(LAYERS):
            assert torch.equal(attn.run(qs[i], caches[i]), attn_py.run(qs[i], caches[i])), (
                f"layer {i}: run() differs from its Python path")
            assert torch.equal(
                fp8.run(qs[i], fp8_caches[i], k_scale=scale, v_scale=scale),
                fp8_py.run(qs[i], fp8_caches[i], k_scale=scale, v_scale=scale)), (
                f"layer {i}: run() with an fp8 cache differs from its Python path")

    def as_cupy(t):  # bf16 bits as uint16 (CuPy without ml_dtypes)
        return cupy.asarray(t.view(torch.int16)).view(cupy.uint16)

    cq = [as_cupy(q) for q in qs]
    cc = [(as_cupy(k), as_cupy(v)) for k, v in caches]
    contenders = {
        "attnlang (torch)": [lambda i=i: attn.run(qs[i], caches[i]) for i in range(LAYERS)],
        "attnlang (torch, out=)": [lambda i=i: attn.run(qs[i], caches[i], out=outs[i])
                                   for i in range(LAYERS)],
        "attnlang (CuPy)": [lambda i=i: attn.run(cq[i], cc[i]) for i in range(LAYERS)],
        "attnlang Python path (torch, out=)": [
            lambda i=i: attn_py.run(qs[i], caches[i], out=outs[i]) for i in range(LAYERS)],
        "attnlang fp8 cache (torch, out=)": [
            lambda i=i: fp8.run(qs[i], fp8_caches[i], out=outs[i], k_scale=scale,
                                v_scale=scale) for i in range(LAYERS)],
        "attnlang fp8 cache, Python path (torch, out=)": [
            lambda i=i: fp8_py.run(qs[i], fp8_caches[i], out=outs[i], k_scale=scale,
                                   v_scale=scale) for i in range(LAYERS)],
    }
    plans = {name: (fp8_py_plan if "Python path" in name else fp8_plan) if "fp8" in name
             else (py_plan if "Python path" in name else al_plan) for name in contenders}
    if fi is not None:
        ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        fi_layout = [torch.from_numpy(a) for a in layout[1:]]

        def fi_plan():
            wrapper.plan(*fi_layout, HQ, HKV, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
                         kv_data_type=torch.bfloat16)

        fi_plan()
        contenders["FlashInfer 0.7.2 (out=)"] = [
            lambda i=i: wrapper.run(qs[i], caches[i], out=outs[i]) for i in range(LAYERS)]
        plans["FlashInfer 0.7.2 (out=)"] = fi_plan

    for name, runs in contenders.items():
        host_us, wall_ms = time_steps(plans[name], runs, steps, torch.cuda.synchronize)
        graph_runs = runs if "out=" in name else None
        kern = kernel_us(torch, graph_runs) if graph_runs else None
        rows.append(dict(contender=name, run_us=C.fmt(host_us), step_ms=C.fmt(wall_ms, ".2f"),
                         kernel_us=C.fmt(kern)))
        results[name] = dict(run_host_us=host_us, step_wall_ms=wall_ms, kernel_us=kern)
        C.log(f"{name}: run() {host_us:.1f} us, step {wall_ms:.2f} ms, kernel {kern}")

    plan_rows = []
    sizes = [1, 16, 256] if args.quick else [1 << i for i in range(9)]
    for batch in sizes:
        lay = decode_layout(np, batch)
        row = {"requests": batch}
        big = al.BatchAttention(attn.module, HQ, HKV, HEAD_DIM, "bfloat16", PAGE,
                                max_batch_size=max(256, batch))
        row["attnlang_us"] = float(C.host_time(lambda b=big, lay=lay: b.plan(*lay))) * 1e6
        if fi is not None:
            fl = [torch.from_numpy(a) for a in lay[1:]]
            row["flashinfer_us"] = float(C.host_time(lambda fl=fl: wrapper.plan(
                *fl, HQ, HKV, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16))) * 1e6
        plan_rows.append(row)
    results["plan"] = plan_rows

    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "host.json").write_text(json.dumps(results, indent=1, default=str))
    print(C.format_table([{k: C.fmt(v) if isinstance(v, float) else v for k, v in r.items()}
                          for r in plan_rows],
                         [("requests", "requests"), ("attnlang_us", "attnlang plan() us"),
                          ("flashinfer_us", "FlashInfer plan() us")],
                         title="\nplan() + copy + synchronize, decode requests of 1024 tokens"))
    print(C.format_table(rows, [("contender", "contender"), ("run_us", "run() host us"),
                                ("step_ms", "step wall ms"), ("kernel_us", "kernel us/layer")],
                         title=f"\n{LAYERS}-layer decode step, B{BATCH} L{CONTEXT}, {HQ}/{HKV} "
                               f"heads, d{HEAD_DIM} bf16, page {PAGE}, own cache per layer"))


if __name__ == "__main__":
    main()
