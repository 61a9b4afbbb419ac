"""The engine-level generation request and response: what an agent asks the inference engine
for (in process or through the inference server) and what it answers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from megatron.rl.wire.base import (
    MAX_CHAT_MESSAGES,
    MAX_ID,
    MAX_TOKENS,
    Routes,
    Seed,
    TokenId,
    WireModel,
    check_routes,
)
from megatron.rl.wire.messages import ChatMessage, check_chat_messages

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask for (OpenAI's limit)."""
MAX_STOP_STRINGS = 16
"""Most stop strings of one request."""
MAX_STOP_LENGTH = 256
"""Longest stop string (characters)."""
TokenAlternative = tuple[TokenId, float]
"""One alternative at a position: (token id, logprob)."""


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
    top_logprobs: int = Field(
        0,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Alternatives returned per generated token: the most likely tokens of the "
        "distribution its logprob is from (unkeyed requests only).",
    )
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]] | None = Field(
        None,
        max_length=MAX_STOP_STRINGS,
        exclude_if=lambda v: v is None,
        description="Strings that end the generation where the text first contains one; the "
        "text is cut before it, the tokens end with the one that completed it (unkeyed requests "
        "only).",
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
    def _exactly_one_prompt(self) -> InferenceRequest:
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
    top_logprobs: list[list[TokenAlternative]] | None = Field(
        None,
        max_length=MAX_TOKENS,
        exclude_if=lambda value: value is None,
        description="Per generated token, its SamplingParams.top_logprobs most likely tokens as "
        "(token id, logprob), most likely first; omitted when none were asked.",
    )

    @model_validator(mode="after")
    def _routes_cover_fed_positions(self) -> InferenceResponse:
        fed = len(self.prompt_tokens) + len(self.tokens) - 1
        check_routes(self.routed_experts, fed, "routed_experts", "fed position")
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.tokens):
            raise ValueError("'top_logprobs' must have one entry per generated token")
        return self


class ScoreRequest(WireModel):
    """Scoring a text (nothing generated): the logprob of each of its tokens given those before
    it under the current policy, with the most likely alternatives at each position."""

    prompt: str | None = Field(
        None, max_length=MAX_TOKENS, description="Text, tokenized by the trainer."
    )
    prompt_tokens: list[TokenId] | None = Field(
        None, max_length=MAX_TOKENS, description="Token ids (instead of text)."
    )
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per token.")

    @model_validator(mode="after")
    def _one_prompt(self) -> ScoreRequest:
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise ValueError("exactly one of 'prompt' and 'prompt_tokens' must be given")
        if not (self.prompt or self.prompt_tokens):
            raise ValueError("the text to score must not be empty")
        return self


class ScoreResponse(WireModel):
    """The scored tokens: ``logprobs[i]`` is token ``i + 1``'s given tokens ``0 .. i``."""

    prompt_tokens: list[int]
    logprobs: list[float] = Field(description="One per token after the first.")
    top_logprobs: list[list[TokenAlternative]] = Field(
        description="One list per token after the first (empty lists when none were asked)."
    )
