"""``pretrain_grpo.py`` on the CUDA tier (megatron-core DDP/optimizer, DynamicInferenceEngine).

Every test needs CUDA (``gpu`` marker); multi-GPU cases skip below their GPU count. Each run
trains the default 2-layer model for a few steps; the MoE tests use a tiny Qwen3-MoE checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from golden_values import checkpoint_of_iteration

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.gpu

BASE = [
    "--train-iters",
    "5",
    "--rl-forced-lag",
    "1",
    "--grpo-prompts-per-step",
    "4",
    "--grpo-group-size",
    "4",
    "--micro-batch-size",
    "4",
    "--lr-warmup-iters",
    "1",
    "--inference-max-requests",
    "32",
    "--seed",
    "1234",
]


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def train(nproc: int, *flags: str, timeout: float = 600) -> tuple[list[dict], str]:
    """Run pretrain_grpo.py under torchrun; its per-step metrics and its output."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--standalone",  # the launcher binds a port of the kernel's choice: no race for it
            "pretrain_grpo.py",
            *BASE,
            *flags,
            "--metrics-file",
            str(metrics),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{output[-4000:]}"
        return [json.loads(line) for line in metrics.read_text().splitlines()], output


def assert_trained(metrics: list[dict], steps: int = 5) -> None:
    """``steps`` steps, each batch trained one collection after its submission (lag 1), finite; a
    gradient wherever a group's rewards differ (a batch whose every group has equal rewards has
    zero advantages, so a zero gradient: seen on an H200, where the tiny model's rewards came out
    all equal in one of five steps), and in some step."""
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]), m
        assert m["grad_norm"] > 0 or m["zero_variance_group_fraction"] == 1.0, m
        assert m["batch_staleness"] == min(m["batch_id"], 1), m
    assert any(m["grad_norm"] > 0 for m in metrics), metrics


def test_five_steps_on_the_dynamic_engine():
    metrics, output = train(1)
    assert_trained(metrics)
    assert "tier: cuda" in output and "DynamicInferenceEngine" in output


def test_bf16_with_the_distributed_optimizer():
    metrics, output = train(1, "--bf16", "--use-distributed-optimizer")
    assert_trained(metrics)
    assert "bf16" in output and "distributed adam" in output


def test_iterations_entropy_and_is_correction():
    metrics, _ = train(
        1,
        "--grpo-iterations",
        "2",
        "--grpo-entropy-term-weight",
        "0.01",
        "--rl-inference-logprobs-is-correction",
        "--train-iters",
        "4",
        "--global-batch-size",
        "8",
    )
    assert_trained(metrics, steps=4)
    assert [m["batch_id"] for m in metrics] == [0, 0, 0, 0]  # 16 rollouts, 8 a step, 2 iterations
    assert all(m["entropy"] > 0 and math.isfinite(m["is_kl"]) for m in metrics)


def test_two_identical_runs_give_identical_rewards():
    first, _ = train(1, "--train-iters", "3")
    second, _ = train(1, "--train-iters", "3")
    assert [m["reward_mean"] for m in first] == [m["reward_mean"] for m in second]


@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_matches_tensor_parallel_1():
    tp1, _ = train(1)
    tp2, _ = train(2, "--tensor-model-parallel-size", "2")
    for a, b in zip(tp1, tp2):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-5)


@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs")
def test_data_parallel_2_matches_data_parallel_1():
    dp1, _ = train(1)
    dp2, _ = train(2)
    for a, b in zip(dp1, dp2):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-5)


def test_a_collocated_copy_at_the_training_layout_generates_as_the_trained_model():
    """A bf16 inference copy (``Float16Module``) refit after every step and verified: the
    engine on it samples what it samples on the trained model."""
    plain, _ = train(1, "--bf16", "--train-iters", "3")
    copy, _ = train(
        1,
        "--bf16",
        "--train-iters",
        "3",
        "--rl-inference-tensor-model-parallel-size",
        "1",
        "--rl-verify-model-weights-swap",
    )
    assert [m["reward_mean"] for m in copy] == [m["reward_mean"] for m in plain]
    assert all(m["refit/bytes_written"] > 0 == m["refit/bytes_received"] for m in copy)


@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs")
def test_two_tp1_copies_of_a_tp2_run_are_refit_over_nccl():
    tp2, _ = train(2, "--tensor-model-parallel-size", "2")
    copies, _ = train(
        2,
        "--tensor-model-parallel-size",
        "2",
        "--rl-inference-tensor-model-parallel-size",
        "1",
        "--rl-verify-model-weights-swap",
        "--refit-method",
        "nccl",
    )
    for a, b in zip(tp2, copies):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        assert b["refit/bytes_received"] > 0


@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs")
def test_pipeline_parallel_2_trains():
    metrics, _ = train(2, "--pipeline-model-parallel-size", "2")
    assert_trained(metrics)


def test_dist_checkpoint_resume_reproduces_the_uninterrupted_run(tmp_path):
    whole, _ = train(1, "--save", str(tmp_path / "a"), "--save-interval", "3")
    assert (tmp_path / "a" / "iter_0000003" / "metadata.json").is_file()  # dist_checkpointing
    load = checkpoint_of_iteration(tmp_path / "a", 3, tmp_path / "b")
    resumed, _ = train(1, "--load", str(load))
    assert [m["step"] for m in resumed] == [3, 4]
    for a, b in zip(whole[3:], resumed):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lr", "0.01", "--grpo-kl-beta", "0.01")


def test_lora_in_bf16_on_the_dynamic_engine_generates_with_the_adapters():
    """LoRA on the real device (Transformer Engine's fused norm-linear layers where TE is
    installed): at forced lag 0 the dynamic engine's logprobs are the trainer's pi_old up to
    bf16 kernel rounding, with adapters that move every step."""
    metrics, output = train(1, *LORA, "--bf16", "--rl-forced-lag", "0")
    assert "lora         rank 4" in output
    assert [m["step"] for m in metrics] == list(range(5))
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in metrics)
    assert max(abs(m["mismatch_kl"]) for m in metrics) < 5e-3


def test_lora_dist_checkpoint_resume_reproduces_the_uninterrupted_run(tmp_path):
    whole, _ = train(1, *LORA, "--save", str(tmp_path / "a"), "--save-interval", "3")
    load = checkpoint_of_iteration(tmp_path / "a", 3, tmp_path / "b")
    resumed, _ = train(1, *LORA, "--load", str(load))
    assert [m["step"] for m in resumed] == [3, 4]
    for a, b in zip(whole[3:], resumed):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


MOE_ENV = """\
- agent_type: digits
  env_id: copy
  agent_args: {task: copy}
  reward_funcs: [{function: regex, args: {pattern: "[a-m]"}}]
"""
"""Rewards a random tiny model earns (a letter in the completion), so updates have gradients."""


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    from megatron.rl.models.hf.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=5)


def test_moe_dynamic_engine_generates_as_the_local_engine_and_records_routes(moe_checkpoint):
    """megatron-core's engine on the MoE model: the local engine's greedy tokens, and every row's
    routes, which together match one full forward's (rounding may flip a near tie)."""
    cmd = [
        sys.executable,
        str(ROOT / "tests/grpo_testing/emulated_dynamic_engine_moe.py"),
        str(moe_checkpoint),
        "--device",
        "cuda",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    print(runs)
    assert [r["windows"] for r in runs] == [False, True]
    for run in runs:
        greedy = [same for same, g in zip(run["same_tokens"], run["greedy"]) if g]
        assert greedy and all(greedy), run
        assert all(run["routes_complete"]), run
        tokens = sum(run["lengths"]) + 4 * 6  # generated + prompt rows, about
        assert sum(run["differing_rows"]) <= 0.05 * tokens, run
    assert runs[1]["re_prefills"] > 0


def test_three_moe_steps_on_the_cuda_tier(moe_checkpoint, tmp_path):
    (tmp_path / "env.yaml").write_text(MOE_ENV)
    metrics, output = train(
        1,
        "--hf-checkpoint",
        str(moe_checkpoint),
        "--env-config",
        str(tmp_path / "env.yaml"),
        "--train-iters",
        "3",
        "--seq-length",
        "64",
        "--moe-aux-loss-coeff",
        "0.01",
        "--use-rollout-routing-replay",
    )
    assert_trained(metrics, steps=3)
    assert "tier: cuda" in output
    print("moe_routing_mismatch", [m["moe_routing_mismatch"] for m in metrics])
    for m in metrics:
        assert m["moe_aux_loss"] > 0 and math.isfinite(m["moe_aux_loss"]), m
        assert m["moe_load_imbalance"] >= 1.0, m
        assert 0.0 <= m["moe_routing_mismatch"] <= 1.0, m  # the dynamic engine's routes arrived


def test_moe_routing_replay_in_bf16_on_policy(moe_checkpoint, tmp_path):
    """bf16 at forced lag 0: the first step's pi_old is the engine's policy, so its routing and
    ratio differ from the engine's only by the forward (megatron-core's dynamic engine vs the
    training forward). Measured without replay, then replayed: the replayed step-0 mismatch KL is
    no larger."""
    (tmp_path / "env.yaml").write_text(MOE_ENV)
    common = (
        "--hf-checkpoint",
        str(moe_checkpoint),
        "--env-config",
        str(tmp_path / "env.yaml"),
        "--train-iters",
        "2",
        "--seq-length",
        "64",
        "--bf16",
        "--rl-forced-lag",
        "0",
    )
    measured, _ = train(1, *common, "--record-rollout-routing")
    replayed, _ = train(1, *common, "--use-rollout-routing-replay")
    for name, run in (("measured", measured), ("replayed", replayed)):
        print(name, [(m["moe_routing_mismatch"], m["mismatch_kl"], m["ratio_mean"]) for m in run])
    assert measured[0]["reward_mean"] == replayed[0]["reward_mean"]  # the same rollouts
    assert measured[0]["moe_routing_mismatch"] == replayed[0]["moe_routing_mismatch"]
    assert replayed[0]["mismatch_kl"] <= measured[0]["mismatch_kl"] + 1e-9
