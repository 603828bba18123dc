"""Swap a transformers model's attention for a research variant in one line, then generate.

    python3 examples/transformers_generate.py                       # random-weight Llama
    python3 examples/transformers_generate.py --variant examples/ssmax.attn --param s=0.5
    python3 examples/transformers_generate.py --model /path/to/local/checkpoint

Without --model it builds a small Llama-shaped model with random weights (no download). It runs
greedy generation three ways: transformers' eager attention, attnlang with the model's own
attention (causal, read from its config) and attnlang with the variant from the .attn file
(Scalable-Softmax by default: logits scaled by s * log(q_pos + 1)), and prints the tokens.
The first two agree (up to bf16 rounding in eager, which rounds its probabilities to
bf16); the research variant changes the model, which is the point.
Needs a CUDA GPU and transformers >= 5.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import attnlang as al
from attnlang.integrations import transformers as alt


def _model(path: str | None):
    if path:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
        initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="examples/ssmax.attn", help=".attn file to run")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a run-time param of the variant (repeatable)")
    parser.add_argument("--model", default=None, help="a local checkpoint (default: random)")
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()

    variant = al.load(args.variant)  # errors point into the .attn file
    params = {name: float(value) for name, value in (p.split("=", 1) for p in args.param)}
    alt.register("attnlang")  # each layer's own attention, from its config
    alt.register("research", variant=variant, params=params)  # the one-line swap

    model = _model(args.model).to("cuda").eval()
    prompt = torch.randint(1, model.config.vocab_size, (2, 32), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(1))
    for impl in ("eager", "attnlang", "research"):
        model.set_attn_implementation(impl)
        out = model.generate(prompt, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        print(f"{impl:>9}: {out[0, prompt.shape[1]:].tolist()}")
    print(f"\nthe research variant ({variant.name}, params {params or 'defaults'}):\n")
    print(open(args.variant).read())


if __name__ == "__main__":
    main()
