"""transformers models running their attention through attnlang (GPU): random-weight models from
configs (no downloads), bf16, compared with transformers' own eager attention.

The reference is transformers' own eager attention computed in float32 (`eager_fp32` below:
the same bf16 model, only the attention upcast). Greedy decoding of a random model meets
near-ties that any rounding flips either way (seen on the H100: on the Gemma-2 model below, bf16
and float32-attention eager take one side of a tie at the 12th token, attnlang and an
all-float32 model the other; on the Llama model the 2nd token of one row is such a tie). So the
greedy tokens are compared with the reference's up to its first position that bf16 precision
cannot decide (a top-2 margin below 4x bf16 eager's own mean logit error there), teacher-forced
positions wherever decided, and the logits must be at least as close to the reference as bf16
eager's own.

Weights: untied embeddings and initializer_range 0.2, so greedy decoding produces varied tokens
(with tied embeddings it repeats one token, and equal tokens would prove nothing); a negative
control (Gemma-2 without its soft-cap) shows the comparisons can fail.
"""

import sys

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnlang  # noqa: E402
from attnlang.integrations import transformers as alt  # noqa: E402

NEW_TOKENS = 16
PROMPT = 24  # longer than the Gemma-2 model's sliding window (8)


def _llama():
    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.2, eos_token_id=None,
        bos_token_id=None, pad_token_id=0)


def _gemma2():
    return transformers.Gemma2Config(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, sliding_window=8,
        attn_logit_softcapping=20.0, final_logit_softcapping=None, query_pre_attn_scalar=128,
        max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None, pad_token_id=0)


def _deepseek_v3():
    """Multi-head latent attention: queries and keys of 128 + 64 rope dims, values of 128;
    dense MLPs only (first_k_dense_replace covers every layer)."""
    return transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
        q_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, max_position_embeddings=256, tie_word_embeddings=False,
        initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=0)


MODELS = {"llama": (_llama, transformers.LlamaForCausalLM),
          "gemma2": (_gemma2, transformers.Gemma2ForCausalLM),
          "deepseek_v3": (_deepseek_v3, transformers.DeepseekV3ForCausalLM)}


@pytest.fixture(scope="module")
def models():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU for torch")
    alt.register("attnlang")
    _register_reference()
    # Negative control: Gemma-2's own layers, but without the soft-cap.
    no_cap = {t: attnlang.parse(alt.default_variant_source(_gemma2(), t).replace(
        "logits = softcap * tanh(logits / softcap)\n", ""))
        for t in ("sliding_attention", "full_attention")}
    alt.register("attnlang_nocap", variant=no_cap)
    built = {}
    for name, (config, cls) in MODELS.items():
        torch.manual_seed(0)
        model = cls(config()).to("cuda", torch.bfloat16).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        built[name] = model
    return built


def _prompts(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (batch, length), generator=g).cuda()


def _generate(model, impl, ids, mask=None):
    model.set_attn_implementation(impl)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, ids.shape[1]:]


def _logits(model, impl, ids):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids).logits.float()


def _eager_fp32(module, query, key, value, attention_mask, **kwargs):
    """transformers' eager attention of this model, in float32 (the reference)."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    mask = None if attention_mask is None else attention_mask.float()
    out, _ = eager(module, query.float(), key.float(), value.float(), mask, **kwargs)
    return out.to(query.dtype), None


def _register_reference():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    transformers.AttentionInterface.register("eager_fp32", _eager_fp32)
    AttentionMaskInterface.register("eager_fp32", ALL_MASK_ATTENTION_FUNCTIONS["eager"])


class Comparison:
    """`impl` against the reference (float32-attention eager), teacher-forced on the
    reference's own greedy sequence `seq` ([B, prompt + new]):

    - decided [B, new]: positions where the reference's top-2 logit margin exceeds 4x the
      mean logit difference between bf16 eager and the reference at that position (bf16's
      own rounding): there the greedy token does not depend on the precision; elsewhere
      it is a tie;
    - agree [B, new]: impl's argmax equals the reference's;
    - err, eager_err: mean |logit difference| over mean |logit|, for impl and bf16 eager."""

    def __init__(self, model, impl, seq, prompt_len):
        truth = _logits(model, "eager_fp32", seq)[:, prompt_len - 1:-1]
        eager = _logits(model, "eager", seq)[:, prompt_len - 1:-1]
        got = _logits(model, impl, seq)[:, prompt_len - 1:-1]
        top2 = truth.topk(2, dim=-1).values
        tol = 4 * (eager - truth).abs().mean(-1)
        self.decided = (top2[..., 0] - top2[..., 1]) > tol
        self.agree = got.argmax(-1) == truth.argmax(-1)
        scale = truth.abs().mean()
        self.err = ((got - truth).abs().mean() / scale).item()
        self.eager_err = ((eager - truth).abs().mean() / scale).item()

    def first_tie(self, row: int) -> int:
        """Index of the first generated position the reference cannot decide (or the end)."""
        ties = (~self.decided[row]).nonzero()
        return int(ties[0]) if ties.numel() else self.decided.shape[1]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_and_logits_equal_eager(models, name):
    """Greedy tokens equal the reference's up to its first precision tie (in each row), every
    decided teacher-forced position agrees, and the logits are at least as close to the
    reference as transformers' own bf16 eager."""
    model = models[name]
    ids = _prompts(4, PROMPT, seed=3)
    want = _generate(model, "eager_fp32", ids)
    assert want.unique().numel() > NEW_TOKENS // 2, "degenerate model: tokens repeat"
    got = _generate(model, "attnlang", ids)
    cmp = Comparison(model, "attnlang", torch.cat([ids, want], 1), PROMPT)
    assert cmp.decided.float().mean() >= 0.5, ("too many ties to compare", cmp.decided)
    compared = 0
    for row in range(ids.shape[0]):
        n = cmp.first_tie(row)
        assert torch.equal(got[row, :n], want[row, :n]), (row, n, got[row], want[row])
        compared += n
    # not vacuous: on average at least one token per row before its first tie
    assert compared >= ids.shape[0], ("too few tokens before the first tie", cmp.decided)
    assert cmp.agree[cmp.decided].all(), cmp.agree
    assert cmp.err <= 1.5 * cmp.eager_err + 1e-3, (cmp.err, cmp.eager_err)


def test_without_its_softcap_gemma2_disagrees(models):
    """The negative control: the same comparisons fail when the variant drops the soft-cap."""
    model = models["gemma2"]
    ids = _prompts(2, PROMPT)
    want = _generate(model, "eager_fp32", ids)
    cmp = Comparison(model, "attnlang_nocap", torch.cat([ids, want], 1), PROMPT)
    assert not cmp.agree[cmp.decided].all()
    assert cmp.err > 1.5 * cmp.eager_err + 1e-3, (cmp.err, cmp.eager_err)


@pytest.mark.parametrize("name", MODELS)
def test_left_padded_rows_equal_their_prompt_alone(models, name):
    model = models[name]
    lengths = (PROMPT, 13, 5)
    full = _prompts(len(lengths), PROMPT, seed=1)
    ids = torch.zeros_like(full)
    mask = torch.zeros_like(full)
    for row, n in enumerate(lengths):
        ids[row, PROMPT - n:] = full[row, :n]
        mask[row, PROMPT - n:] = 1
    batched = _generate(model, "attnlang", ids, mask)
    for row, n in enumerate(lengths):
        alone = _generate(model, "attnlang", full[row:row + 1, :n])
        assert torch.equal(batched[row:row + 1], alone), (row, n)


@pytest.mark.parametrize("name", [m for m in MODELS if m != "deepseek_v3"])
def test_generate_batch_equals_generate(models, name):
    model = models[name]
    lengths = (PROMPT, 11, 30)
    prompts = [_prompts(1, n, seed=2 + i)[0] for i, n in enumerate(lengths)]
    want = [_generate(model, "attnlang", p[None])[0].tolist() for p in prompts]
    model.set_attn_implementation("attnlang")
    config = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    outputs = model.generate_batch([p.tolist() for p in prompts], generation_config=config,
                                   progress_bar=False)
    model.set_attn_implementation("attnlang")  # generate_batch leaves "paged|attnlang" set
    got = {tuple(o.prompt_ids): list(o.generated_tokens)[:NEW_TOKENS]
           for o in outputs.values()}
    for prompt, tokens in zip(prompts, want, strict=True):
        assert got[tuple(prompt.tolist())] == tokens


def test_tensor_parallel_equals_one_gpu(models, tmp_path):
    """Under tp_plan="auto" on 2 GPUs each rank runs its own heads through attnlang; tokens
    equal the 1-GPU run's up to its first precision tie (the all-reduce of row-parallel layers
    rounds differently), teacher-forced argmaxes agree wherever decided, and the logits are as
    close to the 1-GPU ones as bf16 eager's are to the float32-attention reference."""
    import json
    import os
    import subprocess

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the nvidia-h200-x2 machine kind)")
    model = models["llama"]
    ids = _prompts(4, PROMPT, seed=3)
    want = _generate(model, "attnlang", ids)
    seq = torch.cat([ids, want], 1)
    one_gpu = _logits(model, "attnlang", seq)
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "in.json").write_text(json.dumps({"prompt": ids.tolist(),
                                                  "sequence": seq.tolist()}))
    script = os.path.join(os.path.dirname(__file__), "tp_generate.py")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script,
         str(tmp_path / "model"), str(tmp_path / "in.json"), str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["local_heads"] == [model.config.num_attention_heads // 2]  # heads were split
    tp_logits = torch.load(str(tmp_path / "out.json") + ".pt").cuda()
    cmp = Comparison(model, "attnlang", seq, PROMPT)
    tokens = torch.tensor(got["tokens"], device="cuda")
    for row in range(ids.shape[0]):
        n = cmp.first_tie(row)
        assert torch.equal(tokens[row, :n], want[row, :n]), (row, n)
    span = slice(PROMPT - 1, -1)
    agree = tp_logits[:, span].argmax(-1) == one_gpu[:, span].argmax(-1)
    assert agree[cmp.decided].all()
    err = ((tp_logits - one_gpu).abs().mean() / one_gpu.abs().mean()).item()
    assert err <= 2 * cmp.eager_err + 1e-3, (err, cmp.eager_err)
