"""MoE end to end: pretrain_grpo.py on a tiny random Qwen3-MoE checkpoint (4 experts, top 2) with
the load-balancing aux loss and rollout routing replay, 4 steps at forced lag 2 on the default
digits task: finite loss, exact staleness, the MoE metrics, bitwise equal metrics across reruns.
Slow: a tiny MoE with routing replay learns the digit task (the default learning bar)."""

from __future__ import annotations

import math
import statistics

import pytest
from golden_values import run_training

from megatron.rl.models.hf.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=5)
    args = {
        "hf-checkpoint": checkpoint,
        "rl-forced-lag": 2,
        "train-iters": 4,
        "lr-warmup-iters": 1,
        "seq-length": 64,
        "grpo-prompts-per-step": 2,
        "grpo-group-size": 2,
        "micro-batch-size": 2,
        "seed": 1234,
        "moe-aux-loss-coeff": 0.01,
        "use-rollout-routing-replay": True,
    }
    return run_training(1, args), run_training(1, args)


def test_moe_run_trains_with_exact_staleness_and_reports_the_aux_loss(runs):
    first, _ = runs
    assert [m["step"] for m in first] == [0, 1, 2, 3]
    for m in first:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert m["staleness_min"] == m["staleness_max"] == min(m["step"], 2)
        assert 0.0 <= m["moe_routing_mismatch"] <= 1.0  # the engine's routes reached the update
        assert m["moe_aux_loss"] > 0 and math.isfinite(m["moe_aux_loss"])
        assert m["moe_load_imbalance"] >= 1.0


def test_moe_metrics_are_bitwise_equal_across_reruns(runs):
    first, again = runs
    varying = ("seconds", "_per_s", "timestamp")
    keys = [k for k in first[0] if not any(v in k for v in varying)]
    assert {"moe_aux_loss", "moe_routing_mismatch", "loss"} <= set(keys)
    for key in keys:
        assert [m.get(key) for m in again] == [m[key] for m in first], key


TINY_MOE = {
    "num-experts": 4,
    "moe-router-topk": 2,
    "disable-bias-linear": True,
    "moe-aux-loss-coeff": 0.01,
}
"""The default char-level model with 4 routed experts (top 2) in every layer."""


@pytest.mark.slow
def test_a_tiny_moe_with_routing_replay_learns_the_digit_task():
    """The default run (digits, forced lag 2, 1000 steps) with every MLP an MoE layer and rollout
    routing replay on: the default learning bar (last-10 reward >= 0.5 and >= 2x the first 10),
    exact staleness, and the engine's routes reaching every update (moe_routing_mismatch is
    logged; it measures the trainer's own routing before the replay)."""
    args = {**TINY_MOE, "rl-forced-lag": 2, "use-rollout-routing-replay": True, "seed": 1234}
    metrics = run_training(1, args, timeout=900)
    rewards = [m["reward_mean"] for m in metrics]
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    mismatch = [m["moe_routing_mismatch"] for m in metrics]
    print(
        f"tiny MoE + R3: {len(metrics)} steps, reward first-10 {first:.3f} last-10 {last:.3f}, "
        f"routing mismatch mean {statistics.fmean(mismatch):.4f} max {max(mismatch):.4f}"
    )
    assert len(metrics) == 1000 and last >= 0.5 and last >= 2 * first
    assert all(m["staleness_min"] == m["staleness_max"] == min(m["step"], 2) for m in metrics)
    assert all(0.0 <= x <= 1.0 for x in mismatch)
