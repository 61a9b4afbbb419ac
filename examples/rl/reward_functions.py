"""User reward functions for ``reward_funcs`` (``environment_configs/weighted_rewards.yaml``).

A reward function is called as TRL calls its ``reward_funcs``: once per group, with keyword lists
of equal length (``prompts``, ``completions``, ``references``, ``problem_ids``,
``completion_tokens``, ``finish_reasons``; it declares those it needs, or ``**kwargs``) plus the
entry's ``args``, and returns one number per completion, or None where it does not apply. Name it
in an env config as ``examples.rl.reward_functions:<function>``.
"""

from __future__ import annotations


def length_match(completions: list[str], references: list[str], **kwargs) -> list[float]:
    """1 when the completion is as long as the reference answer, falling by 1/len(reference) per
    character of difference, down to 0."""
    scores = []
    for completion, reference in zip(completions, references):
        size = max(len(reference), 1)
        scores.append(max(0.0, 1.0 - abs(len(completion.strip()) - len(reference)) / size))
    return scores


def stopped(finish_reasons: list[str], penalty: float = -1.0) -> list[float]:
    """0 for a completion that ended with a stop token, ``penalty`` for one cut by its budget."""
    return [0.0 if reason == "stop" else penalty for reason in finish_reasons]
