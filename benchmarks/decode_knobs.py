"""Decode tuning constants, side by side: attnlang's decode on benchmarks/decode.py's
workloads (same inputs, same checks) once per setting of its layout and planner constants.

A setting is a comma-separated list of MODULE.NAME=INT overrides of module constants, with
MODULE one of config (attnlang.codegen.config), launches (attnlang.runtime.launches) or
planner (attnlang.runtime.planner); "-" is the code as it stands. Kernels are recompiled per
setting (a layout constant changes the rendered source, hence the cache key). Nothing changes
on disk: a winner goes into the code by hand, its figures into benchmarks/NOTES.md.

    python3 benchmarks/decode_knobs.py --set - --set config._STAGES=4 \
        --set launches.MAX_CTAS_PER_SM=2,planner.MIN_KV_CHUNK=1024 \
        [--only b1_l32768,b16_l4096] [--kv-heads 32] [--out $OUT]

--kv-heads N: N KV heads instead of decode.py's 8 (32 query heads: GQA group 32 / N).

Prints GB/s of CUDA-graph replays per (workload, setting), and the speed against the first.
"""

from __future__ import annotations

import importlib
import sys

try:
    import common as C
    import decode as D
except ImportError:  # run as `python3 -m benchmarks.decode_knobs`
    from benchmarks import common as C
    from benchmarks import decode as D

MODULES = {"config": "attnlang.codegen.config", "launches": "attnlang.runtime.launches",
           "planner": "attnlang.runtime.planner"}


def parse_setting(text: str) -> dict[tuple[str, str], int]:
    if text.strip() == "-":
        return {}
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = item.partition("=")
        mod, _, attr = name.partition(".")
        if mod not in MODULES or not attr or not value:
            raise SystemExit(f"--set: {item!r} is not MODULE.NAME=INT, MODULE in {list(MODULES)}")
        out[(mod, attr)] = int(value)
    return out


class Knobs(D.Decode):
    def __init__(self, args, settings: list[str]):
        super().__init__(args)
        self.settings = settings
        self.defaults: dict[tuple[str, str], int] = {}

    def apply(self, overrides: dict[tuple[str, str], int]) -> None:
        for key in set(self.defaults) | set(overrides):
            mod = importlib.import_module(MODULES[key[0]])
            if not hasattr(mod, key[1]):
                raise SystemExit(f"--set: {MODULES[key[0]]} has no {key[1]}")
            self.defaults.setdefault(key, getattr(mod, key[1]))
            setattr(mod, key[1], overrides.get(key, self.defaults[key]))
        C.forget_compiled_modules()

    def main(self) -> int:
        env = C.environment(self.torch)
        self.run.results.set(env=env, settings=self.settings)
        names = self.only.select(D.QUICK if self.args.quick else D.MAIN)
        self.copy_gbps = self.run.ceilings(matmul=False)["copy_gbps"]
        self.al, note = self.run.step("import attnlang", C.import_attnlang)
        if self.al is None:
            C.log(f"attnlang not importable: {note}")
            return 1
        causal = self.al.load(str(C.REPO_ROOT / "examples" / "causal.attn"))
        for setting in self.settings:
            self.apply(parse_setting(setting))
            for name in names:
                wl, note = self.run.step(f"{name} inputs", lambda n=name: self.workload(n),
                                         need=10)
                if wl is None:
                    continue
                self.measure("knobs", wl, setting,
                             lambda wl=wl: D.prep_attnlang(self.al, self.torch, wl, causal),
                             None, ref=self.ref(wl, "causal"), nbytes=wl.kv_bytes(), need=15)
        self.run.finish()
        return 0

    def tables(self) -> str:  # the Runner prints this last
        self.run.results.flush()
        out = []
        for name in [n for n in D.MAIN if any(r["workload"] == n for r in self.rows)]:
            got = {r["contender"]: r for r in self.rows
                   if r["workload"] == name and r["mode"] == "graph"}
            base = got.get(self.settings[0], {}).get("time_us")
            cells = {"workload": name}
            for s in self.settings:
                r = got.get(s, {})
                speed = C.ratio(base, r.get("time_us"))
                cells[s] = (f"{C.fmt(r.get('gbps'), '.0f')} ({C.fmt(speed, '.2f')}x) "
                            f"{C.err_cell(r.get('rel_err'))}")
            out.append(cells)
        cols = [("workload", "workload")] + [(s, s) for s in self.settings]
        copy = C.fmt(self.copy_gbps, ".0f")
        return C.format_table(out, cols, title=f"KNOBS decode bf16 {D.HQ}/{D.HKV} d128 page 16:"
                              f" graph GB/s (speed vs the first) rel err; copy {copy} GB/s")


def set_kv_heads(n: int) -> None:
    """decode.py's workloads with n KV heads (its module constants; 32 query heads)."""
    if n < 1 or D.HQ % n:
        raise SystemExit(f"--kv-heads: {n} does not divide {D.HQ} query heads")
    D.HKV, D.GROUP = n, D.HQ // n
    D.BYTES_PER_TOKEN = n * D.HEAD_DIM * 2 * 2


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = []
    while "--set" in argv:
        i = argv.index("--set")
        settings.append(argv[i + 1])
        del argv[i:i + 2]
    for s in settings:
        parse_setting(s)  # fail early on a typo
    if "--kv-heads" in argv:
        i = argv.index("--kv-heads")
        set_kv_heads(int(argv[i + 1]))
        del argv[i:i + 2]
    return Knobs(D.parse_args(argv), settings or ["-"]).main()


if __name__ == "__main__":
    raise SystemExit(main())
