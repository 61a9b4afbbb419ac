r"""GSM8K-format math word problems from local JSONL/Parquet files, scored with math-verify.

Each group draws one problem uniformly (with replacement) from the RNG the framework hands
``make_problem`` (from the training partition when problems are held out), so a run is reproducible. The prompt is ``prompt_template`` with
``{question}`` replaced by the question: as plain text (``prompt_style: plain``) or as chat
messages, an optional system message then the user message (``prompt_style: chat``), which the
trainer's tokenizer renders with its chat template (a tokenizer without one masks the rollouts).

Reward: 1.0 when the completion's answer (``answer_extraction``, see ``answers.py``) verifies
equal to the final answer after ``####`` with math-verify; otherwise ``format_reward`` (default
0) when the completion states a non-blank answer in the asked form that math-verify parses
(``states_answer``: an empty ``\boxed{}``, a bare ``####`` or a box of words earns nothing,
so "\boxed{} = 4 + 7 = 11" cannot collect the format reward), else 0.0. Rewards are in [0, 1].

Held-out evaluation: give ``data_files`` as ``{train: ..., test: ...}`` and use ``split: test``
in the entry you evaluate with, or hold a share of the problems out of training with
``--val-split-fraction`` (``megatron/rl/agent/dataset.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from examples.rl.environments.gsm8k.answers import (
    AnswerExtraction,
    extract_answer,
    states_answer,
    verify_answer,
)
from examples.rl.environments.gsm8k.dataset import DataFiles, FileFormat, load_records
from megatron.rl.agent.api import AgentArgs, Problem
from megatron.rl.agent.dataset import DatasetEnvironment

INSTALL = "pip install -e '.[math]'"
"""Installs the packages the environment imports when it reads data and scores."""

DEFAULT_TEMPLATE = (
    "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."
)


class GSM8KArgs(AgentArgs):
    """``agent_args`` of the GSM8K environment; the data are read (and checked) on validation."""

    split: str = Field("train", min_length=1, description="Split of data_files to draw from.")
    format: FileFormat = Field("auto", description="json, parquet, or auto by the file suffix.")
    question_field: str = Field("question", min_length=1, description="Column of the question.")
    answer_field: str = Field("answer", min_length=1, description="Column of the solution.")
    cache_dir: str | None = Field(None, description="datasets' cache (default: its own).")
    prompt_style: Literal["plain", "chat"] = Field(
        "chat", description="plain text, or chat messages rendered by the chat template."
    )
    prompt_template: str = Field(
        DEFAULT_TEMPLATE, description="The prompt; '{question}' is replaced by the question."
    )
    system_prompt: str | None = Field(None, description="System message (prompt_style chat).")
    answer_extraction: AnswerExtraction = Field(
        "auto", description="boxed, hashes (####), last_number, or auto (in that order)."
    )
    format_reward: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Reward of a wrong answer stated in the asked form that math-verify parses.",
    )
    verify_timeout_s: int = Field(5, ge=1, le=60, description="math-verify's timeouts.")
    max_tokens: int | None = Field(
        None, ge=1, description="Generation budget (None: the trainer's --rl-default-max-tokens)."
    )
    data_files: DataFiles = Field(
        description="A local JSONL/Parquet file, a list of them, or {split: file(s)}; globs ok."
    )

    @field_validator("prompt_template")
    @classmethod
    def _has_question(cls, value: str) -> str:
        if "{question}" not in value:
            raise ValueError("must contain '{question}'")
        return value

    @field_validator("system_prompt")
    @classmethod
    def _chat_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("prompt_style") == "plain":
            raise ValueError("is only used with prompt_style: chat")
        return value

    @field_validator("data_files")
    @classmethod
    def _readable(cls, value: DataFiles, info: ValidationInfo) -> DataFiles:
        needed = ("split", "format", "question_field", "answer_field")
        if all(name in info.data for name in needed):  # else their own errors are reported
            records(value, info.data)  # GSM8KDatasetError (a ValueError) names file/row/field
        return value


def records(data_files: DataFiles, args: dict):
    """The problems of ``data_files`` under the reading options in ``args``."""
    return load_records(
        data_files,
        args["split"],
        args["format"],
        args["question_field"],
        args["answer_field"],
        args.get("cache_dir"),
    )


class GSM8KEnvironment(DatasetEnvironment):
    """GSM8K-format problems with math-verify scoring (see the module docstring)."""

    Args = GSM8KArgs
    args: GSM8KArgs
    required_modules = {"datasets": INSTALL, "math_verify": INSTALL}

    def __init__(self, env_id: str, args: GSM8KArgs | None = None) -> None:
        super().__init__(env_id, args)
        self.records = records(self.args.data_files, self.args.model_dump())

    def num_problems(self) -> int:
        """Problems in the split read."""
        return len(self.records)

    def problem(self, index: int) -> Problem:
        """Problem ``index`` with the prompt filled in."""
        record = self.records[index]
        text = self.args.prompt_template.replace("{question}", record.question)
        if self.args.prompt_style == "plain":
            return Problem(record.source, text, record.answer, self.args.max_tokens)
        messages = [{"role": "user", "content": text}]
        if self.args.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.args.system_prompt})
        return Problem(record.source, None, record.answer, self.args.max_tokens, messages)

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 for a verified answer, ``format_reward`` for a wrong one in the asked form."""
        mode = self.args.answer_extraction
        predicted = extract_answer(completion, mode)
        if predicted is not None and verify_answer(
            problem.answer, predicted, self.args.verify_timeout_s
        ):
            return 1.0
        if self.args.format_reward == 0.0:
            return 0.0
        stated = states_answer(completion, mode, self.args.verify_timeout_s)
        return self.args.format_reward if stated else 0.0
