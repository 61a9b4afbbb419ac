"""Tool-call parsers: valid calls, several calls, text around them, malformed calls as text;
choosing a parser from a chat template."""

from __future__ import annotations

import pytest

from megatron.rl.tools.parsers import (
    PARSERS,
    ParsedCall,
    ParsedMessage,
    detect_tool_call_parser,
    parser_choices,
    resolve_tool_call_parser,
    tool_call_parser,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
WEATHER_CALL = ParsedCall("get_weather", {"city": "Paris", "days": 2})
TIME = '{"name": "get_time", "arguments": {}}'
TIME_CALL = ParsedCall("get_time", {})


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param(block(WEATHER), ParsedMessage("", (WEATHER_CALL,)), id="one-call"),
        pytest.param(
            block(WEATHER) + "\n" + block(TIME),
            ParsedMessage("", (WEATHER_CALL, TIME_CALL)),
            id="two-calls",
        ),
        pytest.param(
            "Let me check.\n" + block(WEATHER) + "\nOne moment.",
            ParsedMessage("Let me check.\n\nOne moment.", (WEATHER_CALL,)),
            id="text-around",
        ),
        pytest.param(
            block(
                '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 2}"}'
            ),
            ParsedMessage("", (WEATHER_CALL,)),
            id="arguments-as-json-text",
        ),
        pytest.param(
            block('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
            ParsedMessage("", (WEATHER_CALL,)),
            id="parameters-key",
        ),
        pytest.param(block('{"name": "get_time"}'), ParsedMessage("", (TIME_CALL,)), id="no-args"),
        pytest.param("The answer is 4.", ParsedMessage("The answer is 4."), id="plain-text"),
        pytest.param(block("{not json}"), ParsedMessage(block("{not json}"), (), 1), id="bad-json"),
        pytest.param(
            block('{"arguments": {}}'),
            ParsedMessage(block('{"arguments": {}}'), (), 1),
            id="missing-name",
        ),
        pytest.param(
            block('{"name": "", "arguments": {}}'),
            ParsedMessage(block('{"name": "", "arguments": {}}'), (), 1),
            id="empty-name",
        ),
        pytest.param(
            block('{"name": "f", "arguments": [1, 2]}'),
            ParsedMessage(block('{"name": "f", "arguments": [1, 2]}'), (), 1),
            id="non-object-arguments",
        ),
        pytest.param(
            block('{"name": "f", "arguments": "not json"}'),
            ParsedMessage(block('{"name": "f", "arguments": "not json"}'), (), 1),
            id="arguments-text-not-json",
        ),
        pytest.param(
            block(f'{{"name": "{"f" * 257}"}}'),
            ParsedMessage(block(f'{{"name": "{"f" * 257}"}}'), (), 1),
            id="name-too-long",
        ),
        pytest.param(
            block(WEATHER) + "\n<tool_call>\n" + '{"name": "get_ti',
            ParsedMessage('<tool_call>\n{"name": "get_ti', (WEATHER_CALL,), 1),
            id="unclosed-after-a-call",
        ),
        pytest.param(
            "Calling.<tool_call>{}", ParsedMessage("Calling.<tool_call>{}", (), 1), id="unclosed"
        ),
        pytest.param(
            block("[" * 100_000), ParsedMessage(block("[" * 100_000), (), 1), id="deep-nesting"
        ),
        pytest.param(
            block("{bad}") + block(TIME),
            ParsedMessage(block("{bad}"), (TIME_CALL,), 1),
            id="one-bad-one-good",
        ),
    ],
)
def test_hermes(text, expected):
    assert tool_call_parser("hermes").parse(text) == expected


LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
LLAMA_TIME = '{"name": "get_time", "parameters": {}}'


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param(LLAMA_WEATHER, ParsedMessage("", (WEATHER_CALL,)), id="one-call"),
        pytest.param(
            "<|python_tag|>" + LLAMA_WEATHER, ParsedMessage("", (WEATHER_CALL,)), id="python-tag"
        ),
        pytest.param(
            f"{LLAMA_WEATHER}; {LLAMA_TIME}",
            ParsedMessage("", (WEATHER_CALL, TIME_CALL)),
            id="two-calls",
        ),
        pytest.param(
            f"{LLAMA_WEATHER};{LLAMA_TIME};",
            ParsedMessage("", (WEATHER_CALL, TIME_CALL)),
            id="trailing-separator",
        ),
        pytest.param("  " + WEATHER + "\n", ParsedMessage("", (WEATHER_CALL,)), id="arguments-key"),
        pytest.param(
            "It is sunny. " + LLAMA_WEATHER,
            ParsedMessage("It is sunny. " + LLAMA_WEATHER),
            id="text-before-is-content",
        ),
        pytest.param("4", ParsedMessage("4"), id="plain-text"),
        pytest.param('{"name": "f", ', ParsedMessage('{"name": "f",', (), 1), id="bad-json"),
        pytest.param(
            '{"parameters": {}}', ParsedMessage('{"parameters": {}}', (), 1), id="missing-name"
        ),
        pytest.param(
            '{"name": "f", "parameters": 3}',
            ParsedMessage('{"name": "f", "parameters": 3}', (), 1),
            id="non-object-arguments",
        ),
        pytest.param(
            f"{LLAMA_WEATHER} and then",
            ParsedMessage(f"{LLAMA_WEATHER} and then", (), 1),
            id="text-after-call",
        ),
        pytest.param(
            "<|python_tag|>print(1)", ParsedMessage("<|python_tag|>print(1)", (), 1), id="tag-code"
        ),
        pytest.param("{" * 100_000, ParsedMessage("{" * 100_000, (), 1), id="deep-nesting"),
    ],
)
def test_llama3_json(text, expected):
    assert tool_call_parser("llama3_json").parse(text) == expected


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; known: hermes"):
        tool_call_parser("mistral")


HERMES_TEMPLATE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>...</tool_call>"
LLAMA_TEMPLATE = "{% if message.role == 'ipython' %}<|start_header_id|>ipython{% endif %}"


@pytest.mark.parametrize(
    "template, expected",
    [
        pytest.param(HERMES_TEMPLATE, "hermes", id="hermes"),
        pytest.param(LLAMA_TEMPLATE, "llama3_json", id="llama3-ipython"),
        pytest.param("{{ '<|python_tag|>' }}", "llama3_json", id="llama3-python-tag"),
        pytest.param("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes", id="other"),
        pytest.param(None, "hermes", id="no-template"),
    ],
)
def test_detect_from_the_chat_template(template, expected):
    assert detect_tool_call_parser(template) == expected


@pytest.mark.parametrize(
    "choice, template, expected",
    [
        pytest.param("auto", LLAMA_TEMPLATE, "llama3_json", id="auto"),
        pytest.param("hermes", LLAMA_TEMPLATE, "hermes", id="named-wins"),
        pytest.param("none", HERMES_TEMPLATE, None, id="none"),
    ],
)
def test_resolve(choice, template, expected):
    parser = resolve_tool_call_parser(choice, template)
    assert (parser and parser.name) == expected


def test_resolve_refuses_an_unknown_choice_and_choices_list_every_parser():
    with pytest.raises(ValueError, match="known: auto, none, hermes, llama3_json"):
        resolve_tool_call_parser("xml", None)
    assert set(parser_choices()) == {"auto", "none", *PARSERS}
