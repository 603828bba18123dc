"""Greedy generation under transformers' tensor parallelism, attention through attnlang.

    torchrun --nproc-per-node 2 tests/integrations/tp_generate.py MODEL_DIR INPUT_JSON OUT_JSON

Each rank loads MODEL_DIR with tp_plan="auto" (its share of the heads), runs greedy generate()
on INPUT_JSON's "prompt" ids through attnlang, and the teacher-forced logits of its "sequence"
(the 1-GPU run's prompt + tokens); rank 0 writes the new tokens and the heads its attention
saw to OUT_JSON and the logits next to it (OUT_JSON + ".pt").
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
    # Record the query heads each attention call sees: with tp_plan="auto" a rank's share.
    seen = set()
    attention = transformers.AttentionInterface._global_mapping["attnlang"]

    def counting(module, query, *args, **kwargs):
        seen.add(int(query.shape[1]))
        return attention(module, query, *args, **kwargs)

    transformers.AttentionInterface.register("attnlang", counting)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, tp_plan="auto", attn_implementation="attnlang")
    model.eval()
    with open(prompt_json) as f:
        inputs = json.load(f)
    prompt = torch.tensor(inputs["prompt"], device="cuda")
    new_tokens = 16
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    with torch.no_grad():
        logits = model(torch.tensor(inputs["sequence"], device="cuda")).logits.float()
    if rank == 0:
        torch.save(logits.cpu(), out_json + ".pt")
        with open(out_json, "w") as f:
            json.dump({"tokens": out[:, prompt.shape[1]:].tolist(),
                       "local_heads": sorted(seen)}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
