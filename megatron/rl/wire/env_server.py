"""The env server's messages: health, one group's rollouts, evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.rl.wire.base import BaseUrl, Seed, WireModel
from megatron.rl.wire.engine import SamplingParams
from megatron.rl.wire.rollouts import GroupedRolloutRequest


class EnvironmentInfo(WireModel):
    """One environment hosted by an env server."""

    env_id: str
    agent_type: str
    weight: float = Field(description="Mixture weight; 0 for an evaluation-only environment.")


class HealthResponse(WireModel):
    """``GET /health`` of the env server."""

    status: Literal["ok"] = "ok"
    environments: list[EnvironmentInfo]


class GroupedRolloutCall(WireModel):
    """``POST /v1/grouped_rollouts``: run one group on the env server."""

    request: GroupedRolloutRequest
    inference_url: BaseUrl = Field(
        description="Base URL of the trainer's inference server the environment generates with."
    )
    env_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Environment to use (default: the server's mixture).",
    )


class EvaluationRequest(WireModel):
    """``POST /v1/evaluate``: score the current policy on fresh problems of each environment."""

    inference_url: BaseUrl = Field(
        description="Base URL of the trainer's inference server the environment generates with."
    )
    env_id: str | None = Field(
        None, min_length=1, max_length=256, description="Default: every environment."
    )
    num_problems: int = Field(16, ge=1, le=1024)
    seed: Seed = 0
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(temperature=0.0))


class EvaluationResult(WireModel):
    """Scores of one environment."""

    env_id: str
    num_problems: int
    reward_mean: float
    reward_std: float
    failed: int = Field(description="Problems whose rollout was a placeholder (env error).")


class EvaluationResponse(WireModel):
    """Answer of ``POST /v1/evaluate``."""

    results: list[EvaluationResult]
