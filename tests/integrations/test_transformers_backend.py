"""The transformers backend on the CPU: variants from configs, registration, clear errors."""

import types

import pytest

import attnlang

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnlang.integrations import transformers as alt  # noqa: E402


def _gemma2_config(**kw):
    return transformers.Gemma2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=16,
        attn_logit_softcapping=50.0, query_pre_attn_scalar=64, **kw)


def test_gemma2_layers_get_their_window_and_softcap():
    config = _gemma2_config()
    assert config.layer_types == ["sliding_attention", "full_attention"]
    sliding = attnlang.parse(alt.default_variant_source(config, "sliding_attention"))
    full = attnlang.parse(alt.default_variant_source(config, "full_attention"))
    assert dict(sliding.consts) == {"window": 16, "softcap": 50.0}
    assert dict(full.consts) == {"softcap": 50.0}
    assert "tanh" in alt.default_variant_source(config, "full_attention")


def test_llama_and_mistral():
    llama = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2)
    text = alt.default_variant_source(llama, "full_attention")
    assert text.splitlines()[1:] == ["variant llama_full_attention", "mask = causal"]
    mistral = transformers.MistralConfig(hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, sliding_window=4096)
    v = attnlang.parse(alt.default_variant_source(mistral, "full_attention"))
    assert dict(v.consts) == {"window": 4096}
    bidirectional = alt.default_variant_source(llama, "full_attention", is_causal=False)
    assert "mask" not in bidirectional


def _module(config, layer_idx=0, training=False):
    return types.SimpleNamespace(config=config, layer_idx=layer_idx, is_causal=True,
                                 training=training)


def test_variant_for_each_way_of_choosing():
    config = _gemma2_config()
    own, params = alt.variant_for(None, None, _module(config, 0))
    assert own.name == "gemma2_sliding_attention" and params == {}
    mine = attnlang.load("examples/softcap.attn")
    assert alt.variant_for(mine, {"cap": 3.0}, _module(config, 1)) == (mine, {"cap": 3.0})
    by_type = {"full_attention": mine}
    assert alt.variant_for(by_type, None, _module(config, 1))[0] is mine
    assert alt.variant_for(by_type, None, _module(config, 0))[0].name == (
        "gemma2_sliding_attention")
    pick = alt.variant_for(lambda m: (mine, {"cap": float(m.layer_idx)}), None,
                           _module(config, 1))
    assert pick == (mine, {"cap": 1.0})
    with pytest.raises(TypeError, match="must be an attnlang Variant"):
        alt.variant_for(42, None, _module(config))


def test_names_transformers_reserves_are_refused():
    with pytest.raises(ValueError, match="contains 'flash'"):
        alt.register("my_flash_attn")
    with pytest.raises(ValueError, match="contains '/'"):
        alt.register("org/kernel")


def test_register_fills_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = alt.register("attnlang_cpu_test", variant="examples/causal.attn")
    assert name in AttentionInterface._global_mapping
    assert name in AttentionMaskInterface._global_mapping
    mask_fn = AttentionMaskInterface._global_mapping[name]
    full = torch.ones(2, 6, dtype=torch.long)
    assert mask_fn(2, 6, 6, attention_mask=full) is None
    left = full.clone()
    left[1, :4] = 0
    got = mask_fn(2, 1, 4, attention_mask=left)  # a layer that sees the last 4 keys
    assert got.dtype == torch.bool and got.tolist() == [[True] * 4, [False, False, True, True]]


@pytest.mark.parametrize("problem, match", [
    (dict(dropout=0.1, training=True), "no attention dropout"),
    (dict(head_dim=96), "head_dim 64, 128 or 256"),
    (dict(head_dim=192), r"192 with values of 128 \(MLA\); this model has 192: use"),
    (dict(dtype=torch.float32), "bfloat16 or float16"),
    (dict(s_aux=torch.zeros(4)), "attention sinks"),
])
def test_what_it_cannot_do_is_named(problem, match):
    d = problem.get("head_dim", 64)
    dtype = problem.get("dtype", torch.bfloat16)
    q = torch.zeros(1, 4, 3, d, dtype=dtype)
    k = torch.zeros(1, 2, 3, d, dtype=dtype)
    module = _module(_gemma2_config(), training=problem.get("training", False))
    kwargs = {"s_aux": problem["s_aux"]} if "s_aux" in problem else {}
    with pytest.raises(alt.AttnlangUnsupported, match=match):
        alt._check_call(module, q, k, problem.get("dropout", 0.0), kwargs)


def test_mla_head_dims_are_accepted():
    q = torch.zeros(1, 4, 3, 192, dtype=torch.bfloat16)
    module = _module(_gemma2_config())
    # The head dims pass: what stops this CPU tensor is the next check, the device.
    with pytest.raises(alt.AttnlangUnsupported, match="runs on CUDA GPUs"):
        alt._check_call(module, q, q, 0.0, {}, torch.zeros(1, 4, 3, 128, dtype=torch.bfloat16))
    with pytest.raises(alt.AttnlangUnsupported, match=r"has 192 \(values 64\)"):
        alt._check_call(module, q, q, 0.0, {}, torch.zeros(1, 4, 3, 64, dtype=torch.bfloat16))


def test_a_4d_mask_is_refused_with_the_alternative():
    with pytest.raises(alt.AttnlangUnsupported, match="write custom masks as an attnlang"):
        alt._key_mask(torch.ones(1, 1, 3, 3, dtype=torch.bool), 1, 3)


def test_generate_batch_of_an_mla_model_is_refused_with_the_reason():
    # transformers' paged cache for DeepSeek-V3 is sized for latents (64 per head), its
    # attention hands over keys of 192 and values of 128: say so rather than fail deep inside.
    cache = types.SimpleNamespace(layer_index_to_group_indices={0: (0, 0)},
                                  key_cache=[torch.zeros(8, 4, 64)],
                                  value_cache=[torch.zeros(8, 4, 64)])
    kwargs = {"cache": cache, "read_index": [torch.arange(3)], "write_index": [torch.arange(3)],
              "cu_seq_lens_q": torch.tensor([0, 3]), "cu_seq_lens_k": torch.tensor([0, 3])}
    q = torch.zeros(1, 4, 3, 192, dtype=torch.bfloat16)
    v = torch.zeros(1, 4, 3, 128, dtype=torch.bfloat16)
    with pytest.raises(alt.AttnlangUnsupported, match=r"paged cache holds keys and values of "
                                                      r"64 and 64.*generate_batch\(\) cannot"):
        alt._paged_attention(types.SimpleNamespace(layer_idx=0), q, q, v, None, None, None,
                             kwargs)
