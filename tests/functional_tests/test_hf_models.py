"""Hugging Face models through torchrun: a tiny Qwen2 checkpoint on GSM8K-format chat prompts with
exact lag, trained at TP=2 and exported, and (slow) a Llama-shaped random model with a trained BPE
tokenizer that learns."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
from golden_values import run_training

from megatron.rl.models.hf.tiny import train_tokenizer
from megatron.rl.tokenizer import DEFAULT_ALPHABET

LLAMA_SHAPED = {
    "position-embedding-type": "rope",
    "normalization": "RMSNorm",
    "swiglu": True,
    "disable-bias-linear": True,
    "group-query-attention": True,
    "num-query-groups": 2,
}


def test_a_hugging_face_checkpoint_trains_at_tp2_with_exact_lag_and_exports(
    tiny_hf_checkpoints, tmp_path
):
    import torch
    import transformers

    args = {
        "hf-checkpoint": tiny_hf_checkpoints["qwen2"],
        "tensor-model-parallel-size": 2,
        "rl-forced-lag": 2,
        "train-iters": 6,
        "lr-warmup-iters": 1,
        "grpo-prompts-per-step": 4,
        "grpo-group-size": 4,
        "micro-batch-size": 8,
        "save-hf": tmp_path / "out",
    }
    metrics = run_training(2, args)
    assert [m["staleness_max"] for m in metrics] == [min(s, 2) for s in range(6)]
    assert all(m["staleness_min"] == m["staleness_max"] for m in metrics)
    assert sum(m["completion_tokens_mean"] > 0 for m in metrics) == 6
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 30, 31, 32]])).logits
    assert torch.isfinite(logits).all()


LETTER_REWARD = """\
- agent_type: digits
  env_id: copy
  agent_args: {task: copy}
  reward_funcs: [{function: regex, args: {pattern: "[a-m]"}}]
"""
"""Digit prompts rewarded for a letter in the completion: a random tiny model earns rewards that
differ within groups, so every update has a policy gradient."""


def test_a_qwen3_checkpoint_trains_at_tp2_as_at_tp1(tiny_hf_checkpoints, tmp_path):
    """A checkpoint-loaded model at TP=2 takes the TP=1 model's steps. Two things make that so
    (each one alone measured: step-0 gradient norms 2.56 and 2.66 against 3.36 and 2.84):

    * its TP shards carry megatron-core's tensor-parallel tags although it was built without
      random init, so the gradient norm (and the clip) counts every shard;
    * Qwen3 normalizes each query and key head with one shared weight: each TP rank's heads give
      part of its gradient, which the CPU tier sums over TP (as megatron-core's
      finalize_model_grads does on CUDA); otherwise the ranks' copies would diverge."""
    config = tmp_path / "letters.yaml"
    config.write_text(LETTER_REWARD)
    args = {
        "hf-checkpoint": tiny_hf_checkpoints["qwen3"],
        "env-config": config,
        "rl-forced-lag": 0,
        "train-iters": 4,
        "lr-warmup-iters": 1,
        "lr": 3e-3,
        "grpo-prompts-per-step": 2,
        "grpo-group-size": 4,
        "micro-batch-size": 4,
    }
    tp1 = run_training(1, args)
    tp2 = run_training(2, {**args, "tensor-model-parallel-size": 2})
    assert any(m["grad_norm"] > 0 for m in tp1)
    for a, b in zip(tp1, tp2):
        assert b["reward_mean"] == a["reward_mean"], a["step"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6), a["step"]
    # The gradients of steps 0 and 1 (the second after one update, which must then have been the
    # same) agree to float rounding. Later ones need not: Adam's first steps move each weight by
    # about lr x sign(gradient), so gradient elements at rounding level, whose sign differs
    # between the layouts' reduction orders, become full-size steps of either sign (measured on an
    # AMD EPYC: steps 2 and 3 apart by 2% and 30%; equal on Intel's AMX kernels).
    for a, b in zip(tp1[:2], tp2[:2]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]


GSM8K_CONFIG = """
- agent_type: examples.rl.environments.gsm8k:GSM8KEnvironment
  env_id: gsm8k
  agent_args:
    data_files: examples/rl/environments/gsm8k/gsm8k_sample.jsonl
    prompt_style: chat
    max_tokens: 16
"""


def test_a_qwen2_checkpoint_trains_on_gsm8k_chat_prompts_with_exact_lag(
    tiny_hf_checkpoints, tmp_path
):
    pytest.importorskip("math_verify")
    config = tmp_path / "gsm8k.yaml"
    config.write_text(GSM8K_CONFIG)
    args = {
        "hf-checkpoint": tiny_hf_checkpoints["qwen2"],
        "env-config": config,
        "rl-forced-lag": 2,
        "train-iters": 20,
        "lr-warmup-iters": 1,
        "seq-length": 256,
        "grpo-prompts-per-step": 4,
        "grpo-group-size": 4,
        "micro-batch-size": 8,
    }
    metrics = run_training(1, args)
    assert [m["step"] for m in metrics] == list(range(20))
    for m in metrics:
        assert m["staleness_min"] == m["staleness_max"] == min(m["step"], 2)
        assert m["placeholder_rollouts"] == 0  # the chat template rendered every prompt
        assert 0 <= m["reward_mean"] <= 1


def char_bpe_tokenizer(directory: Path) -> Path:
    """A BPE tokenizer trained on digit strings over the digit tasks' characters (40 ids)."""
    rng = random.Random(0)
    corpus = [
        "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4))) for _ in range(3000)
    ]
    train_tokenizer([*corpus, DEFAULT_ALPHABET], vocab_size=40, byte_level=False).save_pretrained(
        directory
    )
    return directory


@pytest.mark.slow
def test_a_llama_shaped_model_with_a_trained_bpe_tokenizer_learns_the_digit_task(tmp_path):
    """Random init, RoPE + RMSNorm + SwiGLU + GQA, no biases, the HF tokenizer path: the default
    run's learning bar (last-10 reward >= 0.5 and >= 2x the first 10)."""
    tokenizer = char_bpe_tokenizer(tmp_path / "tokenizer")
    args = {
        **LLAMA_SHAPED,
        "tokenizer-model": tokenizer,
        "rl-forced-lag": 2,
        "lr": 1e-3,
        "min-lr": 1e-4,
    }
    metrics = run_training(1, args, timeout=900)
    rewards = [m["reward_mean"] for m in metrics]
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    print(
        f"llama-shaped + BPE: {len(metrics)} steps, reward first-10 {first:.3f} last-10 {last:.3f}"
    )
    assert len(metrics) == 1000 and last >= 0.5 and last >= 2 * first
    assert all(m["staleness_min"] == m["staleness_max"] == min(m["step"], 2) for m in metrics)


@pytest.mark.slow
def test_smollm2_trains_on_arithmetic_with_exact_staleness_and_exports(
    smollm2_checkpoint, tmp_path
):
    """The real pretrained model (SmolLM2-135M-Instruct), bfloat16 with layer recompute, on the
    arithmetic chat task at forced lag 1: exact staleness, rewards from real answers, and an export
    that transformers loads with the trained (changed) weights."""
    pytest.importorskip("math_verify")
    import torch
    import transformers
    from safetensors.torch import load_file

    args = {
        "hf-checkpoint": smollm2_checkpoint,
        "env-config": "examples/rl/environment_configs/arithmetic.yaml",
        "seq-length": 256,
        "bf16": True,
        "recompute-granularity": "full",
        "rl-forced-lag": 1,
        "train-iters": 3,
        "lr": 1e-5,
        "lr-warmup-iters": 0,
        "grpo-prompts-per-step": 2,
        "grpo-group-size": 4,
        "micro-batch-size": 4,
        "save-hf": tmp_path / "out",
    }
    metrics = run_training(1, args, timeout=900)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["staleness_min"] == m["staleness_max"] == min(m["step"], 1)
        assert m["token_staleness_max"] <= 1
        assert m["placeholder_rollouts"] == 0  # every chat prompt rendered and scored
        assert m["mismatch_kl"] < 0.01  # the bfloat16 engine and trainer agree
    original = load_file(smollm2_checkpoint / "model.safetensors")
    trained = load_file(tmp_path / "out" / "model.safetensors")
    assert set(trained) == set(original)
    assert any(not torch.equal(trained[k], v) for k, v in original.items())
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 9690, 198]])).logits
    assert torch.isfinite(logits).all()
