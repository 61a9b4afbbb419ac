"""A Megatron-LM style environment (``agent_type: reward_only``) trains end to end, in process and
behind a real env server, with exact staleness and bitwise equal metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from golden_values import TOLERANCES, env_server, remote_env_config, run_training

ARGS = {
    "rl-forced-lag": 2,
    "train-iters": 6,
    "lr-warmup-iters": 1,
    "grpo-prompts-per-step": 4,
    "grpo-group-size": 4,
    "micro-batch-size": 16,
    "seed": 1234,
}
EVAL = {"eval-interval": 3, "eval-prompts": 4, "eval-samples": 2}  # in process only

# Written as for Megatron-LM's RewardOnlyAgent: a plain class, randomness from `random`.
ENVIRONMENT = '''\
import random


class ReverseAgent:
    """Reverse a digit string."""

    def __init__(self, max_digits=3):
        self.max_digits = max_digits

    async def get_prompt(self, validation):
        n = random.randint(1, self.max_digits)
        digits = "".join(random.choice("0123456789") for _ in range(n))
        return digits + ":", {"answer": digits[::-1], "problem_id": digits}

    async def get_reward(self, response, golden, finish_reason):
        answer = golden["answer"]
        score = sum(a == b for a, b in zip(answer, response)) / max(len(answer), len(response), 1)
        return score if finish_reason == "stop" else 0.5 * score

    async def evaluation_prompts(self, num_prompts, validation=False):
        return [(f"{i:03d}:", {"answer": f"{i:03d}"[::-1]}) for i in range(num_prompts)]
'''


def env_config(tmp_path: Path) -> str:
    (tmp_path / "reverse_env.py").write_text(ENVIRONMENT)
    return (
        "- agent_type: reward_only\n  env_id: reverse\n"
        f"  agent_args: {{env_class: '{tmp_path}/reverse_env.py:ReverseAgent', "
        "env_args: {max_digits: 3}, max_tokens: 5}\n"
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward_only")
    config = env_config(tmp)
    (tmp / "envs.yaml").write_text(config)
    local = run_training(1, {**ARGS, **EVAL, "env-config": tmp / "envs.yaml"})
    with env_server(tmp, config) as (url, _):
        remote = run_training(1, {**ARGS, "env-config": remote_env_config(tmp, url, ["reverse"])})
    return local, remote


def test_it_trains_in_process_with_exact_staleness(runs):
    local, _ = runs
    assert [m["step"] for m in local] == list(range(ARGS["train-iters"]))
    for m in local:
        assert m["staleness_min"] == m["staleness_max"] == min(m["step"], 2)
        assert m["placeholder_rollouts"] == 0 and 0 <= m["reward_mean/reverse"] <= 1
    evaluated = [m for m in local if "eval/greedy_reward" in m]
    assert [m["step"] for m in evaluated] == [2, 5]  # on evaluation_prompts' held-out list
    assert all(0 <= m["eval/greedy_reward"] <= 1 and m["eval/failed"] == 0 for m in evaluated)


def test_behind_the_env_server_it_equals_the_in_process_run_bitwise(runs):
    local, remote = runs
    for metric in TOLERANCES:
        assert [m[metric] for m in remote] == [m[metric] for m in local], metric
    assert [m["reward_mean/reverse"] for m in remote] == [m["reward_mean/reverse"] for m in local]
