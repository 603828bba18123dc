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

    python3 benchmarks/e2e.py [--quick] [--backends attnlang,sdpa,...] [--out DIR]

--quick: 4 layers, 4 prompts of 512 tokens, 32 new tokens (a smoke run of the plumbing).
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


def worker(backend: str, args: argparse.Namespace) -> dict:
    """One backend, in this process: returns its timings and first tokens."""
    torch = C.require_cuda()
    import transformers

    if backend == "attnlang":
        C.import_attnlang()
        from attnlang.integrations import transformers as alt

        alt.register("attnlang")
    if backend == "flex_attention":
        C.raise_dynamo_limits(256)
    model = build_model(torch, transformers, args.layers)
    model.set_attn_implementation(backend)
    g = torch.Generator(device="cuda").manual_seed(1)
    prompts = torch.randint(1, 128256, (args.batch, args.prompt), device="cuda", generator=g)
    mask = torch.ones_like(prompts)

    def generate(new_tokens: int):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    generate(1)  # warm-up: kernels compiled, allocator primed
    _, out = generate(args.new_tokens)
    with torch.no_grad():
        logits = model(prompts, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()
    torch.save(logits.cpu(), f"/tmp/e2e_{backend}_logits.pt")
    ttft = statistics.median(generate(1)[0] for _ in range(args.reps))
    total = statistics.median(generate(args.new_tokens)[0] for _ in range(args.reps))
    decode_tokens = args.batch * (args.new_tokens - 1)
    return {"backend": backend, "ttft_ms": ttft * 1e3, "total_s": total,
            "decode_tok_s": decode_tokens / (total - ttft),
            "first_tokens": out[0, args.prompt:args.prompt + 8].tolist(),
            "memory_gb": torch.cuda.max_memory_allocated() / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-seconds", type=float, default=240, help="per backend")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.layers, args.batch, args.prompt, args.new_tokens = (
        (4, 4, 512, 32) if args.quick else (32, 16, 2048, 128))

    if args.worker:  # a child process: one backend
        Path(args.result).write_text(json.dumps(worker(args.worker, args)))
        return

    rows = []
    for backend in args.backends.split(","):
        result = Path(f"/tmp/e2e_{backend}.json")
        result.unlink(missing_ok=True)
        Path(f"/tmp/e2e_{backend}_logits.pt").unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--worker", backend, "--result", str(result),
               "--reps", str(args.reps)] + (["--quick"] if args.quick else [])
        C.log(f"{backend}: running ({' '.join(cmd[2:])})")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.max_seconds)
            if proc.returncode != 0 or not result.exists():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                rows.append({"backend": backend, "note": "failed: " + " | ".join(tail)[-200:]})
                continue
            rows.append(json.loads(result.read_text()))
        except subprocess.TimeoutExpired:
            rows.append({"backend": backend, "note": f"over {args.max_seconds:.0f} s"})
        C.log(f"{backend}: {rows[-1]}")

    by_name = {r["backend"]: r for r in rows}
    ref = by_name.get("sdpa", {}).get("first_tokens")
    ref_logits = Path("/tmp/e2e_sdpa_logits.pt")
    if ref_logits.exists():
        torch = C.torch_module()
        want = torch.load(ref_logits)
        for r in rows:
            path = Path(f"/tmp/e2e_{r['backend']}_logits.pt")
            if path.exists() and "ttft_ms" in r:
                got = torch.load(path)
                r["logits_err"] = f"{((got - want).norm() / want.norm()).item():.1e}"
    al = by_name.get("attnlang", {})
    for r in rows:
        if ref and r.get("first_tokens"):
            same = next((i for i, (a, b) in enumerate(zip(r["first_tokens"], ref, strict=True))
                         if a != b), len(ref))
            r["agree"] = f"{same}/{len(ref)}"
        for key, better in (("ttft_ms", "lower"), ("decode_tok_s", "higher")):
            if r.get(key) and al.get(key):
                ratio = al[key] / r[key] if better == "higher" else r[key] / al[key]
                r[f"{key}_x"] = f"{ratio:.2f}x"
    shape = (f"{args.layers} layers, 32/8 heads, d128, bf16; {args.batch} x {args.prompt} "
             f"prompt tokens, {args.new_tokens} new")
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
