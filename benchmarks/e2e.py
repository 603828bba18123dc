"""End to end: a Llama-3-8B-shaped model generating through each attention backend.

32 layers, 32 query / 8 KV heads, head_dim 128, hidden 4096, MLP 14336, vocab 128256, bf16,
random weights (no download; the same seed for every backend, so the same model). A batch of
16 random prompts of 2048 tokens, greedy, 128 new tokens each (eos disabled). For each backend:

- time to first token: generate(max_new_tokens=1), i.e. the prefill of 16 x 2048 tokens;
- decode tokens/s: 16 x 127 tokens over (time of generate(128) - time to first token);
- the logits of the prefill's last position (all 16 requests), compared with sdpa's as a
  relative L2 error, so a fast wrong backend shows (greedy tokens of a random 8B model are
  near-ties that any rounding flips, so they are shown but prove little).

Backends: attnlang (alt.register(): each layer's own causal attention), sdpa, flex_attention,
eager; each runs in its own process (a backend that fails or runs past --max-seconds gets a
row saying so, the others still run). Medians of --reps timed runs after one warm-up run.

    python3 benchmarks/e2e.py [--quick] [--layers N] [--backends attnlang,sdpa,...] [--out DIR]
    python3 benchmarks/e2e.py --compiled --backends attnlang,sdpa     # + compiled generation
    python3 benchmarks/e2e.py --compiled-only --backends attnlang,sdpa  # compiled rows alone

--quick: 4 layers, 4 prompts of 512 tokens, 32 new tokens (a smoke run of the plumbing);
--layers overrides the layer count of either size.

--compiled adds a "(compiled)" row per backend: transformers' compiled generation, i.e. a
static cache (cache_implementation="static") with which generate() runs its decode steps
through torch.compile (CompileConfig defaults: inductor, "reduce-overhead", so CUDA graphs);
the prefill stays eager, as transformers runs it. Each such row also records whether generate
really compiled and how many graph breaks dynamo took (attnlang's plan() runs on the host, so
its layers break the graph). Compiling 32 layers takes minutes per backend: the default run is
eager-only; give compiled rows their own run (and --max-seconds) on a small time budget. A
compiled row's "attnlang faster" compares with attnlang's compiled row, or its eager row when
the compiled one failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

BACKENDS = ["attnlang", "sdpa", "flex_attention", "eager"]


def build_model(torch, transformers, layers: int):
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
        initializer_range=0.02, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):  # random init on the GPU: seconds, not minutes
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()


def label(backend: str, compiled: bool) -> str:
    return f"{backend} (compiled)" if compiled else backend


def file_stem(backend: str, compiled: bool) -> str:
    return f"/tmp/e2e_{backend}{'_compiled' if compiled else ''}"


def worker(backend: str, args: argparse.Namespace) -> dict:
    """One backend, in this process: returns its timings and first tokens."""
    torch = C.require_cuda()
    import transformers

    if backend == "attnlang":
        C.import_attnlang()
        from attnlang.integrations import transformers as alt

        alt.register("attnlang")
    if backend == "flex_attention" or args.compiled:
        C.raise_dynamo_limits(256)
    model = build_model(torch, transformers, args.layers)
    model.set_attn_implementation(backend)
    options = {}
    if args.compiled:  # static cache: generate() then compiles its decode steps
        options["cache_implementation"] = "static"
        model.generation_config.compile_config = transformers.CompileConfig()
    g = torch.Generator(device="cuda").manual_seed(1)
    prompts = torch.randint(1, 128256, (args.batch, args.prompt), device="cuda", generator=g)
    mask = torch.ones_like(prompts)

    def generate(new_tokens: int):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 **options)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    generate(1)  # warm-up: kernels compiled, allocator primed
    _, out = generate(args.new_tokens)  # also the warm-up of decode (torch.compile with --compiled)
    with torch.no_grad():
        logits = model(prompts, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()
    torch.save(logits.cpu(), file_stem(backend, args.compiled) + "_logits.pt")
    ttft = statistics.median(generate(1)[0] for _ in range(args.reps))
    total = statistics.median(generate(args.new_tokens)[0] for _ in range(args.reps))
    decode_tokens = args.batch * (args.new_tokens - 1)
    row = {"backend": label(backend, args.compiled), "ttft_ms": ttft * 1e3, "total_s": total,
           "decode_tok_s": decode_tokens / (total - ttft),
           "first_tokens": out[0, args.prompt:args.prompt + 8].tolist(),
           "memory_gb": torch.cuda.max_memory_allocated() / 1e9}
    if args.compiled:
        from torch._dynamo.utils import counters

        # transformers keeps the torch.compile'd forward here once generate() has used it.
        row["did_compile"] = hasattr(model, "_compiled_call")
        row["graph_breaks"] = sum(counters["graph_break"].values())
        row["note"] = (f"{row['graph_breaks']} graph breaks" if row["did_compile"] else
                       "generate() did not compile (transformers' auto-compile criteria)")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--quick", action="store_true", help="4 layers, 4 x 512 prompt, 32 new")
    parser.add_argument("--layers", type=int, default=None, help="32 (4 with --quick)")
    parser.add_argument("--compiled", action="store_true",
                        help="also each backend with a static cache + torch.compile'd decode")
    parser.add_argument("--compiled-only", action="store_true",
                        help="only the compiled rows (their own run: compiling takes minutes)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-seconds", type=float, default=240, help="per backend")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-compiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    layers, args.batch, args.prompt, args.new_tokens = (
        (4, 4, 512, 32) if args.quick else (32, 16, 2048, 128))
    args.layers = args.layers or layers

    if args.worker:  # a child process: one backend, eager or compiled
        args.compiled = args.worker_compiled
        Path(args.result).write_text(json.dumps(worker(args.worker, args)))
        return

    rows = []
    modes = [True] if args.compiled_only else [False, True] if args.compiled else [False]
    args.compiled = args.compiled or args.compiled_only
    for compiled in modes:
        for backend in args.backends.split(","):
            name, stem = label(backend, compiled), file_stem(backend, compiled)
            result = Path(stem + ".json")
            result.unlink(missing_ok=True)
            Path(stem + "_logits.pt").unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--worker", backend, "--result", str(result),
                   "--reps", str(args.reps), "--layers", str(args.layers)]
            cmd += (["--quick"] if args.quick else []) + (
                ["--worker-compiled"] if compiled else [])
            C.log(f"{name}: running ({' '.join(cmd[2:])})")
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=args.max_seconds)
                if proc.returncode != 0 or not result.exists():
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                    rows.append({"backend": name, "note": "failed: " + " | ".join(tail)[-200:]})
                    continue
                rows.append(json.loads(result.read_text()))
            except subprocess.TimeoutExpired:
                rows.append({"backend": name, "note": f"over {args.max_seconds:.0f} s"})
            C.log(f"{name}: {rows[-1]}")

    by_name = {r["backend"]: r for r in rows}
    sdpa = by_name.get("sdpa") or by_name.get(label("sdpa", True)) or {}
    ref = sdpa.get("first_tokens")
    # The prefill is eager in both modes: sdpa's eager logits are the reference for all rows.
    ref_logits = next((Path(file_stem("sdpa", c) + "_logits.pt") for c in (False, True)
                       if Path(file_stem("sdpa", c) + "_logits.pt").exists()), None)
    if ref_logits is not None:
        torch = C.torch_module()
        want = torch.load(ref_logits)
        for r in rows:
            compiled = r["backend"].endswith(" (compiled)")
            path = Path(file_stem(r["backend"].removesuffix(" (compiled)"), compiled)
                        + "_logits.pt")
            if path.exists() and "ttft_ms" in r:
                got = torch.load(path)
                r["logits_err"] = f"{((got - want).norm() / want.norm()).item():.1e}"
    for r in rows:
        al = by_name.get("attnlang", {})
        if r["backend"].endswith(" (compiled)") and "ttft_ms" in by_name.get(
                label("attnlang", True), {}):
            al = by_name[label("attnlang", True)]
        if ref and r.get("first_tokens"):
            same = next((i for i, (a, b) in enumerate(zip(r["first_tokens"], ref, strict=True))
                         if a != b), len(ref))
            r["agree"] = f"{same}/{len(ref)}"
        for key, better in (("ttft_ms", "lower"), ("decode_tok_s", "higher")):
            if r.get(key) and al.get(key):
                ratio = al[key] / r[key] if better == "higher" else r[key] / al[key]
                r[f"{key}_x"] = f"{ratio:.2f}x"
    shape = (f"{args.layers} layers, 32/8 heads, d128, bf16; {args.batch} x {args.prompt} "
             f"prompt tokens, {args.new_tokens} new"
             + ("; (compiled): static cache, torch.compile'd decode" if args.compiled else ""))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "e2e.json").write_text(json.dumps({"shape": shape, "rows": rows},
                                                         indent=1))
    table = [{k: C.fmt(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    print(C.format_table(table, [("backend", "backend"), ("ttft_ms", "TTFT ms"),
                                 ("ttft_ms_x", "attnlang faster"), ("decode_tok_s", "decode tok/s"),
                                 ("decode_tok_s_x", "attnlang faster"),
                                 ("logits_err", "logits vs sdpa"), ("agree", "tokens = sdpa"),
                                 ("note", "note")],
                         title=f"\nLlama-3-8B-shaped, random weights: {shape}"))


if __name__ == "__main__":
    main()
