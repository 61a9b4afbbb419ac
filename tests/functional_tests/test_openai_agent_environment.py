"""An agent written against the ``openai`` package (the calculator example: two tool rounds per
episode) trains through ``agent_type: openai_agent`` with exact staleness min(step, L) for L in
{0, 2}, on a tiny Qwen2 checkpoint with a chat template."""

from __future__ import annotations

import pytest
from golden_values import run_training

CONFIG = """
- agent_type: openai_agent
  env_id: calc
  agent_args:
    agent: grpo_testing.openai_agents:checked_solve
    problems:
      - {id: a, question: "What is 12+7?", a: 12, b: 7, answer: 19}
      - {id: b, question: "What is 30+25?", a: 30, b: 25, answer: 55}
    max_turns: 3
    max_tokens: 6
"""
STEPS = 4


@pytest.mark.parametrize("lag", [pytest.param(0, id="L0"), pytest.param(2, id="L2")])
def test_an_openai_client_agent_trains_with_exact_staleness(tiny_hf_checkpoints, tmp_path, lag):
    config = tmp_path / "agent.yaml"
    config.write_text(CONFIG)
    args = {
        "hf-checkpoint": tiny_hf_checkpoints["qwen2"],
        "env-config": config,
        "rl-forced-lag": lag,
        "train-iters": STEPS,
        "lr-warmup-iters": 1,
        "seq-length": 256,
        "grpo-prompts-per-step": 2,
        "grpo-group-size": 2,
        "micro-batch-size": 4,
    }
    metrics = run_training(1, args)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        assert m["staleness_min"] == m["staleness_max"] == min(m["step"], lag)
        assert m["placeholder_rollouts"] == 0  # every agent saw token-exact turns (checked_solve)
        assert 0 <= m["reward_mean"] <= 1
    # Three model turns of up to 6 tokens each: more than one turn's budget per rollout.
    assert max(m["completion_tokens_mean"] for m in metrics) > 6
