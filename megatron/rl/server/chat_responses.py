"""Generated outputs -> OpenAI's chat completion, with the tool calls parsed out of the text.

``chat_completion_response(body, outs, tokenizer, parser)`` builds the answer of
``POST /v1/chat/completions`` from the engine's ``InferenceResponse``s (one per sample); the
inference server calls it, and so can other routes that generate chat turns.

Tool calls (decoding is never constrained; the parser reads what the model wrote):

* no ``tools``, or ``tool_choice`` ``"none"``: nothing is parsed; the text is the content.
* ``"auto"`` (the default with tools): the parser splits the text into content (the text around
  the calls, stripped; null when nothing but calls) and ``tool_calls``; ``finish_reason`` is
  ``"tool_calls"`` when any call is returned. A message without a returned call is the generated
  text unchanged, with the ``finish_reason`` it was generated with.
* ``"required"``: as ``auto``; when the model wrote no parsable call the text is returned with
  the ``finish_reason`` it generated (``stop``/``length``): nothing forces a call.
* a named function: as ``auto``, but only calls to that function are returned; calls to others
  are dropped and counted in ``tool_call_errors`` (if no call is left, the message is the text).
* ``parallel_tool_calls`` false: only the first call is returned (the rest are dropped, not
  counted: the model did call them correctly).

Malformed calls (not JSON, no name, arguments that are not an object, an unclosed tag, a name longer
than the wire's 256 characters) stay in the content as text and are counted in the choice's
``tool_call_errors``; never an error of the request. Call ids are ``call_<i>``, unique within the
response (``i`` counts the response's calls over all choices).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megatron.rl.tokenizer import Tokenizer
from megatron.rl.tools.parsers import ParsedMessage, ToolCallParser
from megatron.rl.wire import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionUsage,
    InferenceResponse,
    NamedToolChoice,
    ToolCall,
    ToolCallFunction,
    ToolCallMetrics,
    choice_extensions,
)


def chat_completion_response(
    body: ChatCompletionRequest,
    outs: list[InferenceResponse],
    tokenizer: Tokenizer,
    parser: ToolCallParser | None,
    *,
    response_id: str | None = None,
    model: str = "policy",
) -> ChatCompletionResponse:
    """The chat completion of ``body`` whose samples are ``outs`` (one choice each, in order),
    tool calls parsed by ``parser`` as the module docstring says (None: never parsed).
    ``model`` is the served name (``body.model`` wins); ``response_id`` defaults to a fresh
    ``chatcmpl-<hex>``."""
    if not outs:
        raise ValueError("a chat completion needs at least one generated output")
    ids = itertools.count()
    choices = []
    for index, out in enumerate(outs):
        message, finish_reason, errors = tool_call_message(body, out, parser, ids)
        choices.append(
            ChatCompletionChoice(
                index=index,
                message=message,
                finish_reason=finish_reason,
                logprobs=chat_logprobs(tokenizer, out) if body.logprobs else None,
                prompt_text=out.prompt_text or "",
                tool_call_errors=errors,
                **choice_extensions(out),
            )
        )
    return ChatCompletionResponse(
        id=response_id or f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=body.model or model,
        choices=choices,
        usage=CompletionUsage.of(outs),
    )


def tool_call_message(
    body: ChatCompletionRequest,
    out: InferenceResponse,
    parser: ToolCallParser | None,
    ids: Iterator[int],
) -> tuple[ChatCompletionMessage, str, int]:
    """One sample's assistant message, its ``finish_reason`` and its ``tool_call_errors``;
    ``ids`` yields the numbers of the call ids."""
    choice = body.effective_tool_choice
    if parser is None or choice == "none":
        return ChatCompletionMessage(content=out.text), out.finish_reason, 0
    parsed: ParsedMessage = parser.parse(out.text)
    errors = parsed.malformed
    content = parsed.content
    calls = []
    for call in parsed.tool_calls:
        if isinstance(choice, NamedToolChoice) and call.name != choice.function.name:
            errors += 1
            continue
        function = ToolCallFunction(
            name=call.name, arguments=json.dumps(call.arguments, ensure_ascii=False)
        )
        calls.append(ToolCall(id=f"call_{next(ids)}", function=function))
    if not body.parallel_tool_calls:
        calls = calls[:1]
    if not calls:  # nothing to return as a call: the text as generated
        return ChatCompletionMessage(content=out.text), out.finish_reason, errors
    message = ChatCompletionMessage(content=content or None, tool_calls=calls)
    return message, "tool_calls", errors


@dataclass
class ToolCallCounter:
    """Running tool-call counts of a server (``GET /metrics``)."""

    chat_choices: int = 0
    tool_calls: int = 0
    tool_call_errors: int = 0

    def record(self, response: ChatCompletionResponse) -> None:
        """Add ``response``'s choices, calls and errors."""
        for choice in response.choices:
            self.count(len(choice.message.tool_calls or ()), choice.tool_call_errors)

    def count(self, tool_calls: int, errors: int) -> None:
        """Add one choice with ``tool_calls`` returned calls and ``errors`` tool-call errors."""
        self.chat_choices += 1
        self.tool_calls += tool_calls
        self.tool_call_errors += errors

    def snapshot(self) -> ToolCallMetrics:
        """The counts as their wire model."""
        return ToolCallMetrics(
            chat_choices=self.chat_choices,
            tool_calls=self.tool_calls,
            tool_call_errors=self.tool_call_errors,
        )


def chat_logprobs(tokenizer: Tokenizer, out: InferenceResponse) -> ChatChoiceLogprobs:
    """OpenAI's ``logprobs.content``: one entry per generated token (the stop token included),
    with its alternatives when the request asked for ``top_logprobs``."""
    return token_logprobs(tokenizer, out.tokens, out.logprobs, out.top_logprobs)


def token_logprobs(
    tokenizer: Tokenizer,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    alternatives: Sequence[Sequence[tuple[int, float]]] | None,
) -> ChatChoiceLogprobs:
    """``logprobs.content`` of ``tokens`` (``alternatives``: each token's most likely tokens)."""
    content = []
    for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
        piece = tokenizer.decode([token])
        tops = []
        for alternative, value in alternatives[i] if alternatives is not None else ():
            text = tokenizer.decode([alternative])
            tops.append(ChatTopLogprob(token=text, logprob=value, bytes=list(text.encode("utf-8"))))
        content.append(
            ChatTokenLogprob(
                token=piece,
                logprob=logprob,
                bytes=list(piece.encode("utf-8")),
                top_logprobs=tops,
            )
        )
    return ChatChoiceLogprobs(content=content)
