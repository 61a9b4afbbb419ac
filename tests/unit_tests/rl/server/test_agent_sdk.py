"""The OpenAI Agents SDK (``openai-agents``, a client nobody here wrote) drives a tool loop through
``POST /v1/chat/completions``: its ``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` client
pointed at the inference server on a real local port, tracing off. The engine is scripted (a tiny
model writes no tool calls): it answers the first request with a Hermes ``<tool_call>`` and the
next with the final answer, and records what each request carried. Checked with ``Runner.run``
and with ``Runner.run_streamed`` (the server's streamed chunks): the SDK called the Python tool
with the parsed arguments, sent its result back as a tool message, and returned the answer."""

from __future__ import annotations

import asyncio
import json
import shutil

import openai
import pytest
from grpo_testing.inference_apps import ScriptedChatInference

from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app

pytest.importorskip("agents", reason="needs openai-agents (pip install -e '.[test]')")

TEMPLATE = """\
{%- if tools %}<|system|>Tools:{% for tool in tools %}
{{ tool | tojson }}{% endfor %}<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}
{%- for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": \
{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|end|>
{%- elif m.role == 'tool' %}<|tool|>{{ m.content }}<|end|>
{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}
{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ANSWER = "It is sunny in Paris, 21 degrees."
QUESTION = "What is the weather in Paris?"
INSTRUCTIONS = "Answer with the weather tool."


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_checkpoints, tmp_path_factory):
    """The tiny qwen2 tokenizer (byte-level BPE) with a template that renders tools, tool calls
    and tool results."""
    directory = tmp_path_factory.mktemp("agent_sdk_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_hf_checkpoints["qwen2"] / name, directory / name)
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return HuggingFaceTokenizer(directory)


def run_agent(tokenizer, streamed: bool) -> tuple[object, list[str], ScriptedChatInference, list]:
    """One agent run against a server over the scripted engine (a tool call, then the answer):
    the SDK's result, the cities the tool was called with, the engine (its requests) and, when
    ``streamed``, the stream's events."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
    )

    inference = ScriptedChatInference(tokenizer, [CALL, ANSWER])
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny, 21 degrees in {city}"

    async def run():
        app = create_inference_app(inference, tokenizer, model_name="tiny")
        server = await EmbeddedServer.start(app, "127.0.0.1", 0)
        try:
            client = openai.AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key="unused", max_retries=0
            )
            async with client:
                agent = Agent(
                    name="weather",
                    instructions=INSTRUCTIONS,
                    tools=[get_weather],
                    model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                    model_settings=ModelSettings(temperature=0, max_tokens=64, include_usage=True),
                )
                config = RunConfig(tracing_disabled=True)
                if not streamed:
                    return await Runner.run(agent, QUESTION, run_config=config), []
                result = Runner.run_streamed(agent, QUESTION, run_config=config)
                events = [event async for event in result.stream_events()]
                return result, events
        finally:
            await server.stop()

    result, events = asyncio.run(run())
    return result, cities, inference, events


def assert_tool_loop(result, cities: list[str], inference: ScriptedChatInference) -> None:
    """The SDK called the tool with the parsed arguments once, sent its result back in the next
    request (after the assistant's call, with its id) and returned the final answer."""
    assert cities == ["Paris"]
    assert result.final_output == ANSWER
    first, second = inference.requests
    assert [(m.role, m.content) for m in first.messages] == [
        ("system", INSTRUCTIONS),
        ("user", QUESTION),
    ]
    assert [tool["function"]["name"] for tool in first.tools] == ["get_weather"]
    system, user, assistant, tool = second.messages
    assert (system.content, user.content) == (INSTRUCTIONS, QUESTION)
    assert assistant.role == "assistant"
    (call,) = assistant.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert tool.role == "tool" and tool.tool_call_id == call.id
    assert tool.content == "Sunny, 21 degrees in Paris"
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]


def test_the_agents_sdk_runs_a_tool_loop(tokenizer):
    result, cities, inference, _ = run_agent(tokenizer, streamed=False)
    assert_tool_loop(result, cities, inference)
    first, second = result.raw_responses
    assert first.usage.output_tokens > 0 and second.usage.output_tokens > 0


def test_the_agents_sdk_runs_a_tool_loop_streamed(tokenizer):
    from openai.types.responses import ResponseTextDeltaEvent

    result, cities, inference, events = run_agent(tokenizer, streamed=True)
    assert_tool_loop(result, cities, inference)
    deltas = [
        event.data.delta
        for event in events
        if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent)
    ]
    assert "".join(deltas) == ANSWER
    named = [e.name for e in events if e.type == "run_item_stream_event"]
    assert named[:2] == ["tool_called", "tool_output"] and "message_output_created" in named
    assert all(r.usage.output_tokens > 0 for r in result.raw_responses)  # include_usage
