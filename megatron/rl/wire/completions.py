"""Wire types of ``POST /v1/completions``, ``POST /v1/rollouts/end`` and ``GET /v1/models``, the
inference server's text endpoints.

A subset of OpenAI's completions API, shared by the server (``megatron.rl.server.inference_server``)
and its client (``megatron.rl.inference.remote``), plus the fields RL needs: token ids, policy
versions, the rollout key and the multi-turn extensions ``prompt_suffix``, ``continued`` and, for
chat episodes, ``messages`` (instead of ``prompt``: a conversation rendered by the chat template,
sent here when it needs ``continued`` or ``tools``), ``suffix_messages`` and ``tools``.
Unsupported OpenAI parameters are rejected by name (422), never ignored. ``POST /v1/rollouts/end``
tells the engine that a rollout sends no more turns; ``GET /v1/models`` lists the one model served
(OpenAI's list format). The chat endpoint's types are in
``chat.py``; the engine-level request and response in ``engine.py``.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import Field, model_validator

from megatron.rl.wire.base import MAX_CHAT_MESSAGES, MAX_TOKENS, Routes, Seed, TokenId, WireModel
from megatron.rl.wire.engine import InferenceRequest, InferenceResponse, RolloutKey, SamplingParams
from megatron.rl.wire.messages import ChatMessage


class CompletionRequest(WireModel):
    """``POST /v1/completions`` of the trainer's inference server."""

    model: str | None = Field(None, max_length=256, description="Ignored: the trainer's policy.")
    prompt: str | list[TokenId] | None = Field(
        None, max_length=MAX_TOKENS, description="Text, or token ids (or 'messages' instead)."
    )
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=1e4)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="Extension: top-k filtering (0 = off).")
    seed: Seed = 0
    logprobs: int | None = Field(
        None, ge=0, le=1, description="Return the sampled tokens' logprobs (top-1 only)."
    )
    n: int = Field(
        1,
        ge=1,
        le=1024,
        description="Samples of the prompt; sample i is seeded "
        "with derive_seed(seed, i) and keyed with sample_index + i.",
    )
    stream: Literal[False] = False
    rollout_key: RolloutKey | None = Field(None, description="Extension: see InferenceRequest.")
    prompt_suffix: str | None = Field(
        None, max_length=MAX_TOKENS, description="Extension: see InferenceRequest (token 'prompt')."
    )
    continued: bool = Field(False, description="Extension: see InferenceRequest (n=1).")
    ignore_eos: bool = Field(False, description="Extension: see SamplingParams.")
    messages: list[ChatMessage] | None = Field(
        None,
        max_length=MAX_CHAT_MESSAGES,
        exclude_if=lambda v: v is None,
        description="Extension: a conversation instead of 'prompt' (see InferenceRequest).",
    )
    suffix_messages: list[ChatMessage] | None = Field(
        None,
        max_length=MAX_CHAT_MESSAGES,
        exclude_if=lambda v: v is None,
        description="Extension: see InferenceRequest (token 'prompt').",
    )
    tools: list[dict[str, Any]] | None = Field(
        None,
        max_length=128,
        exclude_if=lambda v: v is None,
        description="Extension: see InferenceRequest ('messages' or 'suffix_messages').",
    )

    @model_validator(mode="after")
    def _extensions_consistent(self) -> "CompletionRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' and 'messages' must be given")
        if self.prompt_suffix is not None and isinstance(self.prompt, str):
            raise ValueError("'prompt_suffix' needs 'prompt' as token ids")
        if self.continued and (self.rollout_key is None or self.n != 1):
            raise ValueError("'continued' needs 'rollout_key' and n=1")
        return self

    def to_inference_request(self) -> InferenceRequest:
        """The engine-level request this completion asks for."""
        text = self.prompt if isinstance(self.prompt, str) else None
        return InferenceRequest(
            prompt=text,
            prompt_tokens=None if text is not None else self.prompt,
            prompt_suffix=self.prompt_suffix,
            messages=self.messages,
            suffix_messages=self.suffix_messages,
            tools=self.tools,
            sampling=SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                max_tokens=self.max_tokens,
                ignore_eos=self.ignore_eos,
            ),
            seed=self.seed,
            rollout_key=self.rollout_key,
            continued=self.continued,
        )

    @classmethod
    def from_inference_request(cls, request: InferenceRequest, n: int = 1) -> "CompletionRequest":
        """The completion call that serves ``request`` (``n`` samples) remotely, with logprobs
        (every extension the request uses carried: remote == in process)."""
        s = request.sampling
        return cls(
            n=n,
            prompt=request.prompt if request.prompt is not None else request.prompt_tokens,
            max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=request.seed,
            logprobs=1,
            rollout_key=request.rollout_key,
            prompt_suffix=request.prompt_suffix,
            continued=request.continued,
            messages=request.messages,
            suffix_messages=request.suffix_messages,
            tools=request.tools,
        )


class EndRolloutRequest(WireModel):
    """``POST /v1/rollouts/end``: the rollout sends no more turns (see InferenceRequest)."""

    rollout_key: RolloutKey


class EndRolloutResponse(WireModel):
    """Answer of ``POST /v1/rollouts/end``."""

    awaited: bool = Field(description="Whether the engine was waiting for another turn of it.")


class CompletionLogprobs(WireModel):
    """OpenAI-style logprobs of the generated tokens."""

    tokens: list[str]
    token_logprobs: list[float]


class GeneratedChoice(Protocol):
    """The engine's fields that a completion's and a chat completion's choices both carry."""

    token_ids: list[int]
    prompt_token_ids: list[int]
    policy_versions: list[int]
    finish_reason: str
    routed_experts: list[list[int]] | None


def choice_extensions(out: InferenceResponse) -> dict[str, Any]:
    """The extension fields of a choice (completion or chat) that the engine generated as
    ``out``: its token ids, prompt token ids, policy versions and routes."""
    return {
        "token_ids": out.tokens,
        "prompt_token_ids": out.prompt_tokens,
        "policy_versions": out.policy_versions,
        "routed_experts": out.routed_experts,
    }


def engine_response(
    choice: GeneratedChoice, text: str, logprobs: list[float], prompt_text: str | None = None
) -> InferenceResponse:
    """The engine-level response a choice carries (the inverse of ``choice_extensions``), with
    its ``text``, per-token ``logprobs`` and, for chat, the rendered ``prompt_text``."""
    return InferenceResponse(
        prompt_tokens=choice.prompt_token_ids,
        tokens=choice.token_ids,
        text=text,
        logprobs=logprobs,
        policy_versions=choice.policy_versions,
        finish_reason=choice.finish_reason,
        prompt_text=prompt_text,
        routed_experts=choice.routed_experts,
    )


class CompletionChoice(WireModel):
    """The single choice of a completion."""

    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] = Field(description="Extension: generated token ids (EOS included).")
    prompt_token_ids: list[int] = Field(description="Extension: the tokenized prompt.")
    policy_versions: list[int] = Field(description="Extension: policy version of each token.")
    routed_experts: Routes | None = Field(
        None,
        max_length=2 * MAX_TOKENS,
        exclude_if=lambda v: v is None,
        description="Extension: see InferenceResponse (omitted when not recorded).",
    )


class CompletionUsage(WireModel):
    """Token counts."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, outs: list[InferenceResponse]) -> "CompletionUsage":
        """OpenAI's ``usage`` of the ``n`` samples of one prompt: the prompt counted once, the
        completions summed."""
        prompt_tokens = len(outs[0].prompt_tokens)
        completion_tokens = sum(len(out.tokens) for out in outs)
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionResponse(WireModel):
    """Answer of ``POST /v1/completions``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice] = Field(min_length=1)
    usage: CompletionUsage

    def to_inference_responses(self) -> list[InferenceResponse]:
        """The engine-level responses, by choice index (requires ``logprobs``)."""
        responses = []
        for choice in sorted(self.choices, key=lambda c: c.index):
            if choice.logprobs is None:
                raise ValueError("the completion carries no logprobs; request them with logprobs=1")
            responses.append(engine_response(choice, choice.text, choice.logprobs.token_logprobs))
        return responses


class ModelCard(WireModel):
    """One entry of ``GET /v1/models`` (OpenAI's model object)."""

    id: str = Field(description="The name clients pass as ``model``.")
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time the server started.")
    owned_by: str


class ModelList(WireModel):
    """Answer of ``GET /v1/models``: the model the server generates with."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
