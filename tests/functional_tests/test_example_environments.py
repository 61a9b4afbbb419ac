"""The example env configs of examples/rl/ train end to end: 3 steps of pretrain_grpo.py each."""

from __future__ import annotations

import math

import pytest
from golden_values import ROOT, run_training

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


def test_weighted_reward_functions_are_logged_by_name():
    """weighted_rewards.yaml: the reward is the weighted sum of five functions (so it may be
    negative), each logged as reward/math/<name>."""
    env_config = "examples/rl/environment_configs/weighted_rewards.yaml"
    metrics = run_training(1, {**ARGS, "env-config": env_config})
    weights = {
        "correct": 1.0,
        "number": 0.1,
        "soft_overlong_punishment": 0.5,
        "length_match": 0.1,
        "stopped": 0.2,
    }
    for m in metrics:
        assert m["placeholder_rollouts"] == 0 and math.isfinite(m["loss"])
        values = {name: m[f"reward/math/{name}"] for name in weights}
        assert 0.0 <= values["correct"] <= 1.0 and -1.0 <= values["soft_overlong_punishment"] <= 0
        assert m["reward_mean"] == pytest.approx(sum(w * values[n] for n, w in weights.items()))


def test_reward_model_env_config_trains(tmp_path):
    """reward_model.yaml with a tiny random reward model: scored in process, on its thread."""
    import yaml

    from megatron.rl.models.hf.tiny import make_tiny_reward_model

    entries = yaml.safe_load(
        (ROOT / "examples/rl/environment_configs/reward_model.yaml").read_text()
    )
    entries[0]["agent_args"]["model_dir"] = str(make_tiny_reward_model(tmp_path / "rm"))
    config = tmp_path / "reward_model.yaml"
    config.write_text(yaml.safe_dump(entries))
    metrics = run_training(1, {**ARGS, "env-config": str(config)})
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["placeholder_rollouts"] == 0 and math.isfinite(m["loss"])
        assert 0.0 < m["reward/rm/reward_model"] < 1.0  # a sigmoid
        assert m["reward_mean/rm"] == pytest.approx(m["reward/rm/reward_model"])
        assert m["zero_variance_group_fraction"] < 1.0  # the model's scores differ
