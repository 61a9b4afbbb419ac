"""``config.json`` -> ``GPTArchitecture`` on the published configs of each family, and refusals."""

from __future__ import annotations

import pytest

from megatron.rl.models.architecture import RopeScaling
from megatron.rl.models.hf import HFCheckpointError, hf_config_dict
from megatron.rl.models.hf.config import check_family, hf_model_config

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "vocab_size": 32000,
}
QWEN_2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN_3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B_V0_3 = {
    "architectures": ["MistralForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "vocab_size": 32768,
}


def test_llama_3_1():
    hf = hf_model_config(LLAMA_3_1_8B)
    a = hf.arch
    assert hf.family == "llama" and hf.vocab_size == 128256 and hf.dtype == "bfloat16"
    assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.ffn_hidden_size) == (
        32,
        4096,
        32,
        14336,
    )
    assert (a.num_query_groups, a.kv_channels, a.head_dim) == (8, None, 128)
    assert a.position_embedding_type == "rope" and a.rotary_base == 500000.0
    assert a.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert (a.normalization, a.norm_epsilon, a.swiglu) == ("RMSNorm", 1e-5, True)
    assert not (a.add_bias_linear or a.add_qkv_bias or a.qk_layernorm)
    assert a.untie_embeddings_and_output_weights and a.vocab_size == 128256


def test_llama_3_2_scaling_factor_and_transformers_5_rope_parameters():
    cfg = {k: v for k, v in LLAMA_3_1_8B.items() if k not in ("rope_scaling", "rope_theta")}
    cfg["rope_parameters"] = {**LLAMA_3_1_8B["rope_scaling"], "factor": 32.0, "rope_theta": 5e5}
    a = hf_model_config(cfg).arch
    assert a.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192) and a.rotary_base == 5e5


def test_llama_2_is_plain_mha_rope():
    a = hf_model_config(LLAMA_2_7B).arch
    assert a.num_query_groups is None and a.rope_scaling is None and a.rotary_base == 10000.0
    assert a.untie_embeddings_and_output_weights  # transformers' default: untied


def test_qwen2_has_qkv_bias_only_and_tied_embeddings():
    hf = hf_model_config(QWEN_2_5_0_5B)
    a = hf.arch
    assert (a.add_qkv_bias, a.add_bias_linear, a.qk_layernorm) == (True, False, False)
    assert not a.untie_embeddings_and_output_weights
    assert hf.vocab_size == 151936 and a.vocab_size == 151936 and a.num_query_groups == 2


def test_qwen3_qk_norm_and_a_head_dim_other_than_hidden_over_heads():
    a = hf_model_config(QWEN_3_0_6B).arch
    assert a.qk_layernorm and a.kv_channels == 128 and a.head_dim == 128
    assert a.hidden_size // a.num_attention_heads == 64
    no_head_dim = {k: v for k, v in QWEN_3_0_6B.items() if k != "head_dim"}
    assert hf_model_config(no_head_dim).arch.head_dim == 128  # Qwen3Config's default


def test_mistral_without_window_and_window_covering_every_position():
    assert hf_model_config(MISTRAL_7B_V0_3).arch.num_query_groups == 8
    hf_model_config({**MISTRAL_7B_V0_3, "sliding_window": 32768})


@pytest.mark.parametrize(
    "cfg, field",
    [
        pytest.param({**MISTRAL_7B_V0_3, "sliding_window": 4096}, "sliding_window", id="mistral"),
        pytest.param(
            {k: v for k, v in MISTRAL_7B_V0_3.items() if k != "sliding_window"},
            "sliding_window",
            id="mistral-default-4096",
        ),
        pytest.param(
            {
                **QWEN_2_5_0_5B,
                "use_sliding_window": True,
                "sliding_window": 4096,
                "max_window_layers": 21,
            },
            "sliding_window",
            id="qwen2",
        ),
        pytest.param(
            {**LLAMA_3_1_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_scaling.rope_type: 'yarn'",
            id="yarn",
        ),
        pytest.param(
            {**LLAMA_2_7B, "rope_scaling": {"type": "linear", "factor": 2.0}},
            "rope_scaling.rope_type: 'linear'",
            id="legacy-linear",
        ),
        pytest.param(
            {**LLAMA_3_1_8B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling: rope_type 'llama3' needs 'low_freq_factor'",
            id="llama3-incomplete",
        ),
        pytest.param({**LLAMA_2_7B, "attention_bias": True}, "attention_bias", id="bias-attn-only"),
        pytest.param({**QWEN_3_0_6B, "attention_bias": True}, "attention_bias", id="qwen3-bias"),
        pytest.param({**LLAMA_2_7B, "hidden_act": "gelu"}, "hidden_act", id="gelu"),
        pytest.param(
            {**LLAMA_2_7B, "partial_rotary_factor": 0.5}, "partial_rotary_factor", id="partial"
        ),
        pytest.param(
            {k: v for k, v in LLAMA_2_7B.items() if k != "intermediate_size"},
            "intermediate_size",
            id="missing-field",
        ),
        pytest.param(
            {**LLAMA_2_7B, "head_dim": 99, "num_key_value_heads": 8},
            "architecture: GPTArchitecture.rotary_percent",
            id="odd-rotary",
        ),
        pytest.param({**LLAMA_2_7B, "num_key_value_heads": 5}, "num_key_value_heads", id="bad-gqa"),
        pytest.param(
            {**LLAMA_2_7B, "architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel", id="arch"
        ),
        pytest.param({**LLAMA_2_7B, "architectures": None}, "architectures", id="no-arch"),
    ],
)
def test_refused_configs_name_the_file_and_field(cfg, field):
    with pytest.raises(HFCheckpointError) as err:
        hf_model_config(cfg, source="/ckpt/config.json")
    assert str(err.value).startswith("/ckpt/config.json: ")
    assert field in str(err.value)


def test_llama_with_biases_everywhere_is_add_bias_linear():
    a = hf_model_config({**LLAMA_2_7B, "attention_bias": True, "mlp_bias": True}).arch
    assert a.add_bias_linear and not a.add_qkv_bias


def test_vocabulary_is_padded_for_the_embedding_table():
    hf = hf_model_config({**LLAMA_2_7B, "vocab_size": 50257}, make_vocab_size_divisible_by=128)
    assert (hf.vocab_size, hf.arch.vocab_size) == (50257, 50304)


@pytest.mark.parametrize(
    "cfg", [LLAMA_3_1_8B, LLAMA_2_7B, QWEN_2_5_0_5B, QWEN_3_0_6B, MISTRAL_7B_V0_3]
)
def test_written_config_reads_back_to_the_same_architecture(cfg):
    hf = hf_model_config(cfg)
    written = hf_config_dict(hf.arch, hf.family, hf.vocab_size, "bfloat16", 1, [2, 3])
    assert written["architectures"] == cfg["architectures"]
    again = hf_model_config(written)
    assert (again.family, again.arch, again.vocab_size) == (hf.family, hf.arch, hf.vocab_size)
    assert (again.dtype, again.bos_token_id, again.eos_token_id) == ("bfloat16", 1, [2, 3])


def test_architectures_another_family_cannot_express_are_refused_by_field():
    qwen3 = hf_model_config(QWEN_3_0_6B).arch
    with pytest.raises(ValueError, match=r"GPTArchitecture\.qk_layernorm=True .* LlamaForCausalLM"):
        check_family(qwen3, "llama")
    qwen2 = hf_model_config(QWEN_2_5_0_5B).arch
    with pytest.raises(ValueError, match=r"GPTArchitecture\.add_qkv_bias=True .* Mistral"):
        check_family(qwen2, "mistral")
    with pytest.raises(ValueError, match="family 'gpt2'"):
        check_family(qwen2, "gpt2")
