"""CPU cost of BatchAttention.plan(), stage by stage, without a GPU.

plan() is validate_plan_inputs + plan_mixed + fill_workspace + one host-to-device copy. This
script times the three host stages exactly as plan() calls them (same tilings from
launch_config, same bounds, a NumPy host image of the workspace in place of the pinned
buffer), on decode.py's workloads (32/8 heads, d128, page 16, bf16, pages shuffled), with
the mask None and with examples/causal.attn's mask, and prints the median microseconds of
each stage and of the whole.

Run from the repository root (no cupy needed)::

    python benchmarks/plan_cpu.py            # all workloads, 2000 reps each
    python benchmarks/plan_cpu.py --reps 500 --workload B128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attnlang  # noqa: E402
from attnlang.codegen.config import launch_config  # noqa: E402
from attnlang.runtime.attention import (  # noqa: E402
    fill_workspace,
    validate_plan_inputs,
    workspace_layout,
)
from attnlang.runtime.plan_mixed import Tiling, plan_mixed, worst_case_mixed_bounds  # noqa: E402
from attnlang.runtime.planner import PlanBounds  # noqa: E402

HQ, HKV, HEAD_DIM, PAGE, DTYPE = 32, 8, 128, 16, "bfloat16"
NUM_SMS = 132  # H100 SXM
DECODE_CTAS, PREFILL_CTAS = 4 * NUM_SMS, NUM_SMS  # BatchAttention's defaults on the H100
ROOT = Path(__file__).resolve().parent.parent


def workload_lengths(name: str) -> np.ndarray:
    if name == "skewed":  # decode.py's skewed batch of 64
        x = np.random.default_rng(0).lognormal(np.log(1024), 1.0, 64)
        return np.clip(np.round(x), 64, 32768).astype(np.int64)
    batch = int(name[1:])
    return np.full(batch, 2048, dtype=np.int64)


def batch_inputs(lens: np.ndarray, seed: int = 0):
    """decode.py's paged layout: one query per request, pages in shuffled order (int32)."""
    pages = -(-lens // PAGE)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_indices = np.random.default_rng(seed).permutation(int(kv_indptr[-1])).astype(np.int32)
    last = (lens - (pages - 1) * PAGE).astype(np.int32)
    qo_indptr = np.arange(lens.shape[0] + 1, dtype=np.int32)
    return qo_indptr, kv_indptr, kv_indices, last


class Planner:
    """The host half of a BatchAttention built as decode.py builds it."""

    def __init__(self, batch: int, num_pages: int, mask):
        group = HQ // HKV
        dec = launch_config("decode", HEAD_DIM, group, DTYPE)
        pre = launch_config("prefill", HEAD_DIM, group, DTYPE)
        self.tilings = {
            "decode": Tiling(dec.rows_per_tile, DECODE_CTAS, max(1, int(dec.kv_tile or 1))),
            "prefill": Tiling(pre.rows_per_tile, PREFILL_CTAS, max(1, int(pre.kv_tile or 1))),
        }
        worst = worst_case_mixed_bounds(max_batch_size=batch, max_total_q=batch,
                                        num_kv_heads=HKV, group_size=group, **self.tilings)
        self.bounds = PlanBounds(max_batch_size=batch, max_total_q=batch,
                                 max_work_items=worst.max_work_items,
                                 max_partial_rows=worst.max_partial_rows,
                                 max_merge_rows=worst.max_merge_rows)
        self.layout = workspace_layout(DECODE_CTAS, self.bounds, num_pages, PREFILL_CTAS)
        self.host = np.zeros(self.layout.total, dtype=np.int32)
        self.mask, self.group = mask, group

    def validate(self, args):
        return validate_plan_inputs(*args, page_size=PAGE)

    def schedule(self, inputs):
        return plan_mixed(inputs.qo_lens, inputs.kv_lens, num_kv_heads=HKV,
                          group_size=self.group, **self.tilings, bounds=self.bounds,
                          mask=self.mask, head_dim=HEAD_DIM)

    def fill(self, plan, inputs):
        return fill_workspace(self.layout, self.host, plan, inputs)


def median_us(fn, reps: int) -> float:
    for _ in range(min(50, reps)):
        fn()
    times = []
    clock = time.perf_counter_ns
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) / 1e3


def measure(name: str, mask_name: str, mask, reps: int) -> dict[str, float]:
    args = batch_inputs(workload_lengths(name))
    p = Planner(args[0].shape[0] - 1, args[2].shape[0], mask)
    inputs = p.validate(args)
    plan = p.schedule(inputs)

    def whole():
        i = p.validate(args)
        p.fill(p.schedule(i), i)

    row = {
        "validate": median_us(lambda: p.validate(args), reps),
        "plan_mixed": median_us(lambda: p.schedule(inputs), reps),
        "fill": median_us(lambda: p.fill(plan, inputs), reps),
        "total": median_us(whole, reps),
    }
    print(f"{name:>7} {mask_name:>6} items {plan.num_work_items:5d} merges "
          f"{plan.merge_count:5d} | " + " ".join(f"{k} {v:8.1f}" for k, v in row.items()),
          flush=True)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--workload", action="append",
                    help="B<batch> (uniform, kv_len 2048) or skewed; default B128 B256 skewed")
    a = ap.parse_args(argv)
    causal = attnlang.load(str(ROOT / "examples" / "causal.attn")).mask
    print("median microseconds per call (host only; plan() adds one memcpyAsync)")
    for name in a.workload or ["B128", "B256", "skewed"]:
        for mask_name, mask in (("none", None), ("causal", causal)):
            measure(name, mask_name, mask, a.reps)


if __name__ == "__main__":
    main()
