"""The example env configs of examples/rl/ train end to end: 3 steps of pretrain_grpo.py each."""

from __future__ import annotations

import math

import pytest
from golden_values import run_training

ARGS = {
    "rl-forced-lag": 1,
    "train-iters": 3,
    "lr-warmup-iters": 1,
    "grpo-prompts-per-step": 4,
    "grpo-group-size": 4,
    "micro-batch-size": 16,
    "seed": 1234,
}


@pytest.mark.parametrize(
    "config, env_ids",
    [
        pytest.param("countdown", ["countdown"], id="countdown"),
        pytest.param("math", ["math"], id="math"),
        pytest.param("mixture", ["copy", "countdown", "math"], id="mixture"),
    ],
)
def test_example_env_config_trains(config, env_ids):
    env_config = f"examples/rl/environment_configs/{config}.yaml"
    metrics = run_training(1, {**ARGS, "env-config": env_config})
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["placeholder_rollouts"] == 0  # every prompt fits and every reward is computed
        assert m["staleness_max"] == min(m["step"], 1)
        assert math.isfinite(m["loss"])
        assert 0.0 <= m["reward_mean"] <= 1.0
        for env_id in env_ids:  # 2:1:1 over 4 groups: every env serves every batch
            assert 0.0 <= m[f"reward_mean/{env_id}"] <= 1.0
