"""``agent_type: prompts``: prompts from a local JSONL file, scored by reward functions only.

Each line is a JSON object whose ``prompt_field`` (default ``prompt``) is the prompt: a string,
or a list of ``{role, content}`` chat messages; ``reference_field`` (default ``reference``,
optional per line) is a reference answer reward functions may use (``exact_match``, a judge's
``{reference}``, a user function's ``references``); ``id_field`` names the problem (default:
``<file>:<line>``). A text prompt is ``prompt_template`` with ``{prompt}`` replaced, sent as text
(``prompt_style: plain``) or as a user message after an optional ``system_prompt``
(``prompt_style: chat``, rendered by the trainer's chat template).

The environment has no reward of its own: its entry lists ``reward_funcs`` (or it is the prompt
source of ``agent_type: reward_model`` / ``llm_judge``). It is file-backed
(``DatasetEnvironment``), so ``--val-split-fraction`` holds prompts out of training::

    - agent_type: prompts
      env_id: chat
      agent_args: {path: data/prompts.jsonl, prompt_style: chat, max_tokens: 128}
      reward_funcs:
        - {function: reward_model, args: {model_dir: /models/rm}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from megatron.rl.agent.api import AgentArgs, Problem
from megatron.rl.agent.dataset import DatasetEnvironment
from megatron.rl.wire import MAX_TOKENS, ChatMessage, check_chat_messages


@dataclass(frozen=True)
class PromptRecord:
    """One line of a prompts file."""

    problem_id: str
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    reference: str


class PromptsArgs(AgentArgs):
    """``agent_args`` of ``agent_type: prompts`` (the file is read and checked on validation)."""

    prompt_field: str = Field("prompt", min_length=1, description="Field of the prompt.")
    reference_field: str = Field(
        "reference", min_length=1, description="Field of the reference answer (optional)."
    )
    id_field: str | None = Field(None, min_length=1, description="Field of the problem id.")
    prompt_template: str = Field(
        "{prompt}", description="A text prompt: '{prompt}' is replaced by the line's prompt."
    )
    prompt_style: Literal["plain", "chat"] = Field(
        "plain", description="Send a text prompt as text or as a chat user message."
    )
    system_prompt: str | None = Field(None, description="System message (prompt_style chat).")
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Generation budget (None: --rl-default-max-tokens)."
    )
    path: str = Field(description="Local JSONL file, one prompt per line.")

    @field_validator("prompt_template")
    @classmethod
    def _has_prompt(cls, value: str) -> str:
        if "{prompt}" not in value:
            raise ValueError("must contain '{prompt}'")
        return value

    @field_validator("system_prompt")
    @classmethod
    def _chat_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("prompt_style") == "plain":
            raise ValueError("is only used with prompt_style: chat")
        return value

    @field_validator("path")
    @classmethod
    def _readable(cls, value: str, info: ValidationInfo) -> str:
        fields = ("prompt_field", "reference_field", "id_field")
        if all(name in info.data for name in fields):  # else their own errors are reported
            load_prompts(value, *(info.data[name] for name in fields))
        return value


def load_prompts(
    path: str,
    prompt_field: str = "prompt",
    reference_field: str = "reference",
    id_field: str | None = None,
) -> list[PromptRecord]:
    """The records of the JSONL file at ``path``; ValueError naming the file, line and field."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ValueError(f"cannot read {path!r}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path!r} is not UTF-8 text: {err}") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: invalid JSON: {err.msg}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object")
        prompt = row.get(prompt_field)
        text, messages = None, None
        if isinstance(prompt, str) and prompt:
            text = prompt
        elif isinstance(prompt, list):
            try:
                messages = tuple(ChatMessage.model_validate(m) for m in prompt)
                check_chat_messages(list(messages), prompt_field)
            except ValueError as err:  # pydantic's ValidationError is one
                raise ValueError(f"{where}: field {prompt_field!r}: {err}") from None
        else:
            raise ValueError(
                f"{where}: field {prompt_field!r} must be a non-empty string or a list of "
                f"{{role, content}} messages, got {prompt!r}"
            )
        reference = row.get(reference_field, "")
        if not isinstance(reference, str | int | float) or isinstance(reference, bool):
            raise ValueError(f"{where}: field {reference_field!r} must be a string or a number")
        problem_id = f"{file.name}:{number}"
        if id_field is not None:
            if id_field not in row:
                raise ValueError(f"{where}: no field {id_field!r}")
            problem_id = str(row[id_field])
        records.append(PromptRecord(problem_id, text, messages, str(reference)))
    if not records:
        raise ValueError(f"{path!r} holds no prompts")
    return records


class PromptsEnvironment(DatasetEnvironment):
    """Prompts from a JSONL file, rewarded by the entry's reward functions (module docstring)."""

    Args = PromptsArgs
    args: PromptsArgs
    requires_reward_functions = True

    def __init__(self, env_id: str, args: PromptsArgs | None = None) -> None:
        super().__init__(env_id, args)
        a = self.args
        self.records = load_prompts(a.path, a.prompt_field, a.reference_field, a.id_field)

    def num_problems(self) -> int:
        """Prompts in the file."""
        return len(self.records)

    def problem(self, index: int) -> Problem:
        """Prompt ``index`` as text or chat messages."""
        a, record = self.args, self.records[index]
        if record.messages is not None:
            return Problem(record.problem_id, None, record.reference, a.max_tokens, record.messages)
        text = a.prompt_template.replace("{prompt}", record.prompt)
        if a.prompt_style == "plain":
            return Problem(record.problem_id, text, record.reference, a.max_tokens)
        messages = [ChatMessage(role="user", content=text)]
        if a.system_prompt is not None:
            messages.insert(0, ChatMessage(role="system", content=a.system_prompt))
        return Problem(record.problem_id, None, record.reference, a.max_tokens, tuple(messages))

    def reward(self, problem: Problem, completion: str) -> float:
        """None of its own: the entry's ``reward_funcs`` score it."""
        raise ValueError(f"environment {self.env_id!r} has no reward of its own: list reward_funcs")
