"""Environments written as for Megatron-LM's ``RewardOnlyAgent``: plain classes that import
nothing of ours or Megatron-LM's, drawing their prompts from the global ``random`` module."""

import random
from typing import Any


class CopyDigits:
    """Prompt "<digits>=", golden the digits; reward: matching positions / longer length."""

    def __init__(self, max_digits: int = 3) -> None:
        self.max_digits = max_digits
        self.calls: list[tuple] = []

    async def get_prompt(self, validation: bool) -> tuple[str, Any]:
        digits = "".join(random.choice("0123456789") for _ in range(random.randint(1, 3)))
        self.calls.append(("get_prompt", validation))
        return digits + ("=" if not validation else ":"), {"answer": digits, "problem_id": digits}

    async def get_reward(self, response: str, golden: Any, finish_reason: str) -> float:
        self.calls.append(("get_reward", response, finish_reason))
        answer = golden["answer"]
        longest = max(len(answer), len(response), 1)
        return sum(a == b for a, b in zip(answer, response)) / longest


class CopyWithHeldOutSet(CopyDigits):
    """CopyDigits with a fixed held-out list."""

    async def evaluation_prompts(self, num_prompts: int, validation: bool = False) -> list:
        return [(f"{i}{i}=", {"answer": f"{i}{i}"}) for i in range(num_prompts)]


class OldSignature:
    """The older API: plain (not async) methods, ``get_reward(response, golden)``."""

    def get_prompt(self, validation):
        return "12=", "12"

    def get_reward(self, response, golden):
        return float(response == golden)


class Higher:
    """Multi-turn: up to ``max_turns`` turns; after each turn the environment answers "+"
    until the completion starts with a digit above 4. Records what it is called with."""

    max_turns = 3

    def __init__(self) -> None:
        self.observed: list[tuple] = []
        self.dialogues: list[list] = []

    async def get_prompt(self, validation):
        return f"{random.randint(0, 9)}?", {"problem_id": "higher"}

    async def get_reward(self, response, golden, finish_reason):
        raise AssertionError("get_trajectory_reward is defined: get_reward is not called")

    async def get_observation(self, turn_idx, response, conversation, golden):
        self.observed.append(
            (turn_idx, response.response.content, [(m.role, m.content) for m in conversation])
        )
        text = response.response.content
        done = bool(text) and text[0] in "56789"
        return (None if done else "+"), done

    async def get_trajectory_reward(self, responses, conversation, golden):
        self.dialogues.append([(m.role, m.content) for m in conversation])
        return float(len(responses))


class BrokenPrompt(CopyDigits):
    """Its prompt source fails."""

    async def get_prompt(self, validation):
        raise RuntimeError("dataset shard missing")


class NeedsArgument:
    """Its constructor needs an argument."""

    def __init__(self, path: str) -> None:
        raise FileNotFoundError(path)


class SilentObservation(Higher):
    """Continues the episode without an observation (Megatron-LM raises a ValueError)."""

    async def get_observation(self, turn_idx, response, conversation, golden):
        return None, False
