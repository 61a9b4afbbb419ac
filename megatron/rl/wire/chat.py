"""Wire types of ``POST /v1/chat/completions``, the trainer's inference server's chat endpoint.

A subset of OpenAI's chat completions API, shared by the server
(``megatron.rl.server.inference_server``) and its client (``megatron.rl.inference.remote``):

* request: ``model`` (a served one), ``messages`` (roles system/user/assistant/tool, text
  content; an assistant's ``tool_calls`` and a tool's ``tool_call_id``), ``max_tokens`` or
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``n``, ``logprobs`` (bool),
  ``top_logprobs`` (up to 20, with ``logprobs``), ``stop`` (strings), ``stream`` and
  ``stream_options`` (the chunks: ``streaming.py``), ``user`` (ignored), ``tools`` (function
  tools only), ``tool_choice``, ``parallel_tool_calls``, plus our extensions ``top_k``,
  ``ignore_eos`` and ``rollout_key``. Every other OpenAI parameter (``response_format``,
  penalties, ...) is refused by name (422), never ignored.
* response: OpenAI's ``chat.completion`` object (``choices[i].message`` with ``content`` and
  ``tool_calls``, ``finish_reason`` ``stop``/``length``/``tool_calls``,
  ``logprobs.content[j]`` with ``token``, ``logprob``, ``bytes`` and the ``top_logprobs``
  alternatives), plus the extensions RL needs on each choice: ``token_ids``,
  ``prompt_token_ids``, ``policy_versions``, ``prompt_text`` (the prompt the chat template
  rendered) and ``tool_call_errors``. How tool calls are parsed and what ``tool_choice`` does:
  ``megatron.rl.server.chat_responses`` (decoding is never constrained).

``logprobs.content`` has one entry per generated token, the stop token included (its text is
empty), so it lines up with ``token_ids``; ``bytes`` are the UTF-8 bytes of the token's decoded
text.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megatron.rl.wire.base import MAX_CHAT_MESSAGES, MAX_TOKENS, Routes, Seed, WireModel
from megatron.rl.wire.completions import (
    STREAMED_ROLLOUT,
    CompletionUsage,
    StopString,
    StreamOptions,
    engine_response,
)
from megatron.rl.wire.engine import (
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    InferenceRequest,
    InferenceResponse,
    RolloutKey,
    SamplingParams,
)
from megatron.rl.wire.messages import ChatMessage, ToolCall, check_chat_messages

DEFAULT_MAX_TOKENS = 16
"""Generation budget when neither ``max_tokens`` nor ``max_completion_tokens`` is given (the
default of ``/v1/completions`` too)."""


MAX_TOOLS = 128
"""Most tools one request may offer (``InferenceRequest.tools``'s bound)."""
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
"""OpenAI's function names: letters, digits, underscores, dashes (dots and colons allowed too)."""


class FunctionDefinition(WireModel):
    """A function the model may call (OpenAI's ``tools[i].function``)."""

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = Field(None, max_length=MAX_TOKENS)
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments object (rendered, not enforced)."
    )
    strict: bool | None = Field(None, description="Accepted; decoding is never constrained.")


class ToolDefinition(WireModel):
    """One tool of a request: only function tools."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(WireModel):
    """The function a ``tool_choice`` names."""

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)


class NamedToolChoice(WireModel):
    """``tool_choice`` naming one function: only calls to it are returned."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(WireModel):
    """``POST /v1/chat/completions`` of the trainer's inference server."""

    model: str | None = Field(
        None, max_length=256, description="A served model (GET /v1/models; 404 for another)."
    )
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Most tokens to generate."
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="OpenAI's newer name of max_tokens."
    )
    temperature: float = Field(1.0, ge=0.0, le=1e4)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="Extension: top-k filtering (0 = off).")
    seed: Seed = 0
    n: int = Field(
        1,
        ge=1,
        le=1024,
        description="Samples of the conversation; sample i is seeded with derive_seed(seed, i) "
        "and keyed with sample_index + i.",
    )
    logprobs: bool = Field(False, description="Return each generated token's logprob.")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="With logprobs: each token's k most likely alternatives.",
    )
    stop: StopString | list[StopString] | None = Field(
        None, max_length=MAX_STOP_STRINGS, description="Strings that end the text (cut before)."
    )
    stream: bool = Field(False, description="Server-sent events, one chunk per token.")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="Accepted, unused.")
    rollout_key: RolloutKey | None = Field(None, description="Extension: see InferenceRequest.")
    ignore_eos: bool = Field(False, description="Extension: see SamplingParams.")
    tools: list[ToolDefinition] | None = Field(
        None,
        max_length=MAX_TOOLS,
        description="Function tools, rendered into the prompt by the chat template.",
    )
    tool_choice: ToolChoice | None = Field(
        None, description="Default: 'auto' with tools, 'none' without (see the module docstring)."
    )
    parallel_tool_calls: bool = Field(
        True, description="False: only the first parsed call is returned."
    )

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError(
                f"{value!r}: give 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}'
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        check_chat_messages(self.messages)
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("'tools' names a function twice")
        choice = self.tool_choice
        if choice == "required" and not names:
            raise ValueError("'tool_choice' 'required' needs 'tools'")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"'tool_choice' names function {choice.function.name!r}, which is not in 'tools'"
            )
        if None not in (self.max_tokens, self.max_completion_tokens) and (
            self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError("'max_tokens' and 'max_completion_tokens' differ; give one of them")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' needs 'stream'")
        if self.stream and self.rollout_key is not None:
            raise ValueError(STREAMED_ROLLOUT)
        return self

    @property
    def stop_strings(self) -> list[str] | None:
        """``stop`` as a list (None: none)."""
        if self.stop is None or self.stop == []:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def budget(self) -> int:
        """The generation budget: ``max_completion_tokens``, ``max_tokens`` or the default."""
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return DEFAULT_MAX_TOKENS

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice``, or its default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's JSON, unset fields left out)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def to_inference_request(self) -> InferenceRequest:
        """The engine-level request this chat completion asks for."""
        return InferenceRequest(
            messages=self.messages,
            sampling=SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                max_tokens=self.budget,
                ignore_eos=self.ignore_eos,
                top_logprobs=self.top_logprobs or 0,
                stop=self.stop_strings,
            ),
            seed=self.seed,
            rollout_key=self.rollout_key,
            tools=self.tool_schemas(),
        )

    @classmethod
    def from_inference_request(cls, request: InferenceRequest, n: int = 1) -> ChatCompletionRequest:
        """The chat completion call that serves ``request`` (``n`` samples), with logprobs; its
        tools are rendered but not parsed (``tool_choice`` none): the answer is the raw text."""
        if request.messages is None:
            raise ValueError("only a request with 'messages' is a chat completion")
        s = request.sampling
        tools = None
        if request.tools is not None:
            tools = [ToolDefinition.model_validate(tool) for tool in request.tools]
        return cls(
            tools=tools,
            tool_choice="none" if tools else None,
            n=n,
            messages=request.messages,
            max_completion_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=request.seed,
            logprobs=True,
            top_logprobs=s.top_logprobs or None,
            stop=s.stop,
            rollout_key=request.rollout_key,
        )


class ChatCompletionMessage(WireModel):
    """The generated assistant message."""

    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="The text; null when the message is only tool calls.")
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda v: v is None)


class ChatTopLogprob(WireModel):
    """One of the most likely tokens at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(WireModel):
    """One generated token with its logprob under the sampling policy."""

    token: str
    logprob: float
    bytes: list[int] | None = Field(description="UTF-8 bytes of the token's decoded text.")
    top_logprobs: list[ChatTopLogprob] = Field(
        default_factory=list,
        max_length=MAX_TOP_LOGPROBS,
        description="The request's top_logprobs most likely tokens, most likely first.",
    )


class ChatChoiceLogprobs(WireModel):
    """OpenAI-style logprobs of a chat choice."""

    content: list[ChatTokenLogprob]


class ChatCompletionChoice(WireModel):
    """One sample of the conversation's next assistant message."""

    index: int = 0
    message: ChatCompletionMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatChoiceLogprobs | None = None
    token_ids: list[int] = Field(description="Extension: generated token ids (EOS included).")
    prompt_token_ids: list[int] = Field(description="Extension: the tokenized prompt.")
    policy_versions: list[int] = Field(description="Extension: policy version of each token.")
    prompt_text: str = Field(description="Extension: the prompt the chat template rendered.")
    tool_call_errors: int = Field(
        0,
        ge=0,
        description="Extension: tool calls the model attempted that were not returned (malformed "
        "ones, left in the content as text; calls to a function tool_choice did not name).",
    )
    routed_experts: Routes | None = Field(
        None,
        max_length=2 * MAX_TOKENS,
        exclude_if=lambda v: v is None,
        description="Extension: see InferenceResponse (omitted when not recorded).",
    )


class ChatCompletionResponse(WireModel):
    """Answer of ``POST /v1/chat/completions``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice] = Field(min_length=1)
    usage: CompletionUsage

    def to_inference_responses(self) -> list[InferenceResponse]:
        """The engine-level responses, by choice index (requires ``logprobs``)."""
        responses = []
        for choice in sorted(self.choices, key=lambda c: c.index):
            if choice.logprobs is None:
                raise ValueError("the chat completion carries no logprobs; ask with logprobs=true")
            if choice.message.tool_calls is not None or choice.message.content is None:
                raise ValueError(
                    "the chat completion parsed tool calls out of the text; ask with "
                    "tool_choice='none' for the generated text"
                )
            logprobs = [entry.logprob for entry in choice.logprobs.content]
            responses.append(
                engine_response(choice, choice.message.content, logprobs, choice.prompt_text)
            )
        return responses


class ToolCallMetrics(WireModel):
    """``GET /metrics`` of the inference server: running counts since it started."""

    chat_choices: int = Field(0, ge=0, description="Chat completion choices returned.")
    tool_calls: int = Field(0, ge=0, description="Tool calls returned in them.")
    tool_call_errors: int = Field(
        0, ge=0, description="Attempted tool calls not returned (the choices' tool_call_errors)."
    )
