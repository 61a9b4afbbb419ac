"""LoRA on the CUDA tier, emulated on the CPU (``grpo_testing/emulated_cuda.py``): megatron-core's
DDP and optimizer train only the adapters, its ``DynamicInferenceEngine`` generates through the
adapters' forward hooks, the KL term's reference is the base (adapters off), and a
``dist_checkpointing`` checkpoint of the adapters resumes exactly; the runs equal the CPU tier's.
"""

from __future__ import annotations

import math

import pytest
from golden_values import TOLERANCES, checkpoint_of_iteration, run_training
from test_cuda_tier_emulated import EMULATED, assert_same_run

LORA = {
    "train-iters": 3,
    "lr-warmup-iters": 1,
    "seed": 1234,
    "lr": 0.01,
    "lora-rank": 4,
    "lora-alpha": 8,
    "grpo-kl-beta": 0.01,
}


@pytest.fixture(scope="module")
def cpu_lora_run():
    return run_training(1, {**LORA, "rl-forced-lag": 0})


@pytest.mark.parametrize(
    "nproc, layout",
    [
        pytest.param(1, {}, id="one-process"),
        pytest.param(2, {"tensor-model-parallel-size": 2}, id="tp2"),
    ],
)
def test_lora_runs_match_the_cpu_tier(cpu_lora_run, nproc, layout):
    cuda = run_training(nproc, {**LORA, "rl-forced-lag": 0, **layout}, script=EMULATED)
    assert_same_run(cpu_lora_run, cuda)
    assert all(abs(m["mismatch_kl"]) < 1e-6 for m in cuda)  # the engine used the adapters


def test_lora_in_bf16_trains_with_exact_lag():
    """bf16 (Float16Module casts the adapters too; megatron-core's optimizer keeps float32 main
    copies of them only) at forced lag 1."""
    cuda = run_training(1, {**LORA, "rl-forced-lag": 1, "bf16": True}, script=EMULATED)
    assert [m["staleness_max"] for m in cuda] == [0, 1, 1]
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in cuda)


def test_dist_checkpoint_of_the_adapters_resumes_exactly(tmp_path):
    args = {**LORA, "train-iters": 4, "rl-forced-lag": 1}
    whole = run_training(1, {**args, "save": tmp_path / "a", "save-interval": 2}, script=EMULATED)
    load = checkpoint_of_iteration(tmp_path / "a", 2, tmp_path / "b")
    size = sum(p.stat().st_size for p in load.rglob("*.distcp"))
    assert (
        size < 500_000
    )  # adapters (9k parameters) and their AdamW moments; the base (0.12M) x 3: 1.4 MB
    resumed = run_training(1, {**args, "load": load}, script=EMULATED)
    assert [m["step"] for m in resumed] == [2, 3]
    for a, b in zip(whole[2:], resumed):
        assert {k: b[k] for k in TOLERANCES} == {k: a[k] for k in TOLERANCES}
