"""Pydantic wire types shared by the trainer, the agents, the env server and its clients.

Everything that crosses a process boundary (HTTP between the trainer and an env server, the
pickled batch broadcast from rank 0 to the other ranks) is one of these models, so server and
client validate against the same definitions. The limits and ``WireModel`` are in
``megatron.rl.wire_base``, chat messages and tool calls in ``megatron.rl.wire_messages`` (both
importable from here too); the inference server's OpenAI-style endpoints have their own modules:
``megatron.rl.wire_completions`` and ``megatron.rl.wire_chat``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import httpx
from pydantic import AfterValidator, Field, model_validator

from megatron.rl.wire_base import (
    MAX_CHAT_MESSAGES,
    MAX_ID,
    MAX_TOKENS,
    Routes,
    Seed,
    TokenId,
    WireModel,
    check_routes,
)
from megatron.rl.wire_messages import ChatMessage, check_chat_messages


class SamplingParams(WireModel):
    """How one generation request samples tokens."""

    temperature: float = Field(1.0, ge=0.0, le=1e4, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 disables.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS, description="Most tokens to generate.")
    ignore_eos: bool = Field(
        False,
        description="Generate exactly max_tokens: EOS and the other stop tokens do not end the "
        "generation (the same work for every request).",
    )


class RolloutKey(WireModel):
    """Which rollout a generation request belongs to; orders requests in the engine."""

    batch_id: int = Field(ge=0, le=MAX_ID)
    index_in_batch: int = Field(ge=0, le=MAX_ID)
    sample_index: int = Field(ge=0, le=MAX_ID)


class InferenceRequest(WireModel):
    """One generation request: a prompt (text, token ids or chat messages), sampling parameters
    and a seed. Chat messages are rendered by the trainer's tokenizer's chat template (with the
    assistant's generation prompt); a tokenizer without one refuses them.

    The seed makes the request reproducible: the engine samples it with its own RNG, so its tokens
    do not depend on which other requests share the batch. The rollout key (set by agents that
    serve a ``GroupedRolloutRequest``) lets the engine admit requests in a fixed order, so the
    schedule does not depend on when requests arrive.

    A multi-turn rollout's later turn sends its history as ``prompt_tokens`` plus the
    environment's answer as ``prompt_suffix`` (tokenized by the trainer; the response's
    ``prompt_tokens`` is the whole prompt). ``continued``: see ``ContinuousBatchingScheduler``.
    """

    prompt: str | None = Field(
        None, max_length=MAX_TOKENS, description="Prompt text, tokenized by the trainer."
    )
    prompt_tokens: list[TokenId] | None = Field(
        None, max_length=MAX_TOKENS, description="Prompt token ids (instead of text)."
    )
    messages: list[ChatMessage] | None = Field(
        None,
        max_length=MAX_CHAT_MESSAGES,
        description="Chat messages (instead of text), rendered by the tokenizer's chat template.",
    )
    prompt_suffix: str | None = Field(
        None,
        max_length=MAX_TOKENS,
        description="Text tokenized by the trainer and appended after 'prompt_tokens' (the "
        "environment's answer in a multi-turn rollout).",
    )
    suffix_messages: list[ChatMessage] | None = Field(
        None,
        max_length=MAX_CHAT_MESSAGES,
        exclude_if=lambda v: v is None,
        description="Chat messages appended after 'prompt_tokens' token-exactly: the template's "
        "tokens for them and the next assistant turn's generation prompt, rendered by the "
        "trainer (the environment's messages in a chat rollout; chat_continuation.py).",
    )
    tools: list[dict[str, Any]] | None = Field(
        None,
        max_length=128,
        exclude_if=lambda v: v is None,
        description="OpenAI function-tool schemas, rendered by the chat template with "
        "'messages' or 'suffix_messages'.",
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    seed: Seed = Field(0, description="Seed of this request's sampling RNG.")
    rollout_key: RolloutKey | None = Field(None, description="The rollout this request serves.")
    continued: bool = Field(
        False,
        description="Another turn of this rollout (same 'rollout_key') may follow when this one "
        "finishes; the engine waits for it or for its end (requires 'rollout_key').",
    )

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> "InferenceRequest":
        given = [self.prompt, self.prompt_tokens, self.messages]
        if sum(form is not None for form in given) != 1:
            raise ValueError(
                "exactly one of 'prompt', 'prompt_tokens' and 'messages' must be given"
            )
        if self.messages is not None:
            check_chat_messages(self.messages)
        if self.prompt_tokens is not None and not self.prompt_tokens:
            raise ValueError("'prompt_tokens' must not be empty")
        if self.prompt is not None and not self.prompt:
            raise ValueError("'prompt' must not be empty")
        if self.prompt_suffix is not None:
            if self.prompt_tokens is None:
                raise ValueError("'prompt_suffix' needs 'prompt_tokens'")
            if not self.prompt_suffix:
                raise ValueError("'prompt_suffix' must not be empty")
            if len(self.prompt_tokens) + len(self.prompt_suffix) > MAX_TOKENS:
                raise ValueError(f"'prompt_tokens' plus 'prompt_suffix' exceed {MAX_TOKENS}")
        if self.suffix_messages is not None:
            if self.prompt_tokens is None or self.prompt_suffix is not None:
                raise ValueError("'suffix_messages' needs 'prompt_tokens' and no 'prompt_suffix'")
            check_chat_messages(self.suffix_messages, "suffix_messages")
        if self.tools is not None and self.messages is None and self.suffix_messages is None:
            raise ValueError("'tools' needs 'messages' or 'suffix_messages'")
        if self.continued and self.rollout_key is None:
            raise ValueError("'continued' needs 'rollout_key'")
        return self


class InferenceResponse(WireModel):
    """The engine's answer: generated tokens with their logprobs and policy versions."""

    prompt_tokens: list[int]
    tokens: list[int] = Field(description="Generated token ids, EOS included when it stopped.")
    text: str = Field(description="Detokenized generated tokens (EOS excluded).")
    logprobs: list[float] = Field(description="Per generated token, under the sampling policy.")
    policy_versions: list[int] = Field(description="Policy version that generated each token.")
    finish_reason: Literal["stop", "length"]
    prompt_text: str | None = Field(
        None, description="The prompt rendered from chat messages (None for other prompts)."
    )
    routed_experts: Routes | None = Field(
        None,
        max_length=2 * MAX_TOKENS,
        exclude_if=lambda value: value is None,
        description="Routing replay: the experts each MoE layer chose for each position fed "
        "(prompt_tokens + tokens but the last), flat layers x top-k ids; omitted if unrecorded.",
    )

    @model_validator(mode="after")
    def _routes_cover_fed_positions(self) -> "InferenceResponse":
        fed = len(self.prompt_tokens) + len(self.tokens) - 1
        check_routes(self.routed_experts, fed, "routed_experts", "fed position")
        return self


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
    def _index_in_range(self) -> "GroupedRolloutRequest":
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
    def _consistent_lengths(self) -> "TokenRollout":
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


# --------------------------------------------------------------------------- env server

HTTP_URL_PATTERN = r"^https?://[A-Za-z0-9.\-\[\]:]+(:\d{1,5})?(/[^\s]*)?$"
"""The shape of a base URL, as published in the OpenAPI schemas; ``parse_base_url`` decides."""


def parse_base_url(value: str) -> httpx.URL:
    """``value`` parsed by httpx, the client that will call it: an http(s) URL with a host, a
    port in 1-65535 (or none), no user info, query or fragment. Raises ``ValueError`` saying
    what is wrong otherwise."""
    try:
        url = httpx.URL(value)
        host = url.host  # decodes an IDNA host, as a request's Host header does
    except (httpx.InvalidURL, ValueError) as exc:  # an IDNA error is a ValueError
        raise ValueError(f"not a URL httpx can call ({exc})") from None
    if url.scheme not in ("http", "https"):
        raise ValueError(f"scheme {url.scheme!r}: only http and https")
    if not host:
        raise ValueError("no host")
    if url.userinfo:
        raise ValueError("user info (user@host) is not allowed: the job's key goes to the host")
    if url.port is not None and not 1 <= url.port <= 65535:
        raise ValueError(f"port {url.port} is outside 1-65535")
    if url.query or url.fragment:
        raise ValueError("a base URL has no query or fragment")
    return url


def _check_base_url(value: str) -> str:
    parse_base_url(value)
    return value


BaseUrl = Annotated[
    str, Field(pattern=HTTP_URL_PATTERN, max_length=2048), AfterValidator(_check_base_url)
]
"""A base URL on the wire or in a config: the schema's pattern, then ``parse_base_url``."""


class ErrorResponse(WireModel):
    """Body of every 4xx/5xx answer of the servers: one readable sentence."""

    detail: str


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
