"""The interface of reward functions: ``Sample`` (one completion of a group as they see it) and
``RewardFunction`` (scores a group's samples). The functions themselves and their weighted sum:
``functions.py``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from megatron.rl.agent.api import Problem
from megatron.rl.wire import InferenceResponse


@dataclass(frozen=True)
class Sample:
    """One generated completion of a group, as reward functions see it."""

    problem: Problem
    response: InferenceResponse

    @property
    def prompt(self) -> str:
        """The prompt as text: the problem's, or its chat messages as the trainer rendered them."""
        if self.problem.prompt is not None:
            return self.problem.prompt
        return self.response.prompt_text or ""

    @property
    def completion(self) -> str:
        return self.response.text

    @property
    def reference(self) -> str:
        """The problem's reference answer (empty when it has none)."""
        return self.problem.answer

    @property
    def completion_tokens(self) -> int:
        """Generated tokens, the stop token included."""
        return len(self.response.tokens)


Value = float | None | BaseException
"""What a function gives one sample: its value, None (does not apply), or why it failed."""


class RewardFunction(ABC):
    """A reward function over a group's samples."""

    async def astart(self) -> None:
        """Acquire resources (load a model, open a client) before the first group."""

    async def aclose(self) -> None:
        """Release them."""

    @abstractmethod
    async def score(self, samples: list[Sample]) -> list[Value]:
        """One value (or None, or an exception) per sample; raising fails every sample."""
