"""Prefill template shapes, side by side: which tile layout is fastest on the GPU at hand.

The prefill kernel's layout per head_dim lives in attnlang/codegen/config.py
(`_PREFILL_WGMMA_SHAPE` for the wgmma path an H100 runs, `_PREFILL_SHAPE` for the mma.sync
path, `--mma-sync`: KV tile keys, pipeline stages, warps, 16-row blocks per warp, CTAs per SM).
This script times attnlang_paged on benchmarks/prefill.py's workloads (same inputs, same
checks against the float32 reference rows) once per candidate shape, recompiling the kernel
for each, and prints TFLOP/s per (workload, shape). It changes nothing on disk: a winner is
copied into config.py by hand, with the figures into benchmarks/NOTES.md.

    python3 benchmarks/prefill_shapes.py --shapes "64,4,8,1,1;128,3,8,1,1" \
        [--mma-sync] [--only causal_s16384,full_s4096] [--out $OUT]

Shapes are for head_dim 128, or the head dim `--head-dim` gives (the workloads' head dim); the
first is the baseline of the ratio column.
"""

from __future__ import annotations

import sys

try:
    import common as C
    import prefill as P
except ImportError:  # run as `python3 -m benchmarks.prefill_shapes`
    from benchmarks import common as C
    from benchmarks import prefill as P


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        shape = tuple(int(x) for x in part.split(","))
        if len(shape) != 5:
            raise SystemExit(f"--shapes: {part!r} is not tile,stages,warps,row_blocks,min_blocks")
        shapes.append(shape)
    if not shapes:
        raise SystemExit("--shapes: give at least one shape")
    return shapes


def use_shape(shape: tuple[int, ...], mma_sync: bool) -> None:
    """Make the next compile_variant build head_dim 128 prefill kernels with `shape` (on the
    mma.sync path's table, or the wgmma path's)."""
    from attnlang.codegen import config

    table = config._PREFILL_SHAPE if mma_sync else config._PREFILL_WGMMA_SHAPE
    table[P.HEAD_DIM] = shape
    C.forget_compiled_modules()


class Shapes(P.Prefill):
    def __init__(self, args, shapes, mma_sync):
        super().__init__(args)
        self.shapes = shapes
        self.arch = P.MMA_SYNC_ARCH if mma_sync else None  # None: the device's (sm_90a)

    def label(self, shape) -> str:
        return "al[" + ",".join(map(str, shape)) + "]"

    def main(self) -> int:
        env = C.environment(self.torch)
        self.run.results.set(env=env, shapes=[list(s) for s in self.shapes])
        C.log(f"prefill shapes on {env.get('gpu')}: {[self.label(s) for s in self.shapes]}")
        names = self.only.select(P.QUICK if self.args.quick else list(self.specs))
        self.mm_tflops = self.run.ceilings(matmul=True)["matmul_tflops"]
        self.slopes = C.alibi_slopes(32)
        self.al, note = self.run.step("import attnlang", C.import_attnlang)
        if self.al is None:
            C.log(f"attnlang not importable: {note}")
            return 1
        for shape in self.shapes:
            use_shape(shape, self.arch is not None)
            self.variants.clear()
            for name in names:
                x, note = self.run.step(f"{name} inputs", lambda n=name: self.get_inputs(n),
                                        need=15)
                if x is None:
                    continue
                self.measure(x, self.label(shape),
                             lambda x=x: self._prep_attnlang(x, ragged=False, arch=self.arch),
                             need=20)
        self.run.finish()
        self._tmp.cleanup()
        return 0

    def tables(self) -> str:  # the Runner prints this last
        self.run.results.flush()
        labels = [self.label(s) for s in self.shapes]
        out = []
        for name in [n for n in self.specs if any(r["workload"] == n for r in self.rows)]:
            got = {r["contender"]: r for r in self.rows if r["workload"] == name}
            base = got.get(labels[0], {}).get("time_ms")
            cells = {"workload": name}
            for lab in labels:
                r = got.get(lab, {})
                speed = C.ratio(base, r.get("time_ms"))
                cells[lab] = (f"{C.fmt(r.get('tflops'), '.0f')} ({C.fmt(speed, '.2f')}x) "
                              f"{C.err_cell(r.get('rel_err'))}")
            out.append(cells)
        cols = [("workload", "workload")] + [(lab, lab) for lab in labels]
        return C.format_table(out, cols, title=f"SHAPES prefill bf16 d{P.HEAD_DIM}: TFLOP/s "
                              "(speed vs the first shape) rel err; shape = tile,stages,warps,"
                              "row_blocks,min_blocks")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    shapes = "64,4,8,1,1"
    mma_sync = "--mma-sync" in argv
    if mma_sync:
        argv.remove("--mma-sync")
    if "--shapes" in argv:
        i = argv.index("--shapes")
        shapes = argv[i + 1]
        del argv[i:i + 2]
    args = P.parse_args(argv)
    P.HEAD_DIM = args.head_dim  # the workloads', and the table entry the shapes replace
    return Shapes(args, parse_shapes(shapes), mma_sync).main()


if __name__ == "__main__":
    raise SystemExit(main())
