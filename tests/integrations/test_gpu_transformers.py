"""transformers models running their attention through attnlang (GPU): random-weight models from
configs (no downloads), bf16, compared with transformers' own eager attention.

The reference is eager attention run on a float32 copy of the model: transformers' bf16 eager
rounds its softmax probabilities to bf16 before P V, and on the Gemma-2 model below that alone
changes the 5th greedy token (measured on the H100: bf16 eager diverges from float32 eager, while
attnlang, which keeps P in float32 until the tensor-core product, matches float32 eager token for
token and has the smaller logit error). So tokens are compared with float32 eager, and logits
must be at least as close to it as bf16 eager's own.

Weights: untied embeddings and initializer_range 0.2, so greedy decoding produces varied tokens
(with tied embeddings it repeats one token, and equal tokens would prove nothing); a negative
control (Gemma-2 without its soft-cap) shows the comparisons can fail.
"""

import copy

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
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
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


MODELS = {"llama": (_llama, transformers.LlamaForCausalLM),
          "gemma2": (_gemma2, transformers.Gemma2ForCausalLM)}


@pytest.fixture(scope="module")
def models():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU for torch")
    alt.register("attnlang")
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
    return torch.randint(1, 512, (batch, length), generator=g).cuda()


def _generate(model, impl, ids, mask=None):
    model.set_attn_implementation(impl)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, ids.shape[1]:]


def _logits(model, impl, ids):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids).logits.float()


def _float32(model):
    exact = copy.deepcopy(model).float()
    exact.set_attn_implementation("eager")
    return exact


def _agreement(model, impl, seq):
    """Teacher-forced on the reference's sequence, against float32 eager logits: `impl`'s
    argmax agreement and its error (mean |difference| over mean |logit|), and bf16 eager's
    error (the bf16 tolerance)."""
    eager, got = _logits(model, "eager", seq), _logits(model, impl, seq)
    truth = _logits(_float32(model), "eager", seq)

    def error(x):
        return ((x - truth).abs().mean() / truth.abs().mean()).item()

    agree = (truth.argmax(-1) == got.argmax(-1)).float().mean().item()
    return agree, error(got), error(eager)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_and_logits_equal_eager(models, name):
    model = models[name]
    ids = _prompts(2, PROMPT)
    eager = _generate(_float32(model), "eager", ids)
    assert eager.unique().numel() > NEW_TOKENS // 2, "degenerate model: tokens repeat"
    assert torch.equal(_generate(model, "attnlang", ids), eager)
    agree, err, eager_err = _agreement(model, "attnlang", torch.cat([ids, eager], 1))
    assert agree >= 0.98 and err <= 1.5 * eager_err + 1e-3, (agree, err, eager_err)


def test_without_its_softcap_gemma2_disagrees(models):
    """The negative control: the same comparisons fail when the variant drops the soft-cap."""
    model = models["gemma2"]
    ids = _prompts(2, PROMPT)
    eager = _generate(_float32(model), "eager", ids)
    assert not torch.equal(_generate(model, "attnlang_nocap", ids), eager)
    agree, err, eager_err = _agreement(model, "attnlang_nocap", torch.cat([ids, eager], 1))
    assert agree < 0.98 and err > 1.5 * eager_err + 1e-3, (agree, err, eager_err)


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


@pytest.mark.parametrize("name", MODELS)
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


def test_tensor_parallel_tokens_equal_one_gpu(models, tmp_path):
    """Under tp_plan="auto" on 2 GPUs each rank runs its own heads through attnlang; the tokens
    equal the 1-GPU run's."""
    import json
    import os
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the nvidia-h200-x2 machine kind)")
    model = models["llama"]
    ids = _prompts(2, PROMPT, seed=7)
    want = _generate(model, "attnlang", ids).tolist()
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "prompt.json").write_text(json.dumps(ids.tolist()))
    script = os.path.join(os.path.dirname(__file__), "tp_generate.py")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script,
         str(tmp_path / "model"), str(tmp_path / "prompt.json"), str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["local_heads"] == model.config.num_attention_heads // 2  # heads were split
    assert got["tokens"] == want
