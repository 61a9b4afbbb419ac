"""``chat_completion_response``: generated outputs -> a chat completion with parsed tool calls,
called directly (as per-rollout routes do), and the engine-level round trip of a request with
tools through the chat wire models."""

from __future__ import annotations

import json

import pytest

from megatron.rl.server.chat_responses import ToolCallCounter, chat_completion_response
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.tools.parsers import tool_call_parser
from megatron.rl.wire import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    InferenceRequest,
    InferenceResponse,
)

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def output(text: str, finish_reason: str = "stop") -> InferenceResponse:
    tokens = [2 + i % 10 for i in range(len(text))] + [1]  # ids of the digits 0-9, then EOS
    return InferenceResponse(
        prompt_tokens=[2, 3],
        tokens=tokens,
        text=text,
        logprobs=[-0.5] * len(tokens),
        policy_versions=[4] * len(tokens),
        finish_reason=finish_reason,
    )


def body(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "1+2?"}], **kwargs)


def test_outputs_become_choices_with_calls_ids_and_counts():
    outs = [output("Adding. " + CALL), output("3", "length"), output("<tool_call>{x}</tool_call>")]
    response = chat_completion_response(
        body(tools=[TOOL], n=3), outs, CharTokenizer(), tool_call_parser("hermes")
    )
    assert response.id.startswith("chatcmpl-") and response.model == "policy"
    first, second, third = response.choices
    assert first.message.content == "Adding."
    (call,) = first.message.tool_calls
    assert (call.id, call.function.name) == ("call_0", "add")
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert first.finish_reason == "tool_calls" and first.token_ids == outs[0].tokens
    assert (second.message.content, second.finish_reason) == ("3", "length")
    assert (third.message.content, third.tool_call_errors) == ("<tool_call>{x}</tool_call>", 1)
    assert response.usage.completion_tokens == sum(len(o.tokens) for o in outs)
    counter = ToolCallCounter()
    counter.record(response)
    counter.record(response)
    assert counter.snapshot().model_dump() == {
        "chat_choices": 6,
        "tool_calls": 2,
        "tool_call_errors": 2,
    }
    # the answer is the server's wire model: it survives a JSON round trip
    assert ChatCompletionResponse.model_validate_json(response.model_dump_json()) == response


@pytest.mark.parametrize(
    "parser, kwargs",
    [
        pytest.param(None, {"tools": [TOOL]}, id="no-parser"),
        pytest.param("hermes", {}, id="no-tools"),
        pytest.param("hermes", {"tools": [TOOL], "tool_choice": "none"}, id="choice-none"),
    ],
)
def test_text_is_returned_unparsed(parser, kwargs):
    parser = parser and tool_call_parser(parser)
    response = chat_completion_response(body(**kwargs), [output(CALL)], CharTokenizer(), parser)
    (choice,) = response.choices
    assert (choice.message.content, choice.message.tool_calls) == (CALL, None)
    assert choice.finish_reason == "stop"


def test_an_engine_request_with_tools_round_trips_as_raw_text():
    """The HTTP client's path: tools are rendered but not parsed, so the engine-level response
    carries the generated text."""
    request = InferenceRequest(
        messages=[ChatMessage(role="user", content="1+2?")], tools=[TOOL], seed=7
    )
    call = ChatCompletionRequest.from_inference_request(request, n=1)
    assert call.tool_choice == "none" and call.to_inference_request().tools == [TOOL]
    response = chat_completion_response(
        call, [output(CALL)], CharTokenizer(), tool_call_parser("hermes")
    )
    (back,) = response.to_inference_responses()
    assert back.text == CALL


def test_parsed_calls_cannot_pass_as_engine_responses():
    response = chat_completion_response(
        body(tools=[TOOL], logprobs=True),
        [output(CALL)],
        CharTokenizer(alphabet="0123456789"),
        tool_call_parser("hermes"),
    )
    with pytest.raises(ValueError, match="ask with tool_choice='none'"):
        response.to_inference_responses()
