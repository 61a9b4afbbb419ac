"""Target names (megatron-core's and Hugging Face's) and PEFT's adapter_config.json."""

from __future__ import annotations

import json

import pytest

from megatron.rl.lora.config import (
    AdapterConfigError,
    LoRAConfig,
    read_adapter_config,
    target_modules,
    target_projections,
)


@pytest.mark.parametrize(
    "names, gated, expected",
    [
        pytest.param(
            ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            True,
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            id="megatron-modules",
        ),
        pytest.param(["v_proj", "q_proj"], True, ("q_proj", "v_proj"), id="hf-aliases-in-order"),
        pytest.param(
            ["all-linear"],
            False,
            ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"),
            id="all-linear-plain-mlp",
        ),
        pytest.param(["linear_qkv", "k_proj"], True, ("q_proj", "k_proj", "v_proj"), id="overlap"),
    ],
)
def test_target_projections(names, gated, expected):
    assert target_projections(names, gated) == expected


def test_target_names_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="unknown target module 'lm_head'"):
        target_projections(["lm_head"])
    with pytest.raises(ValueError, match="gate_proj: this model's MLP has no gate"):
        target_projections(["gate_proj"], gated=False)
    with pytest.raises(ValueError, match="no target modules"):
        target_projections([])


def test_target_modules_of_projections():
    assert target_modules(["v_proj", "down_proj"]) == ("linear_qkv", "linear_fc2")


def test_config_scale_and_checks():
    assert LoRAConfig(rank=8, alpha=32.0).scale == 4.0
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoRAConfig(rank=0, alpha=1.0)
    with pytest.raises(ValueError, match="init"):
        LoRAConfig(rank=1, alpha=1.0, init="pissa")


def write(tmp_path, **fields):
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps({**base, **fields}))
    return tmp_path


def test_reads_peft_adapter_config(tmp_path):
    saved = read_adapter_config(write(tmp_path, base_model_name_or_path="/models/x"))
    assert (saved.rank, saved.alpha, saved.targets) == (4, 8.0, ("q_proj", "v_proj"))
    assert saved.base_model == "/models/x"
    assert (
        read_adapter_config(write(tmp_path, target_modules="all-linear")).targets[-1] == "down_proj"
    )
    assert not saved.rslora and read_adapter_config(write(tmp_path, use_rslora=True)).rslora


def test_rslora_scales_by_the_square_root_of_the_rank():
    assert LoRAConfig(rank=16, alpha=32.0).scale == 2.0
    assert LoRAConfig(rank=16, alpha=32.0, rslora=True).scale == 8.0


@pytest.mark.parametrize(
    "fields, message",
    [
        pytest.param({"use_dora": True}, "use_dora=True is not supported", id="dora"),
        pytest.param({"use_rslora": "yes"}, "use_rslora must be true or false", id="rslora"),
        pytest.param({"rank_pattern": {"q_proj": 8}}, "rank_pattern", id="per-module-rank"),
        pytest.param({"modules_to_save": ["lm_head"]}, "modules_to_save", id="saved-modules"),
        pytest.param({"target_modules": ".*proj"}, "as a pattern", id="regex"),
        pytest.param({"target_modules": ["embed_tokens"]}, "unknown target module", id="embedding"),
        pytest.param({"peft_type": "IA3"}, "is not LORA", id="other-method"),
        pytest.param({"r": 0}, "r must be a positive integer", id="rank-zero"),
    ],
)
def test_unsupported_adapter_configs_are_refused_naming_the_field(tmp_path, fields, message):
    with pytest.raises(AdapterConfigError, match=message) as err:
        read_adapter_config(write(tmp_path, **fields))
    assert "adapter_config.json" in str(err.value)


def test_a_directory_without_adapter_config_is_refused(tmp_path):
    with pytest.raises(AdapterConfigError, match="not a PEFT adapter directory"):
        read_adapter_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterConfigError, match="not readable JSON"):
        read_adapter_config(tmp_path)
