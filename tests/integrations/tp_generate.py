"""Greedy generation under transformers' tensor parallelism, attention through attnlang.

    torchrun --nproc-per-node 2 tests/integrations/tp_generate.py MODEL_DIR PROMPT_JSON OUT_JSON

Each rank loads MODEL_DIR with tp_plan="auto" (its share of the heads), runs greedy generate()
on the prompt ids of PROMPT_JSON through attnlang, and rank 0 writes the new tokens to OUT_JSON.
tests/integrations/test_gpu_transformers.py runs it and compares with one GPU.
"""

import json
import os
import sys

import torch
import transformers

from attnlang.integrations import transformers as alt


def main() -> None:
    model_dir, prompt_json, out_json = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    alt.register("attnlang")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, tp_plan="auto", attn_implementation="attnlang")
    model.eval()
    with open(prompt_json) as f:
        prompt = torch.tensor(json.load(f), device="cuda")
    new_tokens = 16
    heads = model.model.layers[0].self_attn.q_proj.weight.shape[0] // model.config.head_dim
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    if rank == 0:
        with open(out_json, "w") as f:
            json.dump({"tokens": out[:, prompt.shape[1]:].tolist(), "local_heads": heads}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
