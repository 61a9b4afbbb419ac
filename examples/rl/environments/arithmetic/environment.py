r"""One-step arithmetic word problems for a small chat model, scored with math-verify.

Problems: a fixed list of ``num_problems`` distinct questions generated from ``dataset_seed``
by ``problems.generate_problems`` ("Anna has 7 apples. Anna gets 5 more apples. How many apples
does Anna have now?"; see ``problems.py`` for the phrasings and the operand ranges). The list is
a pure function of the arguments, not of the run's ``--seed``, so ``--val-split-fraction`` holds
out the same problems in every run and evaluation takes each of them once
(``megatron/rl/agent/dataset.py``). Training draws problems uniformly, with replacement, from
the rest. Problem ids are ``arithmetic-<dataset_seed>:<index in the list>``.

Prompt: chat messages, the user message being the question followed by ``prompt_suffix``
(default " Put the final answer within \boxed{}."), after ``system_prompt`` when one is given
(default none: the chat template's own default applies; SmolLM2's adds its own system message).
The trainer's tokenizer renders them with its chat template (a tokenizer without one masks the
rollouts). ``max_tokens`` (default 64) is the generation budget.

Reward: 1.0 when the completion's answer verifies equal to the integer answer with math-verify,
else 0.0; there is no format reward. The answer is GSM8K's ``auto`` extraction
(``examples/rl/environments/gsm8k/answers.py``): the content of the last non-empty
``\boxed{}``, else the text after the last ``####``, else the last number of the completion. So
"\boxed{12}" and "The answer is 12." score 1.0 for 12; "\boxed{13}", an empty ``\boxed{}``
alone, and a ramble whose last number is not 12 ("12. Next, 3 more is 15") score 0.0; a boxed
answer wins over later numbers; an empty box states nothing, so "\boxed{} = 5 + 7 = 12" is
scored by its last number (1.0 for 12).

Difficulty, measured 2026-11-26 on SmolLM2-135M-Instruct with transformers ``generate``
(float32, greedy, 64 new tokens, its chat template with its default system message, batches of
64 with left padding), scored by this reward on the first 128 held-out problems of
``--val-split-fraction 0.1`` (``split_indices(2000, 0.1)``) of the default list (2000 problems,
dataset_seed 0, max_operand 20, max_factor 9): operations [add, subtract] 17.2% (add 12/58,
subtract 10/70); [add] alone 29.7%; [subtract] alone 21.9%; [multiply] alone 41.4% (each about
+-7 points at 95% on 128 problems). 27-53% of the completions hit the 64-token budget, and
19-33% write a ``\boxed{}`` (often an empty one copied from the instruction after the answer).
"""

from __future__ import annotations

import functools

from pydantic import Field, field_validator, model_validator

from examples.rl.environments.arithmetic.problems import (
    OPERATIONS,
    ArithmeticProblem,
    Operation,
    capacity,
    generate_problems,
)
from examples.rl.environments.gsm8k.answers import extract_answer, verify_answer
from megatron.rl.agent.api import AgentArgs, Problem
from megatron.rl.agent.dataset import DatasetEnvironment

DEFAULT_SUFFIX = " Put the final answer within \\boxed{}."


class ArithmeticArgs(AgentArgs):
    """``agent_args`` of the arithmetic environment."""

    num_problems: int = Field(2000, ge=2, description="Distinct problems in the fixed list.")
    dataset_seed: int = Field(
        0, description="Seed of the problem list (independent of the run's --seed)."
    )
    operations: list[Operation] = Field(
        ["add", "subtract"],
        min_length=1,
        description="Problem kinds, drawn uniformly: add, subtract, multiply.",
    )
    max_operand: int = Field(
        20, ge=1, le=10_000, description="Largest number of add and subtract problems."
    )
    max_factor: int = Field(9, ge=2, le=1000, description="Largest factor of multiply problems.")
    prompt_suffix: str = Field(DEFAULT_SUFFIX, description="Appended to the question.")
    system_prompt: str | None = Field(
        None, description="System message (None: the chat template's default)."
    )
    max_tokens: int | None = Field(
        64, ge=1, description="Generation budget (None: the trainer's --rl-default-max-tokens)."
    )
    verify_timeout_s: int = Field(5, ge=1, le=60, description="math-verify's timeouts.")

    @field_validator("operations")
    @classmethod
    def _distinct(cls, value: list[Operation]) -> list[Operation]:
        if len(set(value)) != len(value):
            raise ValueError(f"must not repeat an operation (choose from {list(OPERATIONS)})")
        return value

    @model_validator(mode="after")
    def _enough_questions(self) -> ArithmeticArgs:
        available = capacity(self.operations, self.max_operand, self.max_factor)
        if self.num_problems > available:
            raise ValueError(
                f"num_problems={self.num_problems} exceeds the {available} distinct questions of "
                f"operations {self.operations} with max_operand={self.max_operand} and "
                f"max_factor={self.max_factor}"
            )
        return self


@functools.lru_cache(maxsize=8)
def problem_list(
    num_problems: int,
    seed: int,
    operations: tuple[Operation, ...],
    max_operand: int,
    max_factor: int,
) -> tuple[ArithmeticProblem, ...]:
    """``generate_problems`` of these arguments, generated once per process."""
    return generate_problems(num_problems, seed, operations, max_operand, max_factor)


def arithmetic_reward(answer: str, completion: str, timeout_s: int = 5) -> float:
    """1.0 when the answer ``completion`` gives verifies equal to ``answer``, else 0.0."""
    predicted = extract_answer(completion, "auto")
    return 1.0 if predicted is not None and verify_answer(answer, predicted, timeout_s) else 0.0


class ArithmeticEnvironment(DatasetEnvironment):
    """Generated one-step word problems, chat prompts, math-verify reward (module docstring)."""

    Args = ArithmeticArgs
    args: ArithmeticArgs
    required_modules = {"math_verify": "pip install -e '.[math]'"}

    def __init__(self, env_id: str, args: ArithmeticArgs | None = None) -> None:
        super().__init__(env_id, args)
        a = self.args
        self.problems = problem_list(
            a.num_problems, a.dataset_seed, tuple(a.operations), a.max_operand, a.max_factor
        )

    def num_problems(self) -> int:
        """Problems in the generated list."""
        return len(self.problems)

    def problem(self, index: int) -> Problem:
        """Problem ``index`` of the list as chat messages."""
        messages = [
            {"role": "user", "content": self.problems[index].question + self.args.prompt_suffix}
        ]
        if self.args.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.args.system_prompt})
        return Problem(
            problem_id=f"arithmetic-{self.args.dataset_seed}:{index}",
            prompt=None,
            answer=str(self.problems[index].answer),
            max_tokens=self.args.max_tokens,
            messages=messages,
        )

    def reward(self, problem: Problem, completion: str) -> float:
        """``arithmetic_reward`` of the completion (no format reward)."""
        return arithmetic_reward(problem.answer, completion, self.args.verify_timeout_s)
