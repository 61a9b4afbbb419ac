"""Digit-string tasks with a verifiable reward, learnable by a tiny model from scratch on CPU.

Prompts and answers use only the characters of the built-in ``CharTokenizer``:

=========  ==============  ========
task       prompt          answer
=========  ==============  ========
copy       ``"4071="``     ``"4071"``
reverse    ``"4071:"``     ``"1704"``
sort       ``"4071,"``     ``"0147"``
add        ``"47+18="``    ``"65"``
=========  ==============  ========

Reward (partial credit, in [0, 1]): the number of positions where the completion matches the
answer, divided by the longer of the two lengths. A perfect answer followed by EOS scores 1; a
right prefix scores in proportion; extra characters are penalized through the denominator.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field, model_validator

from megatron.rl.agent.api import AgentArgs, Problem, SingleTurnEnvironment

_MARKERS = {"copy": "=", "reverse": ":", "sort": ","}


def positional_match_reward(answer: str, completion: str) -> float:
    """Matching positions / max(len(answer), len(completion)); 1.0 iff identical."""
    longest = max(len(answer), len(completion))
    if longest == 0:
        return 1.0
    return sum(a == c for a, c in zip(answer, completion)) / longest


class DigitTaskArgs(AgentArgs):
    """``agent_args`` of ``agent_type: digits``."""

    task: Literal["copy", "reverse", "sort", "add"] = "copy"
    min_digits: int = Field(1, ge=1, le=16, description="Shortest operand, in digits.")
    max_digits: int = Field(3, ge=1, le=16, description="Longest operand, in digits.")
    slack_tokens: int = Field(2, ge=1, le=16, description="Generation budget beyond the answer.")

    @model_validator(mode="after")
    def _ordered(self) -> DigitTaskArgs:
        if self.min_digits > self.max_digits:
            raise ValueError("min_digits must not exceed max_digits")
        return self


class DigitTaskEnvironment(SingleTurnEnvironment):
    """One of the digit tasks above; prompts are drawn uniformly over lengths and digits."""

    Args = DigitTaskArgs
    args: DigitTaskArgs

    def make_problem(self, rng: random.Random) -> Problem:
        """Draw operand(s) and build the prompt and answer."""
        a = self.args

        def digits() -> str:
            return "".join(
                rng.choice("0123456789") for _ in range(rng.randint(a.min_digits, a.max_digits))
            )

        if a.task == "add":
            x, y = digits(), digits()
            prompt, answer = f"{x}+{y}=", str(int(x) + int(y))
        else:
            s = digits()
            prompt = s + _MARKERS[a.task]
            answer = {"copy": s, "reverse": s[::-1], "sort": "".join(sorted(s))}[a.task]
        return Problem(
            problem_id=f"{a.task}:{prompt}",
            prompt=prompt,
            answer=answer,
            max_tokens=len(answer) + a.slack_tokens,
        )

    def reward(self, problem: Problem, completion: str) -> float:
        """Positional partial credit against the exact answer."""
        return positional_match_reward(problem.answer, completion)
