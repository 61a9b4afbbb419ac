"""User reward functions and judge score parsers of the reward-source tests, named in configs as
``grpo_testing.rewards:<name>``."""

from __future__ import annotations

import asyncio

CALLS: list[dict] = []
"""The keyword arguments of every ``recording`` call."""
JUDGE_TEXTS: list[str] = []
"""Every text ``judge_length`` parsed."""


def digit_count(completions, **kwargs):
    """TRL style: one value per completion; takes every keyword."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def recording(prompts, completions, references, completion_tokens, scale=1.0):
    """Records what it was called with; scale (an ``args`` keyword) times the token count."""
    CALLS.append(
        dict(
            prompts=prompts,
            completions=completions,
            references=references,
            completion_tokens=completion_tokens,
            scale=scale,
        )
    )
    return [scale * n for n in completion_tokens]


async def async_first_digit(completions):
    """An async function: the first digit of each completion, as a number."""
    await asyncio.sleep(0)
    return [float(c[0]) if c and c[0].isdigit() else 0.0 for c in completions]


def none_for_short(completions):
    """None (does not apply) for completions shorter than 2 characters, else 1."""
    return [None if len(c) < 2 else 1.0 for c in completions]


def always_none(completions):
    return [None] * len(completions)


def raising(completions):
    raise RuntimeError("the scorer's service is down")


def nan_for_two(completions):
    return [float("nan") if len(c) == 2 else 0.5 for c in completions]


def wrong_length(completions):
    return [1.0]


def needs_secret(completions, secret):
    return [0.0] * len(completions)


def judge_length(text: str) -> float:
    """A judge score parser: the answer's length modulo 11 (a score in 0..10 whatever the tiny
    model writes)."""
    JUDGE_TEXTS.append(text)
    return float(len(text) % 11)


def numpy_lengths(completions):
    """A numpy array, as many scorers return."""
    import numpy as np

    return np.array([len(c) for c in completions], dtype=np.float32)
