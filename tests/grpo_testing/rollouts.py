"""Synthetic rollout groups for tests of the training side."""

from __future__ import annotations

import random

from megatron.rl.wire import RolloutGroup, TokenRollout


def synthetic_groups(
    num_groups: int, group_size: int, vocab: int, seed: int = 0, max_len: int = 12
) -> list[RolloutGroup]:
    """Groups of random trajectories: a 2-4 token prompt then 1-6 generated tokens."""
    rng = random.Random(seed)
    groups = []
    for i in range(num_groups):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(2, 4))]
        rollouts = []
        for _ in range(group_size):
            completion = [rng.randrange(2, vocab) for _ in range(rng.randint(1, max_len - 6))]
            rollouts.append(
                TokenRollout(
                    env_id="synthetic",
                    problem_id=str(i),
                    prompt="",
                    completion="",
                    reward=rng.random(),
                    tokens=prompt + completion,
                    generation_mask=[False] * len(prompt) + [True] * len(completion),
                    logprobs=[-rng.uniform(0.5, 4.0) for _ in completion],
                    policy_versions=[0] * len(completion),
                    submission_policy_version=0,
                    temperature=rng.choice([1.0, 0.8]),
                )
            )
        groups.append(RolloutGroup(batch_id=0, index_in_batch=i, rollouts=rollouts))
    return groups
