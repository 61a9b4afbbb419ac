"""The training loop on the CUDA tier, emulated on the CPU, against the CPU tier.

``grpo_testing/emulated_cuda_train.py`` runs ``pretrain_grpo.py``'s loop with ``CUDATier``:
megatron-core ``DistributedDataParallel``, ``get_megatron_optimizer`` (also bf16 and the distributed
optimizer), ``get_forward_backward_func`` (also the 1F1B pipeline schedule), rollouts from
megatron-core's ``DynamicInferenceEngine`` with the ``flash_reference`` attention and
``dist_checkpointing`` save/resume, all on a CPU-only torch (``grpo_testing/emulated_cuda.py``).
Without a GPU this is what shows that the tier is wired into the loop and computes what the CPU tier
computes; the ``gpu`` tests in ``test_cuda_tier.py`` run the real thing.
"""

from __future__ import annotations

import math

import pytest
from golden_values import TOLERANCES, checkpoint_of_iteration, run_training

EMULATED = "tests/grpo_testing/emulated_cuda_train.py"
BASE = {"train-iters": 3, "lr-warmup-iters": 1, "seed": 1234}
SAME = {"reward_mean": 1e-9, "reward_std": 1e-9, "loss": 1e-4, "grad_norm": 1e-5}
"""Metric -> relative tolerance between the tiers (rewards: the same tokens; the rest: float
rounding of megatron-core's fused/bucketed gradient path vs the CPU tier's)."""


def assert_same_run(cpu: list[dict], cuda: list[dict]) -> None:
    steps = [m["step"] for m in cpu]
    assert [m["step"] for m in cuda] == steps == list(range(len(steps))) and len(steps) >= 3
    for a, b in zip(cpu, cuda):
        for metric, rel in SAME.items():
            assert b[metric] == pytest.approx(a[metric], rel=rel, abs=1e-7), (a["step"], metric)
        for metric in ("staleness_max", "token_staleness_mean", "lr"):
            assert b[metric] == a[metric], (a["step"], metric)


@pytest.fixture(scope="module")
def cpu_runs():
    return {lag: run_training(1, {**BASE, "rl-forced-lag": lag}) for lag in (0, 1)}


@pytest.mark.parametrize(
    "nproc, layout",
    [
        pytest.param(1, {}, id="one-process"),
        pytest.param(2, {"tensor-model-parallel-size": 2}, id="tp2"),
        pytest.param(2, {}, id="dp2"),
    ],
)
def test_synchronous_runs_match_the_cpu_tier(cpu_runs, nproc, layout):
    cuda = run_training(nproc, {**BASE, "rl-forced-lag": 0, **layout}, script=EMULATED)
    assert_same_run(cpu_runs[0], cuda)


def test_forced_lag_matches_the_cpu_tier_when_the_kv_cache_is_kept(cpu_runs):
    args = {**BASE, "rl-forced-lag": 1, "keep-kv-between-windows": True}
    assert_same_run(cpu_runs[1], run_training(1, args, script=EMULATED))


def test_forced_lag_with_re_prefill_keeps_the_lag_contract(cpu_runs):
    """The default suspends megatron-core's engine during training: requests that span a window
    are re-prefilled under the new weights, so their later tokens differ from the CPU tier's."""
    cuda = run_training(1, {**BASE, "rl-forced-lag": 1}, script=EMULATED)
    assert cuda[0]["reward_mean"] == cpu_runs[1][0]["reward_mean"]  # one window: identical
    assert [m["staleness_max"] for m in cuda] == [m["staleness_min"] for m in cuda] == [0, 1, 1]
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in cuda)


@pytest.mark.parametrize(
    "nproc, flags",
    [
        pytest.param(1, {"bf16": True, "use-distributed-optimizer": True}, id="bf16-dist-opt"),
        pytest.param(2, {"pipeline-model-parallel-size": 2}, id="pp2"),
    ],
)
def test_cuda_only_layouts_train_with_exact_lag(nproc, flags):
    """bf16, the distributed optimizer and PP have no CPU-tier twin (PP stages initialize their
    layers from their own RNG stream, so PP=2 starts from other weights than PP=1)."""
    cuda = run_training(nproc, {**BASE, "rl-forced-lag": 1, **flags}, script=EMULATED)
    assert [m["staleness_max"] for m in cuda] == [0, 1, 1]
    for m in cuda:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        assert 0.0 <= m["reward_mean"] <= 1.0


def test_dist_checkpoint_resume_continues_the_run_exactly(tmp_path):
    args = {**BASE, "train-iters": 4, "rl-forced-lag": 1}
    whole = run_training(1, {**args, "save": tmp_path / "a", "save-interval": 2}, script=EMULATED)
    assert (tmp_path / "a" / "iter_0000002" / "metadata.json").is_file()  # torch_dist format
    load = checkpoint_of_iteration(tmp_path / "a", 2, tmp_path / "b")
    resumed = run_training(1, {**args, "load": load}, script=EMULATED)
    assert [m["step"] for m in resumed] == [2, 3]
    for a, b in zip(whole[2:], resumed):
        assert {k: b[k] for k in TOLERANCES} == {k: a[k] for k in TOLERANCES}


def test_step_options_match_the_cpu_tier():
    """--grpo-iterations with several global batches per collection (pi_old computed forward
    only before the first update), the entropy term and the IS correction: as on the CPU tier."""
    options = {
        "rl-forced-lag": 1, "keep-kv-between-windows": True, "grpo-iterations": 2,
        "grpo-entropy-term-weight": 0.01, "rl-inference-logprobs-is-correction": True,
        "train-iters": 4, "global-batch-size": 32,  # 4 iterations per collection: pi_old up front
    }  # fmt: skip
    cpu = run_training(1, {**BASE, **{k: v for k, v in options.items() if "kv" not in k}})
    cuda = run_training(1, {**BASE, **options}, script=EMULATED)
    assert_same_run(cpu, cuda)
    for a, b in zip(cpu, cuda):
        for metric in ("entropy", "is_kl", "is_abs_delta_p", "is_weight_mean", "ratio_mean"):
            assert b[metric] == pytest.approx(a[metric], rel=1e-4, abs=1e-7), (a["step"], metric)
