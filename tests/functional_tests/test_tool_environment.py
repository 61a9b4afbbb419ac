"""Chat multi-turn with tools end to end (tool_math on a tiny Qwen2 checkpoint with a chat
template) at forced lag 2: exact staleness, episodes of several turns with tool messages, bitwise
equal metrics across reruns and behind a real env server."""

from __future__ import annotations

import pytest
from golden_values import TOLERANCES, env_server, remote_env_config, run_training

ENTRY = """- agent_type: examples.rl.environments.tool_math:ToolMathEnvironment
  env_id: tool_math
  agent_args: {max_turns: 3, max_tokens: 8, tools: [calculator, python], python_timeout_s: 2}
"""
EPISODE = [
    "episode/turns_mean",
    "episode/tool_calls_mean",
    "episode/tool_errors_mean",
    "episode/truncated_mean",
]


@pytest.fixture(scope="module")
def runs(tiny_hf_checkpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tool_math")
    config = tmp / "tool_math.yaml"
    config.write_text(ENTRY)
    args = {
        "hf-checkpoint": tiny_hf_checkpoints["qwen2"],
        "rl-forced-lag": 2,
        "train-iters": 4,
        "lr-warmup-iters": 1,
        "seq-length": 512,
        "grpo-prompts-per-step": 2,
        "grpo-group-size": 2,
        "micro-batch-size": 4,
        "seed": 1234,
    }
    first = run_training(1, {**args, "env-config": config})
    again = run_training(1, {**args, "env-config": config})
    with env_server(tmp, ENTRY) as (url, _):
        remote = run_training(1, {**args, "env-config": remote_env_config(tmp, url, ["tool_math"])})
    return first, again, remote


def test_tool_episodes_train_with_exact_staleness_over_several_turns(runs):
    first, _, _ = runs
    assert [m["step"] for m in first] == [0, 1, 2, 3]
    for m in first:
        assert m["staleness_min"] == m["staleness_max"] == min(m["step"], 2)
        assert m["placeholder_rollouts"] == 0
        # The random model never answers: every episode runs its 3 turns (nudges in between).
        assert m["episode/turns_mean"] == 3 and m["episode/truncated_mean"] == 1


@pytest.mark.parametrize("which", [pytest.param(1, id="rerun"), pytest.param(2, id="remote")])
def test_metrics_are_bitwise_equal_across_reruns_and_behind_the_env_server(runs, which):
    for metric in [*TOLERANCES, "completion_tokens_mean", "reward_mean/tool_math", *EPISODE]:
        assert [m[metric] for m in runs[which]] == [m[metric] for m in runs[0]], metric
