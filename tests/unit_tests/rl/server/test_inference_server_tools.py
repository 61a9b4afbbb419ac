"""Tool calls on ``POST /v1/chat/completions``, driven by the official ``openai`` client over a
real local port. The engine is scripted (it answers each request with a given text, tokenized by
a real Hugging Face tokenizer) and the chat template renders tools, assistant tool calls and
tool results, so what is parsed and what is rendered into the next prompt is known exactly."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import openai
import pytest
from grpo_testing.inference_apps import ScriptedChatInference

from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app

TEMPLATE = """\
{%- if tools %}<|system|>You may call:{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
Write <tool_call>{"name": ..., "arguments": {...}}</tool_call> to call one.<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}
{%- for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": \
{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|end|>
{%- elif m.role == 'tool' %}<|tool|><tool_response id="{{ m.tool_call_id }}">{{ m.content }}\
</tool_response><|end|>
{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}
{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


PARIS = call_text("get_weather", {"city": "Paris"})
ROME = call_text("get_weather", {"city": "Rome"})
NOW = call_text("get_time", {})


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_checkpoints, tmp_path_factory):
    """The tiny qwen2 tokenizer (byte-level BPE) with the tool-rendering template above."""
    directory = tmp_path_factory.mktemp("tools_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_hf_checkpoints["qwen2"] / name, directory / name)
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return HuggingFaceTokenizer(directory)


def serve(tokenizer, texts: list[str], work, parser: str = "auto"):
    """``await work(client, inference)`` against an inference server over ``ScriptedChatInference``;
    returns its result and the server's ``GET /metrics``."""
    inference = ScriptedChatInference(tokenizer, texts)

    async def run():
        app = create_inference_app(inference, tokenizer, tool_call_parser=parser)
        server = await EmbeddedServer.start(app, "127.0.0.1", 0)
        try:
            client = openai.AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key="unused", max_retries=0
            )
            async with client:
                result = await work(client, inference)
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"{server.url}/metrics")).json()
            return result, metrics
        finally:
            await server.stop()

    return asyncio.run(run())


def ask(**kwargs):
    """A ``work`` that sends one chat completion with ``kwargs``."""

    async def work(client, inference):
        kwargs.setdefault("messages", USER)
        return await client.chat.completions.create(model="policy", **kwargs)

    return work


def calls_of(choice) -> list[tuple[str, str, dict]]:
    return [
        (c.id, c.function.name, json.loads(c.function.arguments))
        for c in choice.message.tool_calls or ()
    ]


def test_one_call_is_returned_in_openai_schema_and_tools_are_rendered(tokenizer):
    completion, metrics = serve(tokenizer, [PARIS], ask(tools=[WEATHER]))
    (choice,) = completion.choices
    assert calls_of(choice) == [("call_0", "get_weather", {"city": "Paris"})]
    assert choice.message.tool_calls[0].type == "function"
    assert choice.message.content is None
    assert choice.finish_reason == "tool_calls"
    assert choice.model_extra["tool_call_errors"] == 0
    assert json.dumps(WEATHER) in choice.model_extra["prompt_text"]
    assert metrics == {"chat_choices": 1, "tool_calls": 1, "tool_call_errors": 0}


def test_several_calls_with_text_have_unique_ids_across_choices(tokenizer):
    texts = [f"Checking both.\n{PARIS}\n{NOW}", ROME]
    completion, metrics = serve(tokenizer, texts, ask(tools=[WEATHER, TIME], n=2))
    first, second = completion.choices
    assert calls_of(first) == [
        ("call_0", "get_weather", {"city": "Paris"}),
        ("call_1", "get_time", {}),
    ]
    assert first.message.content == "Checking both."
    assert calls_of(second) == [("call_2", "get_weather", {"city": "Rome"})]
    assert metrics == {"chat_choices": 2, "tool_calls": 3, "tool_call_errors": 0}


def test_a_malformed_call_is_text_and_counted(tokenizer):
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    completion, metrics = serve(
        tokenizer, [f"Hmm {bad}", f"{bad}{PARIS}"], ask(tools=[WEATHER], n=2)
    )
    first, second = completion.choices
    assert first.message.content == f"Hmm {bad}" and first.message.tool_calls is None
    assert first.finish_reason == "stop" and first.model_extra["tool_call_errors"] == 1
    assert second.message.content == bad and second.finish_reason == "tool_calls"
    assert calls_of(second) == [("call_0", "get_weather", {"city": "Paris"})]
    assert metrics == {"chat_choices": 2, "tool_calls": 1, "tool_call_errors": 2}


NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    "kwargs, text, content, calls, finish_reason, errors",
    [
        pytest.param({}, PARIS, PARIS, [], "stop", 0, id="no-tools-no-parsing"),
        pytest.param(
            {"tools": [WEATHER], "tool_choice": "none"}, PARIS, PARIS, [], "stop", 0, id="none"
        ),
        pytest.param(
            {"tools": [WEATHER], "tool_choice": "required"},
            PARIS,
            None,
            [("call_0", "get_weather", {"city": "Paris"})],
            "tool_calls",
            0,
            id="required",
        ),
        pytest.param(
            {"tools": [WEATHER], "tool_choice": "required"},
            "It is sunny.",
            "It is sunny.",
            [],
            "stop",
            0,
            id="required-but-no-call",
        ),
        pytest.param(
            {"tools": [WEATHER, TIME], "tool_choice": NAMED_TIME},
            PARIS + NOW,
            None,
            [("call_0", "get_time", {})],
            "tool_calls",
            1,
            id="named-function",
        ),
        pytest.param(
            {"tools": [WEATHER, TIME], "tool_choice": NAMED_TIME},
            PARIS,
            PARIS,
            [],
            "stop",
            1,
            id="named-function-not-called",
        ),
        pytest.param(
            {"tools": [WEATHER], "parallel_tool_calls": False},
            PARIS + ROME,
            None,
            [("call_0", "get_weather", {"city": "Paris"})],
            "tool_calls",
            0,
            id="no-parallel-calls",
        ),
    ],
)
def test_tool_choice(tokenizer, kwargs, text, content, calls, finish_reason, errors):
    completion, _ = serve(tokenizer, [text], ask(**kwargs))
    (choice,) = completion.choices
    assert choice.message.content == content
    assert calls_of(choice) == calls
    assert choice.finish_reason == finish_reason
    assert choice.model_extra["tool_call_errors"] == errors


def test_a_tool_result_continues_the_conversation(tokenizer):
    async def work(client, inference):
        first = await client.chat.completions.create(model="policy", messages=USER, tools=[WEATHER])
        call = first.choices[0].message.tool_calls[0]
        history = USER + [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"},
        ]
        second = await client.chat.completions.create(
            model="policy", messages=history, tools=[WEATHER]
        )
        return history, second

    (history, second), _ = serve(tokenizer, [PARIS, "It is 22 C and sunny."], work)
    choice = second.choices[0]
    assert choice.message.content == "It is 22 C and sunny." and choice.finish_reason == "stop"
    prompt = choice.model_extra["prompt_text"]
    assert prompt.endswith(
        f"<|user|>Weather in Paris?<|end|><|assistant|>{PARIS}<|end|>"
        '<|tool|><tool_response id="call_0">22 C, sunny</tool_response><|end|><|assistant|>'
    )
    assert "content" not in history[1]  # OpenAI's shape: an assistant message of calls only
    dicts = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "22 C, sunny"},
    ]
    assert choice.model_extra["prompt_token_ids"] == tokenizer.encode_chat(dicts, tools=[WEATHER])


def test_llama3_parser_by_name_and_auto_detection_from_the_template(tokenizer):
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    completion, _ = serve(tokenizer, [text], ask(tools=[WEATHER]), parser="llama3_json")
    assert calls_of(completion.choices[0]) == [("call_0", "get_weather", {"city": "Paris"})]
    completion, _ = serve(tokenizer, [text], ask(tools=[WEATHER]))  # auto: hermes here
    assert completion.choices[0].message.content == text


def test_a_server_without_a_parser_returns_text_and_refuses_forced_choices(tokenizer):
    async def work(client, inference):
        plain = await client.chat.completions.create(model="policy", messages=USER, tools=[WEATHER])
        with pytest.raises(openai.UnprocessableEntityError) as info:
            await client.chat.completions.create(
                model="policy", messages=USER, tools=[WEATHER], tool_choice="required"
            )
        return plain, info.value

    (plain, error), metrics = serve(tokenizer, [PARIS], work, parser="none")
    assert plain.choices[0].message.content == PARIS and plain.choices[0].finish_reason == "stop"
    assert "field 'tool_choice': this server parses no tool calls" in error.body["detail"]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        pytest.param(
            {"tools": [WEATHER], "tool_choice": NAMED_TIME},
            "'tool_choice' names function 'get_time', which is not in 'tools'",
            id="named-function-not-offered",
        ),
        pytest.param(
            {"tools": [WEATHER, WEATHER]}, "'tools' names a function twice", id="duplicate-tool"
        ),
        pytest.param(
            {"tools": [{"type": "function", "function": {"description": "x"}}]},
            "field 'tools.0.function.name'",
            id="tool-without-name",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "call_0"}]},
            "'tool_call_id' belongs to tool messages",
            id="tool-call-id-on-user",
        ),
        pytest.param(
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
            "field 'messages.0.tool_calls.0.function'",
            id="call-without-function",
        ),
    ],
)
def test_bad_tool_requests_are_422_naming_the_field(tokenizer, kwargs, needle):
    async def work(client, inference):
        with pytest.raises(openai.UnprocessableEntityError) as info:
            await ask(**kwargs)(client, inference)
        return info.value

    error, metrics = serve(tokenizer, [], work)
    assert needle in error.body["detail"]
    assert metrics["chat_choices"] == 0


def streamed(**kwargs):
    """A ``work`` that streams one chat completion with ``kwargs`` and returns its chunks."""

    async def work(client, inference):
        kwargs.setdefault("messages", USER)
        stream = await client.chat.completions.create(model="policy", stream=True, **kwargs)
        return [chunk async for chunk in stream]

    return work


def test_streamed_tool_calls_are_deltas_that_join_to_the_answer_not_streamed(tokenizer):
    text = f"Checking both.\n{PARIS}\n{NOW}"
    whole, _ = serve(tokenizer, [text], ask(tools=[WEATHER, TIME]))
    chunks, metrics = serve(tokenizer, [text], streamed(tools=[WEATHER, TIME]))
    choices = [chunk.choices[0] for chunk in chunks]
    assert choices[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in choices) == whole.choices[0].message.content
    calls: dict[int, dict] = {}  # what a client's tool-call parser accumulates
    for c in choices:
        for piece in c.delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls.values()] == calls_of(
        whole.choices[0]
    )
    assert choices[-1].finish_reason == "tool_calls"
    assert [c.finish_reason for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert metrics == {"chat_choices": 1, "tool_calls": 2, "tool_call_errors": 0}
