"""``agent_type: reward_model`` and ``agent_type: llm_judge``: a task's prompts, scored by a
reward model or an LLM judge.

The prompts come from ``prompts`` (the ``agent_args`` of ``agent_type: prompts``: a JSONL file)
or from ``task`` (another single-turn environment, ``{agent_type, agent_args}``: its prompts,
references, held-out split and token budgets, with its own reward replaced); the other
``agent_args`` are the reward model's (``reward_model.RewardModelArgs``) or the judge's
(``judge.JudgeArgs``)::

    - agent_type: reward_model
      env_id: helpful
      agent_args:
        model_dir: /models/rm
        batch_size: 8
        prompts: {path: data/prompts.jsonl, prompt_style: chat, max_tokens: 128}
    - agent_type: llm_judge
      env_id: judged-gsm8k
      agent_args:
        base_url: http://127.0.0.1:8001/v1
        model: judge
        prompt_template: "Question: {prompt}\\nAnswer: {response}\\nReference: {reference}\\n..."
        task:
          agent_type: examples.rl.environments.gsm8k:GSM8KEnvironment
          agent_args: {data_files: data/gsm8k.jsonl}

The environment that runs is the prompt source's (a ``PromptsEnvironment``, or the task's class),
with the model or judge as its only reward function, named ``reward_model`` or ``llm_judge`` in
the metrics (``reward/<env_id>/reward_model``). The entry may list more ``reward_funcs``; in them
``environment`` is this score. Either runs in the trainer's process or behind the env server.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from megatron.rl.agent.api import Agent, AgentArgs, SingleTurnEnvironment
from megatron.rl.agent.rewards.functions import (
    HF_INSTALL,
    JUDGE_INSTALL,
    NamedFunction,
    RewardFunction,
    WeightedRewards,
    describe,
)
from megatron.rl.agent.rewards.judge import JudgeArgs, LLMJudge
from megatron.rl.agent.rewards.prompts import PromptsArgs, PromptsEnvironment
from megatron.rl.agent.rewards.reward_model import RewardModelArgs, RewardModelFunction
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup


class TaskSpec(BaseModel):
    """The environment whose prompts are scored: an env-config entry's agent_type and args."""

    model_config = ConfigDict(extra="forbid")

    agent_type: str = Field(min_length=1)
    agent_args: dict[str, Any] = Field(default_factory=dict)


class PromptSource(BaseModel):
    """``prompts`` or ``task``: where the prompts come from (the environment is built on
    validation, so its problems are reported naming ``agent_args.prompts`` / ``.task``)."""

    prompts: PromptsArgs | None = Field(None, description="A JSONL file of prompts.")
    task: TaskSpec | None = Field(None, description="A single-turn environment's prompts.")
    _source: SingleTurnEnvironment | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _build_source(self) -> PromptSource:
        if (self.prompts is None) == (self.task is None):
            raise ValueError(
                "give exactly one of 'prompts' (agent_args of agent_type prompts: a JSONL file) "
                "and 'task' ({agent_type, agent_args} of a single-turn environment)"
            )
        if self.prompts is not None:
            self._source = PromptsEnvironment("prompts", self.prompts)
        else:
            self._source = _build_task(self.task)
        return self


def _build_task(task: TaskSpec) -> SingleTurnEnvironment:
    from megatron.rl.agent.env_config import missing_module, resolve_agent_type

    cls = resolve_agent_type(task.agent_type)  # ValueError naming what is missing
    missing = missing_module(cls)
    if missing is not None:
        raise ValueError(f"task: {missing}")
    try:
        args = cls.Args.model_validate(task.agent_args)
    except ValidationError as err:
        raise ValueError(f"task: {describe(err, 'agent_args')}") from None
    agent = cls.create("task", args)
    if not isinstance(agent, SingleTurnEnvironment) or agent.requires_reward_functions:
        raise ValueError(
            f"task: agent_type {task.agent_type!r} is not a single-turn environment with prompts "
            "to score (use 'prompts' for a file of prompts)"
        )
    return agent


class _ScoredSource(Agent):
    """A factory: ``create`` returns the prompt source's environment scored by ``function``."""

    name: ClassVar[str]

    @classmethod
    def function(cls, args: Any) -> RewardFunction:
        raise NotImplementedError

    @classmethod
    def create(cls, env_id: str, args: Any) -> Agent:
        source = args._source
        source.env_id = env_id
        source.reward_functions = WeightedRewards(
            [NamedFunction(cls.name, 1.0, cls.function(args))]
        )
        return source

    async def group_rollout(
        self, request: GroupedRolloutRequest, inference: InferenceInterface
    ) -> RolloutGroup:
        raise TypeError(f"{type(self).__name__} is built with create(), never run itself")


class RewardModelEnvironmentArgs(AgentArgs, RewardModelArgs, PromptSource):
    """``agent_args`` of ``agent_type: reward_model``: the reward model's options and the
    prompt source."""

    model_config = ConfigDict(extra="forbid")


class RewardModelEnvironment(_ScoredSource):
    """``agent_type: reward_model`` (see the module docstring)."""

    Args = RewardModelEnvironmentArgs
    required_modules = {"transformers": HF_INSTALL}
    name = "reward_model"

    @classmethod
    def function(cls, args: RewardModelEnvironmentArgs) -> RewardFunction:
        options = {k: getattr(args, k) for k in RewardModelArgs.model_fields}
        return RewardModelFunction(RewardModelArgs.model_construct(**options), "agent_args")


class LLMJudgeEnvironmentArgs(AgentArgs, JudgeArgs, PromptSource):
    """``agent_args`` of ``agent_type: llm_judge``: the judge's options and the prompt source."""

    model_config = ConfigDict(extra="forbid")


class LLMJudgeEnvironment(_ScoredSource):
    """``agent_type: llm_judge`` (see the module docstring)."""

    Args = LLMJudgeEnvironmentArgs
    required_modules = {"openai": JUDGE_INSTALL}
    name = "llm_judge"

    @classmethod
    def function(cls, args: LLMJudgeEnvironmentArgs) -> RewardFunction:
        options = {k: getattr(args, k) for k in JudgeArgs.model_fields}
        return LLMJudge(JudgeArgs.model_construct(**options))
