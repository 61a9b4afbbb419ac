"""MoE end to end: pretrain_grpo.py on a tiny random Qwen3-MoE checkpoint (4 experts, top 2) with
the load-balancing aux loss, 3 steps at forced lag 1 on the default digits task: finite loss,
exact staleness, the MoE metrics, bitwise equal metrics across reruns."""

from __future__ import annotations

import math

import pytest
from golden_values import run_training

from megatron.rl.models.hf.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=5)
    args = {
        "hf-checkpoint": checkpoint, "rl-forced-lag": 1, "train-iters": 3,
        "lr-warmup-iters": 1, "seq-length": 64, "grpo-prompts-per-step": 2,
        "grpo-group-size": 2, "micro-batch-size": 2, "seed": 1234, "moe-aux-loss-coeff": 0.01,
    }  # fmt: skip
    return run_training(1, args), run_training(1, args)


def test_moe_run_trains_with_exact_staleness_and_reports_the_aux_loss(runs):
    first, _ = runs
    assert [m["step"] for m in first] == [0, 1, 2]
    for m in first:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert m["staleness_min"] == m["staleness_max"] == min(m["step"], 1)
        assert m["moe_aux_loss"] > 0 and math.isfinite(m["moe_aux_loss"])
        assert m["moe_load_imbalance"] >= 1.0


def test_moe_metrics_are_bitwise_equal_across_reruns(runs):
    first, again = runs
    varying = ("seconds", "_per_s", "timestamp")
    keys = [k for k in first[0] if not any(v in k for v in varying)]
    assert "moe_aux_loss" in keys and "loss" in keys
    for key in keys:
        assert [m.get(key) for m in again] == [m[key] for m in first], key
