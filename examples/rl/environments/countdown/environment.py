"""Countdown: combine the given numbers with arithmetic to reach a target.

Problems are generated procedurally from the request's seed. The prompt lists the numbers, then
the target::

    prompt      "7,3,15,8:36="      numbers 7, 3, 15 and 8; target 36
    completion  "15+7*3"            an arithmetic expression, ended by EOS

Generation: draw between ``min_numbers`` and ``max_numbers`` integers uniformly from
[``min_value``, ``max_value``]; then draw an ordered subset of at least two of them and an
operator from ``operators`` between each pair, and evaluate that parenthesis-free expression with
the usual precedence. Its value, if it is an integer in [``min_target``, ``max_target``], is the
target; otherwise a new subset and operators are drawn (up to 1000 times). So every problem has a
solution written with only ``+ - *`` and no parentheses: all of it in the character tokenizer's
alphabet.

Reward of a completion (leading/trailing whitespace and spaces between tokens are ignored):

* ``0`` unless the completion parses with ``expression.parse`` (numbers, ``+ - * /``, parentheses)
  and every literal is one of the given numbers, each used at most as often as it is given
  (unused numbers are fine);
* otherwise ``format_reward`` (default 0.1), plus ``answer_reward`` (default 0.9) when the
  expression evaluates exactly (rational arithmetic) to the target. A division by zero earns the
  format reward only.

A correct answer therefore scores ``format_reward + answer_reward`` (1.0 by default).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from pydantic import Field, field_validator, model_validator

from examples.rl.environments.countdown.expression import (
    ExpressionError,
    evaluate,
    literals,
    parse,
)
from megatron.rl.agent.api import AgentArgs, Problem, SingleTurnEnvironment

_TARGET_ATTEMPTS = 1000


class CountdownArgs(AgentArgs):
    """``agent_args`` of the countdown environment."""

    min_numbers: int = Field(3, ge=2, le=8, description="Fewest numbers in a puzzle.")
    max_numbers: int = Field(4, ge=2, le=8, description="Most numbers in a puzzle.")
    min_value: int = Field(1, ge=0, description="Smallest number.")
    max_value: int = Field(20, ge=1, le=9999, description="Largest number.")
    min_target: int = Field(1, description="Smallest target.")
    max_target: int = Field(100, description="Largest target.")
    operators: str = Field(
        "+-*", description="Operators used to build targets (a subset of '+-*/')."
    )
    format_reward: float = Field(0.1, ge=0.0, description="Reward for a well-formed answer.")
    answer_reward: float = Field(0.9, ge=0.0, description="Extra reward when it hits the target.")
    slack_tokens: int = Field(
        2, ge=0, le=64, description="Generation budget beyond the longest paren-free answer."
    )

    @field_validator("operators")
    @classmethod
    def _known_operators(cls, value: str) -> str:
        if not value or set(value) - set("+-*/") or len(set(value)) != len(value):
            raise ValueError("must be a non-empty string of distinct characters from '+-*/'")
        return value

    @model_validator(mode="after")
    def _ordered(self) -> CountdownArgs:
        for low, high in (("min_numbers", "max_numbers"), ("min_value", "max_value")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"{low} must not exceed {high}")
        if self.min_target > self.max_target:
            raise ValueError("min_target must not exceed max_target")
        return self


@dataclass(frozen=True)
class CountdownProblem(Problem):
    """A countdown puzzle; ``answer`` holds the expression the target was built from."""

    numbers: tuple[int, ...] = ()
    target: int = 0


def countdown_reward(
    numbers: tuple[int, ...] | list[int],
    target: int,
    completion: str,
    format_reward: float = 0.1,
    answer_reward: float = 0.9,
) -> float:
    """Score ``completion`` against a puzzle, exactly as described in the module docstring."""
    try:
        tree = parse(completion)
    except ExpressionError:
        return 0.0
    if Counter(literals(tree)) - Counter(numbers):  # some literal is not (or no longer) available
        return 0.0
    try:
        value = evaluate(tree)
    except ZeroDivisionError:
        return format_reward
    return format_reward + (answer_reward if value == target else 0.0)


class CountdownEnvironment(SingleTurnEnvironment):
    """Procedurally generated countdown puzzles with format + answer reward (see module doc)."""

    Args = CountdownArgs
    args: CountdownArgs

    def make_problem(self, rng: random.Random) -> CountdownProblem:
        """Draw the numbers, then a reachable target (see the module docstring)."""
        a = self.args
        count = rng.randint(a.min_numbers, a.max_numbers)
        numbers = tuple(rng.randint(a.min_value, a.max_value) for _ in range(count))
        for _ in range(_TARGET_ATTEMPTS):
            terms = rng.sample(numbers, rng.randint(2, count))
            expression = str(terms[0])
            for term in terms[1:]:
                expression += rng.choice(a.operators) + str(term)
            try:
                value = evaluate(parse(expression))
            except ZeroDivisionError:
                continue
            if value.denominator == 1 and a.min_target <= value <= a.max_target:
                target = int(value)
                break
        else:
            raise ValueError(
                f"countdown: no target in [{a.min_target}, {a.max_target}] reachable from "
                f"{list(numbers)} with {a.operators!r} after {_TARGET_ATTEMPTS} draws; widen "
                "min_target/max_target or the number range"
            )
        prompt = ",".join(map(str, numbers)) + f":{target}="
        # Longest paren-free answer: every number once, an operator between each pair.
        longest = sum(len(str(n)) for n in numbers) + count - 1
        return CountdownProblem(
            problem_id=f"countdown:{prompt}",
            prompt=prompt,
            answer=expression,
            max_tokens=longest + a.slack_tokens,
            numbers=numbers,
            target=target,
        )

    def reward(self, problem: Problem, completion: str) -> float:
        """Format reward plus answer reward (see the module docstring)."""
        if not isinstance(problem, CountdownProblem):
            raise TypeError(f"expected a CountdownProblem, got {type(problem).__name__}")
        return countdown_reward(
            problem.numbers,
            problem.target,
            completion,
            self.args.format_reward,
            self.args.answer_reward,
        )
