"""Wire types of streamed answers (``"stream": true``): OpenAI's server-sent chunks of
``/v1/completions`` (``text_completion`` chunks) and ``/v1/chat/completions``
(``chat.completion.chunk``), shared by the server (``megatron.rl.server.streaming``) and clients.

Each event is ``data: <chunk JSON>``; the stream ends with ``data: [DONE]``. A choice's chunks
carry, as extensions, the token ids and policy versions of the tokens they add; its last chunk
carries its ``finish_reason`` and the prompt's token ids (chat: also the rendered prompt). With
``stream_options.include_usage`` a last chunk has no choices and the usage. An error after the
stream began is one ``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.rl.wire.base import Routes, WireModel
from megatron.rl.wire.chat import ChatChoiceLogprobs
from megatron.rl.wire.completions import CompletionLogprobs, CompletionUsage


def _absent(value: object) -> bool:
    return value is None


class CompletionChunkChoice(WireModel):
    """A piece of one completion choice."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] = Field(description="Extension: the tokens this chunk adds.")
    policy_versions: list[int] = Field(description="Extension: their policy versions.")
    prompt_token_ids: list[int] | None = Field(
        None, exclude_if=_absent, description="Extension: the tokenized prompt (last chunk)."
    )
    routed_experts: Routes | None = Field(
        None, exclude_if=_absent, description="Extension: the choice's routes (last chunk)."
    )


class CompletionChunk(WireModel):
    """One server-sent event of a streamed ``/v1/completions``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: CompletionUsage | None = None


class ToolCallFunctionDelta(WireModel):
    """A piece of a tool call's function: its name first, then pieces of its arguments."""

    name: str | None = Field(None, exclude_if=_absent)
    arguments: str | None = Field(None, exclude_if=_absent)


class ToolCallDelta(WireModel):
    """A piece of tool call ``index`` of the message (its first piece has id, type and name)."""

    index: int
    id: str | None = Field(None, exclude_if=_absent)
    type: Literal["function"] | None = Field(None, exclude_if=_absent)
    function: ToolCallFunctionDelta


class ChatDelta(WireModel):
    """What a chunk adds to the assistant message."""

    role: Literal["assistant"] | None = Field(None, exclude_if=_absent)
    content: str | None = Field(None, exclude_if=_absent)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=_absent)


class ChatChunkChoice(WireModel):
    """A piece of one chat choice."""

    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    token_ids: list[int] = Field(description="Extension: the tokens this chunk adds.")
    policy_versions: list[int] = Field(description="Extension: their policy versions.")
    prompt_token_ids: list[int] | None = Field(
        None, exclude_if=_absent, description="Extension: the tokenized prompt (last chunk)."
    )
    prompt_text: str | None = Field(
        None, exclude_if=_absent, description="Extension: the rendered prompt (last chunk)."
    )
    tool_call_errors: int | None = Field(
        None, exclude_if=_absent, description="Extension: as a choice's (last chunk)."
    )
    routed_experts: Routes | None = Field(
        None, exclude_if=_absent, description="Extension: the choice's routes (last chunk)."
    )


class ChatCompletionChunk(WireModel):
    """One server-sent event of a streamed ``/v1/chat/completions``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None
