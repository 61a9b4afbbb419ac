"""Rollouts and their groups: what an agent is asked for (``GroupedRolloutRequest``) and what it
returns (``RolloutGroup`` of ``TokenRollout``s), also the batch rank 0 broadcasts to the others."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from megatron.rl.wire.base import MAX_ID, MAX_TOKENS, Routes, Seed, WireModel, check_routes
from megatron.rl.wire.engine import SamplingParams


class GroupedRolloutRequest(WireModel):
    """Ask an agent for one group of rollouts that share a prompt (one GRPO group)."""

    batch_id: int = Field(ge=0, le=MAX_ID, description="Step whose batch the group belongs to.")
    index_in_batch: int = Field(ge=0, le=MAX_ID, description="Position of the group in its batch.")
    groups_in_batch: int = Field(ge=1, le=65536, description="Number of groups in the batch.")
    group_size: int = Field(ge=1, le=1024, description="Rollouts per group.")
    seed: Seed = Field(description="Run seed; agents derive every RNG from it.")
    submission_policy_version: int = Field(
        ge=0, le=MAX_ID, description="Policy version at submission."
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    eval_prompts: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="Set on held-out evaluation requests: the size of the held-out set, whose "
        "prompt number 'batch_id' this group is. None for training groups.",
    )

    @model_validator(mode="after")
    def _index_in_range(self) -> GroupedRolloutRequest:
        if self.index_in_batch >= self.groups_in_batch:
            raise ValueError("'index_in_batch' must be smaller than 'groups_in_batch'")
        return self


class Rollout(WireModel):
    """A finished episode as text, with its reward."""

    env_id: str = Field(description="Name of the environment that produced it.")
    problem_id: str = Field(description="Identifier of the prompt/problem inside the env.")
    prompt: str
    completion: str
    reward: float
    error: str | None = Field(
        None, description="Set on a placeholder rollout whose environment failed; zero weight."
    )
    reward_components: dict[str, float] | None = Field(
        None,
        max_length=256,
        exclude_if=lambda value: value is None,
        description="The value of each of the environment's reward functions, by name, before "
        "its weight (``reward`` is their weighted sum); absent when the environment has one "
        "reward of its own. Omitted from the JSON when absent, so a rollout without it is the "
        "same payload as before the field existed.",
    )


class TokenRollout(Rollout):
    """A rollout at token level: what the trainer needs for the GRPO loss.

    ``tokens`` is the whole trajectory; ``generation_mask`` marks the generated tokens (the only
    ones that carry loss). ``logprobs`` and ``policy_versions`` have one entry per generated token.
    ``max_tokens``, ``turn_lengths`` and ``truncated`` record each model turn's budget, length
    and ending (overlong reward shaping and the mask of truncated completions read them).
    """

    tokens: list[int]
    generation_mask: list[bool]
    logprobs: list[float]
    policy_versions: list[int]
    submission_policy_version: int = Field(ge=0)
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature of the tokens.")
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_TOKENS,
        description="The generation budget of each model turn (the request's "
        "sampling.max_tokens: the trainer's default or the environment's own); None where the "
        "producer did not record it.",
    )
    turn_lengths: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        max_length=MAX_TOKENS,
        description="Generated tokens of each model turn, in order (they add up to the "
        "generated tokens); None where not recorded.",
    )
    truncated: bool | None = Field(
        None,
        description="Whether a model turn ended at its budget (finish_reason 'length') instead "
        "of a stop token; None where not recorded.",
    )
    episode_metrics: dict[str, float] | None = Field(
        None,
        max_length=64,
        exclude_if=lambda value: value is None,
        description="Per-episode statistics of an agentic rollout by name (a chat episode's "
        "'turns', 'tool_calls', 'tool_errors', 'truncated'); the trainer logs their means. "
        "Omitted from the JSON when absent, so other rollouts are the same payload as before.",
    )
    routed_experts: Routes | None = Field(
        None,
        max_length=MAX_TOKENS,
        exclude_if=lambda value: value is None,
        description="Routing replay: per input position (every token but the last), the "
        "experts of the first request that fed it, flat layers x top-k ids; omitted if unrecorded.",
    )

    @model_validator(mode="after")
    def _consistent_lengths(self) -> TokenRollout:
        if len(self.generation_mask) != len(self.tokens):
            raise ValueError("'generation_mask' must have one entry per token")
        generated = sum(self.generation_mask)
        if len(self.logprobs) != generated or len(self.policy_versions) != generated:
            raise ValueError(
                "'logprobs' and 'policy_versions' must have one entry per generated token"
            )
        if self.turn_lengths is not None and sum(self.turn_lengths) != generated:
            raise ValueError(
                f"'turn_lengths' must add up to the generated tokens ({generated}), got "
                f"{self.turn_lengths}"
            )
        check_routes(self.routed_experts, len(self.tokens) - 1, "routed_experts", "input position")
        return self

    @property
    def is_placeholder(self) -> bool:
        """A masked stand-in for a rollout whose environment raised; it carries no loss."""
        return self.error is not None


class RolloutGroup(WireModel):
    """The rollouts of one GRPO group, tagged with where they belong in the batch order."""

    batch_id: int = Field(ge=0)
    index_in_batch: int = Field(ge=0)
    rollouts: list[TokenRollout] = Field(min_length=1)
