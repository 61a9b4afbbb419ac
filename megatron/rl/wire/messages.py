"""Chat messages on the wire: the roles, OpenAI's tool-call shapes, and the bound on a
conversation's size (the engine-level request and the OpenAI-style endpoints use them)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megatron.rl.wire.base import MAX_TOKENS, WireModel


class ToolCallFunction(WireModel):
    """The function an assistant's tool call names, OpenAI's schema."""

    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=MAX_TOKENS, description="The arguments as JSON text.")


class ToolCall(WireModel):
    """One tool call of an assistant message (OpenAI's ``tool_calls[i]``)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(WireModel):
    """One message of a chat prompt, rendered into prompt text by the tokenizer's chat template.

    OpenAI's tool-calling shapes: an ``assistant`` message may carry ``tool_calls`` (its
    ``content`` then often ``null``, read as empty), and a ``tool`` message answers one call
    (``tool_call_id``, optionally the tool's ``name``).
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_TOKENS)
    tool_calls: list[ToolCall] | None = Field(
        None, max_length=64, exclude_if=lambda v: v is None, description="assistant only"
    )
    tool_call_id: str | None = Field(
        None, max_length=256, exclude_if=lambda v: v is None, description="tool only"
    )
    name: str | None = Field(None, max_length=256, exclude_if=lambda v: v is None)

    @field_validator("content", mode="before")
    @classmethod
    def _null_content(cls, value: Any) -> Any:
        return "" if value is None else value

    @model_validator(mode="before")
    @classmethod
    def _calls_without_content(cls, data: Any) -> Any:
        """An assistant message of tool calls only may leave ``content`` out (OpenAI's shape)."""
        if isinstance(data, dict) and "content" not in data and data.get("tool_calls"):
            return {**data, "content": ""}
        return data

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"'tool_calls' belongs to assistant messages, not {self.role!r}")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"'tool_call_id' belongs to tool messages, not {self.role!r}")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: tool-call arguments as objects where they are
        JSON objects (Hugging Face's convention), None fields left out."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls is not None:
            out["tool_calls"] = [
                {
                    "type": "function",
                    "id": call.id,
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_object_or_text(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _json_object_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def check_chat_messages(messages: list[ChatMessage], field: str = "messages") -> None:
    """Raise ``ValueError`` naming ``field`` if ``messages`` is empty or its contents together
    exceed ``MAX_TOKENS`` characters."""
    if not messages:
        raise ValueError(f"'{field}' must not be empty")
    total = sum(len(m.content) for m in messages)
    if total > MAX_TOKENS:
        raise ValueError(f"'{field}' has {total} characters of content; at most {MAX_TOKENS}")
