"""Guess the number: a multi-turn game with higher/lower feedback.

The environment draws a secret integer in [``low``, ``high``]; the model guesses, the
environment answers, up to ``max_turns`` guesses::

    prompt          "0-9:"          the range
    turn 0          "5"             a guess (at most ``guess_tokens`` tokens)
    observation     "+"             the secret is higher ("-": lower)
    turn 1          "8"
    observation     "-"
    turn 2          "7"             right: the game ends

A guess that is not a number in the range forfeits the game (it ends there, unsolved).
Reward: ``1 - turn_penalty * t`` when guess t (0-based) is right, 0 when no guess is right.
With the defaults (0-9, 4 guesses, penalty 0.1): binary search solves every game, mean 0.81;
guessing digits at random, ignoring the answers, 0.30; an untrained model, which mostly writes
other characters and forfeits, about 0.07. So the curve shows both lessons: write a digit, then
use the answers.

Every string is in the character tokenizer's alphabet ``0123456789+-*=:,.? ``. With the defaults
an episode is at most 4 + 4 + 3 = 11 tokens (prompt, four one-token guesses, three answers), well
within ``--seq-length`` 32.
"""

from __future__ import annotations

import random

from pydantic import Field, model_validator

from megatron.rl.agent.api import Problem
from megatron.rl.agent.multi_turn import MultiTurnArgs, MultiTurnEnvironment

HIGHER, LOWER = "+", "-"


class GuessArgs(MultiTurnArgs):
    """``agent_args`` of the guessing game (``max_turns``: guesses per episode)."""

    low: int = Field(0, ge=0, le=999, description="Smallest secret.")
    high: int = Field(9, ge=0, le=999, description="Largest secret.")
    guess_tokens: int = Field(
        1, ge=1, le=8, description="Generation budget of one guess (digits of the largest)."
    )
    turn_penalty: float = Field(
        0.1, ge=0.0, le=1.0, description="Reward lost per guess before the right one."
    )

    @model_validator(mode="after")
    def _ordered(self) -> GuessArgs:
        if self.low > self.high:
            raise ValueError("low must not exceed high")
        if len(str(self.high)) > self.guess_tokens:
            raise ValueError(f"guess_tokens={self.guess_tokens} cannot write {self.high}")
        return self


def parse_guess(completion: str, low: int, high: int) -> int | None:
    """The guessed number, or None when the completion is not an integer in [low, high]."""
    text = completion.strip()
    if not text.isdigit():
        return None
    value = int(text)
    return value if low <= value <= high else None


def feedback(secret: int, completion: str, low: int, high: int) -> str | None:
    """The environment's answer to one guess: + or -, or None (the end) when it is right or
    not a number in the range."""
    guess = parse_guess(completion, low, high)
    if guess is None or guess == secret:
        return None
    return HIGHER if secret > guess else LOWER


def guess_reward(
    secret: int, completions: list[str], low: int, high: int, turn_penalty: float
) -> float:
    """max(0, 1 - turn_penalty * t) for a right guess at turn t, 0 if no guess was right."""
    for turn, completion in enumerate(completions):
        if parse_guess(completion, low, high) == secret:
            return max(0.0, 1.0 - turn_penalty * turn)
    return 0.0


class GuessEnvironment(MultiTurnEnvironment):
    """The guessing game above; the secret is ``Problem.answer``."""

    Args = GuessArgs
    args: GuessArgs

    def make_problem(self, rng: random.Random) -> Problem:
        """Draw the secret uniformly from the range."""
        a = self.args
        secret = rng.randint(a.low, a.high)
        return Problem(
            problem_id=f"guess:{a.low}-{a.high}:{secret}",
            prompt=f"{a.low}-{a.high}:",
            answer=str(secret),
            max_tokens=a.guess_tokens,
        )

    async def observe(self, problem: Problem, completions: list[str]) -> str | None:
        """Higher or lower; None (the end) on a right guess or a forfeit."""
        return feedback(int(problem.answer), completions[-1], self.args.low, self.args.high)

    async def reward(self, problem: Problem, completions: list[str]) -> float:
        """Earlier right guesses earn more (see the module docstring)."""
        a = self.args
        return guess_reward(int(problem.answer), completions, a.low, a.high, a.turn_penalty)
