r"""Math questions from a local JSONL file, scored by their final (boxed) answer.

The file (``agent_args.path``; relative paths are resolved from the working directory) holds one
``{"question": ..., "answer": ...}`` object per line (see ``dataset.py``). Each group draws one
record uniformly at random (with replacement) from an RNG seeded by the request, from the training
partition when ``--val-split-fraction`` holds records out for validation
(``megatron/rl/agent/dataset.py``). The prompt is
``prompt_template`` with ``{question}`` replaced by the question.

Reward: 1.0 when the completion's answer equals the reference answer after ``normalize_answer``
(``answers.py``), else 0.0. The completion's answer is the content of its last ``\boxed{...}``
(``boxed{...}`` also counts); without one it is the text after the last ``=`` (or the whole
completion), unless ``require_boxed`` is set, in which case it scores 0. A reference answer that
is itself boxed is unboxed first.

The built-in character tokenizer has no letters, braces or backslash, so with it questions and
answers must be written in ``0123456789+-*=:,.? `` and the model answers unboxed (e.g. prompt
``"12+30="``, completion ``"42"``); ``require_boxed`` is for tokenizers that can write
``\boxed{}``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from examples.rl.environments.math.answers import (
    answers_match,
    extract_boxed,
    final_answer,
)
from examples.rl.environments.math.dataset import load_jsonl
from megatron.rl.agent.api import AgentArgs, Problem
from megatron.rl.agent.dataset import DatasetEnvironment


class MathArgs(AgentArgs):
    """``agent_args`` of the math environment; the file is loaded (and checked) on validation."""

    path: str = Field(description="JSONL file of {question, answer} objects.")
    prompt_template: str = Field(
        "{question}", description="The prompt; '{question}' is replaced by the question."
    )
    require_boxed: bool = Field(False, description="Only a boxed answer can score.")
    max_tokens: int | None = Field(
        None, ge=1, description="Generation budget (None: the trainer's --rl-default-max-tokens)."
    )

    @field_validator("path")
    @classmethod
    def _loadable(cls, value: str) -> str:
        load_jsonl(value)  # a MathDatasetError (a ValueError) names the file and line
        return value

    @field_validator("prompt_template")
    @classmethod
    def _has_question(cls, value: str) -> str:
        if "{question}" not in value:
            raise ValueError("must contain '{question}'")
        return value


class MathEnvironment(DatasetEnvironment):
    """Questions from a local JSONL file with boxed-answer scoring (see module doc)."""

    Args = MathArgs
    args: MathArgs

    def __init__(self, env_id: str, args: MathArgs | None = None) -> None:
        super().__init__(env_id, args)
        self.records = load_jsonl(self.args.path)
        self._name = Path(self.args.path).name

    def num_problems(self) -> int:
        """Records in the file."""
        return len(self.records)

    def problem(self, index: int) -> Problem:
        """Record ``index`` with the prompt template filled in."""
        record = self.records[index]
        reference = extract_boxed(record.answer)
        return Problem(
            problem_id=f"{self._name}:{record.line}",
            prompt=self.args.prompt_template.replace("{question}", record.question),
            answer=record.answer if reference is None else reference,
            max_tokens=self.args.max_tokens,
        )

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 if the completion's final answer matches the reference, else 0.0."""
        predicted = final_answer(completion, require_boxed=self.args.require_boxed)
        return 1.0 if answers_match(predicted, problem.answer) else 0.0
