"""The LoRA options: resolved to one spelling, adopted from --lora-checkpoint, refused with a
message naming the flag when they do not fit."""

from __future__ import annotations

import json

import pytest

from megatron.trainer.config import lora_config
from megatron.trainer.flags.parse import check

SWIGLU = ["--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope"]


def test_lora_is_off_by_default():
    args, errors = check([], 1, False)
    assert errors == [] and not args.lora.enabled and lora_config(args) is None


def test_rank_turns_it_on_with_alpha_32_and_targets_as_projections():
    args, errors = check(["--lora-rank", "8", *SWIGLU], 1, False)
    assert errors == []
    assert (args.lora.lora_rank, args.lora.lora_alpha) == (8, 32.0)
    assert args.lora.lora_target_modules == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    config = lora_config(args)
    assert config.scale == 4.0 and config.seed == args.training.seed
    rslora, errors = check(["--lora-rank", "16", "--lora-use-rslora", *SWIGLU], 1, False)
    assert errors == [] and lora_config(rslora).scale == 8.0


def test_a_plain_mlp_has_no_gate():
    args, errors = check(["--lora-rank", "2", "--lora-target-modules", "linear_fc1"], 1, False)
    assert errors == [] and args.lora.lora_target_modules == ("up_proj",)
    _, errors = check(["--lora-rank", "2", "--lora-target-modules", "gate_proj"], 1, False)
    assert errors == ["--lora-target-modules: gate_proj: this model's MLP has no gate (not SwiGLU)"]


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(
            ["--lora-rank", "4", "--lora-dropout", "0.1"],
            "--lora-dropout 0.1: only 0",
            id="dropout",
        ),
        pytest.param(
            ["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0", id="alpha"
        ),
        pytest.param(
            ["--lora-alpha", "16"], "--lora-alpha need --lora-rank > 0", id="alpha-without-rank"
        ),
        pytest.param(
            ["--save-lora", "x"], "--save-lora need --lora-rank > 0", id="save-without-rank"
        ),
        pytest.param(
            ["--lora-rank", "4", "--num-experts", "4", "--disable-bias-linear"],
            "mixture-of-experts model are experts",
            id="moe-mlp",
        ),
        pytest.param(["--lora-rank", "-1"], "--lora-rank must be >= 0", id="negative-rank"),
    ],
)
def test_bad_lora_options_are_refused_naming_the_flag(argv, message):
    _, errors = check(argv, 1, False)
    assert any(message in e for e in errors), errors


def test_moe_attention_adapters_are_fine():
    argv = ["--lora-rank", "4", "--num-experts", "4", "--disable-bias-linear"]
    _, errors = check([*argv, "--lora-target-modules", "linear_qkv", "linear_proj"], 1, False)
    assert errors == []


def adapter_dir(tmp_path, **fields):
    config = {
        "peft_type": "LORA",
        "r": 16,
        "lora_alpha": 32,
        "target_modules": ["q_proj", "v_proj"],
    }
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return str(tmp_path)


def test_lora_checkpoint_sets_rank_alpha_and_targets(tmp_path):
    args, errors = check(["--lora-checkpoint", adapter_dir(tmp_path), *SWIGLU], 1, False)
    assert errors == []
    lora = args.lora
    assert (lora.lora_rank, lora.lora_alpha, lora.lora_target_modules) == (
        16,
        32.0,
        ("q_proj", "v_proj"),
    )
    assert not lora.lora_use_rslora
    rslora, errors = check(
        ["--lora-checkpoint", adapter_dir(tmp_path, use_rslora=True), *SWIGLU], 1, False
    )
    assert errors == [] and rslora.lora.lora_use_rslora and lora_config(rslora).scale == 8.0


def test_flags_contradicting_the_lora_checkpoint_are_refused_naming_both(tmp_path):
    directory = adapter_dir(tmp_path)
    _, errors = check(["--lora-checkpoint", directory, "--lora-rank", "8"], 1, False)
    assert errors == [
        f"--lora-rank 8 conflicts with --lora-checkpoint {directory} (adapter_config.json gives "
        "16); drop the flag"
    ]
    _, errors = check(
        ["--lora-checkpoint", directory, "--lora-target-modules", "linear_qkv"], 1, False
    )
    assert len(errors) == 1 and "--lora-target-modules linear_qkv conflicts" in errors[0]
    _, errors = check(["--lora-checkpoint", directory, "--lora-rank", "16"], 1, False)
    assert errors == []  # agreeing is fine


def test_an_unreadable_lora_checkpoint_is_refused(tmp_path):
    _, errors = check(["--lora-checkpoint", str(tmp_path)], 1, False)
    assert errors == [
        f"--lora-checkpoint: {tmp_path}: no adapter_config.json (not a PEFT adapter directory)"
    ]
