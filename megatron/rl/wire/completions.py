"""Wire types of ``POST /v1/completions``, ``POST /v1/rollouts/end`` and ``GET /v1/models``, the
inference server's text endpoints.

A subset of OpenAI's completions API, shared by the server (``megatron.rl.server.inference_server``)
and its client (``megatron.rl.inference.remote``): one prompt or a batch, ``n``, ``stop``,
``logprobs`` (up to 20 alternatives), ``echo`` (the prompt and its logprobs before the text;
``max_tokens`` 0 scores without generating), ``stream`` (the chunks: ``streaming.py``), plus the
fields RL needs: token ids, policy versions, the rollout key and the multi-turn extensions
``prompt_suffix``, ``continued`` and, for chat episodes, ``messages`` (instead of ``prompt``: a
conversation rendered by the chat template, sent here when it needs ``continued`` or ``tools``),
``suffix_messages`` and ``tools``. Unsupported OpenAI parameters are rejected by name (422), never
ignored. ``POST /v1/rollouts/end`` tells the engine that a rollout sends no more turns;
``GET /v1/models`` lists the models served (OpenAI's list format). The chat endpoint's types are
in ``chat.py``; the engine-level request and response in ``engine.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

from pydantic import Field, model_validator

from megatron.rl.wire.base import MAX_CHAT_MESSAGES, MAX_TOKENS, Routes, Seed, TokenId, WireModel
from megatron.rl.wire.engine import (
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    InferenceRequest,
    InferenceResponse,
    RolloutKey,
    SamplingParams,
)
from megatron.rl.wire.messages import ChatMessage

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


STREAMED_ROLLOUT = (
    "'stream' with 'rollout_key': a rollout's turn is answered whole here, never cancelled "
    "(agents' session URLs stream their turns)"
)


class StreamOptions(WireModel):
    """OpenAI's ``stream_options``."""

    include_usage: bool = Field(False, description="A last chunk with the usage, no choices.")


class CompletionRequest(WireModel):
    """``POST /v1/completions`` of the trainer's inference server."""

    model: str | None = Field(
        None, max_length=256, description="A served model (GET /v1/models; 404 for another)."
    )
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] | None = Field(
        None,
        max_length=MAX_TOKENS,
        description="Text or token ids, or a batch of either (choice p * n + i is sample i of "
        "prompt p); or 'messages' instead.",
    )
    max_tokens: int = Field(
        16, ge=0, le=MAX_TOKENS, description="Most tokens to generate (0: with 'echo', scoring)."
    )
    temperature: float = Field(1.0, ge=0.0, le=1e4)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="Extension: top-k filtering (0 = off).")
    seed: Seed = 0
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Return each token's logprob and its k most likely alternatives.",
    )
    echo: bool = Field(False, description="Return the prompt (and its logprobs) before the text.")
    stop: StopString | list[StopString] | None = Field(
        None, max_length=MAX_STOP_STRINGS, description="Strings that end the text (cut before)."
    )
    n: int = Field(
        1,
        ge=1,
        le=1024,
        description="Samples of the prompt; sample i is seeded "
        "with derive_seed(seed, i) and keyed with sample_index + i.",
    )
    stream: bool = Field(False, description="Server-sent events, one chunk per token.")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="Accepted, unused.")
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
    def _extensions_consistent(self) -> CompletionRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' and 'messages' must be given")
        if self.prompt is not None and not self.prompt:
            raise ValueError("'prompt' must not be empty")
        batch = isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list))
        if self.prompt_suffix is not None and (isinstance(self.prompt, str) or batch):
            raise ValueError("'prompt_suffix' needs 'prompt' as one list of token ids")
        if self.continued and (self.rollout_key is None or self.n != 1 or batch):
            raise ValueError("'continued' needs 'rollout_key', n=1 and one prompt")
        if self.rollout_key is not None and batch:
            raise ValueError("'rollout_key' needs one prompt")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("'max_tokens' 0 generates nothing: it needs 'echo' (scoring)")
        if self.echo and (self.stream or self.messages is not None or self.rollout_key):
            raise ValueError("'echo' needs 'prompt', no 'stream' and no 'rollout_key'")
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' needs 'stream'")
        if self.stream and self.rollout_key is not None:
            raise ValueError(STREAMED_ROLLOUT)
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (one, or a batch): texts or token-id lists."""
        if self.prompt is None:
            return []
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]

    @property
    def stop_strings(self) -> list[str] | None:
        """``stop`` as a list (None: none)."""
        if self.stop is None or self.stop == []:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def to_inference_request(self, prompt: str | list[int] | None = None) -> InferenceRequest:
        """The engine-level request this completion asks for (of ``prompt``, one of
        ``prompts()``; default: the only one)."""
        if prompt is None and self.prompt is not None:
            prompts = self.prompts()
            if len(prompts) != 1:
                raise ValueError("a batch of prompts is one engine request per prompt")
            prompt = prompts[0]
        text = prompt if isinstance(prompt, str) else None
        return InferenceRequest(
            prompt=text,
            prompt_tokens=None if text is not None else prompt,
            prompt_suffix=self.prompt_suffix,
            messages=self.messages,
            suffix_messages=self.suffix_messages,
            tools=self.tools,
            sampling=SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                max_tokens=max(self.max_tokens, 1),
                ignore_eos=self.ignore_eos,
                top_logprobs=self.logprobs or 0,
                stop=self.stop_strings,
            ),
            seed=self.seed,
            rollout_key=self.rollout_key,
            continued=self.continued,
        )

    @classmethod
    def from_inference_request(cls, request: InferenceRequest, n: int = 1) -> CompletionRequest:
        """The completion call that serves ``request`` (``n`` samples) remotely, with its tokens'
        logprobs (every extension the request uses carried: remote == in process)."""
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
            logprobs=s.top_logprobs,
            stop=s.stop,
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
    """OpenAI-style logprobs of a choice's tokens (with ``echo``, the prompt's first: its first
    token has no logprob, null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = Field(
        None,
        description="Per token, its most likely alternatives and itself, by decoded text "
        "(null for the prompt's first token).",
    )
    text_offset: list[int] | None = Field(
        None, description="Per token, where its text starts in the choice's text."
    )


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
    def of(cls, outs: list[InferenceResponse]) -> CompletionUsage:
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
            logprobs = choice.logprobs.token_logprobs
            if any(lp is None for lp in logprobs):
                raise ValueError("an echoed completion is not an engine response")
            responses.append(engine_response(choice, choice.text, logprobs))
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
