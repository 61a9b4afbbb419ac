"""Tool-call parsers: a model's generated text -> its message content and the tool calls in it.

A model asks for a tool by writing the call in the format its chat template taught it. Each
format is one parser, chosen by name per model family (as vLLM's ``--tool-call-parser``):

* ``hermes``: Hermes, Qwen 2.5/3 and most ChatML models. Each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; any number
  of calls, with text around them.
* ``llama3_json``: Llama 3.1-3.3. The whole message is a JSON object ``{"name": ...,
  "parameters": {...}}`` (``arguments`` accepted too), optionally after ``<|python_tag|>``;
  several calls are separated by ``;``.

A call that cannot be parsed (not JSON, no name, arguments that are not an object, an unclosed
tag) is never an error: its text stays in the content and ``malformed`` counts it, so the caller
returns it as text and reports the count as a metric.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

MAX_NAME_LENGTH = 256
"""Longest function name a call may have (``wire.ToolCallFunction``'s bound)."""


@dataclass(frozen=True)
class ParsedCall:
    """One tool call the model asked for."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedMessage:
    """A generated message split into its text and its tool calls."""

    content: str
    """The text outside the parsed calls (all of it when none parsed), stripped."""
    tool_calls: tuple[ParsedCall, ...] = ()
    malformed: int = 0
    """Calls the model attempted that could not be parsed (their text stays in ``content``)."""


class ToolCallParser(Protocol):
    """Splits generated text into content and tool calls; never raises on the model's text."""

    name: str

    def parse(self, text: str) -> ParsedMessage: ...


def _call(obj: Any, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    """``obj`` as a call: a JSON object with a string ``name`` (1-``MAX_NAME_LENGTH`` characters) and an object (or a JSON
    string holding one) under the first of ``argument_keys`` present (absent: no arguments)."""
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested too deep for the decoder
            return None
    return ParsedCall(name, arguments) if isinstance(arguments, dict) else None


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them."""

    name = "hermes"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedMessage:
        calls: list[ParsedCall] = []
        kept: list[str] = []  # the content: text between calls and unparsable blocks verbatim
        malformed, end = 0, 0
        for match in self._block.finditer(text):
            kept.append(text[end : match.start()])
            try:
                call = _call(json.loads(match.group(1)), ("arguments", "parameters"))
            except (ValueError, RecursionError):  # not JSON, or nested too deep
                call = None
            if call is None:
                malformed += 1
                kept.append(match.group(0))
            else:
                calls.append(call)
            end = match.end()
        rest = text[end:]
        if "<tool_call>" in rest:  # opened and never closed (e.g. the token budget ran out)
            malformed += 1
        kept.append(rest)
        return ParsedMessage("".join(kept).strip(), tuple(calls), malformed)


class Llama3JsonParser:
    """A message that is JSON tool calls: ``{"name": ..., "parameters": {...}}`` (``;``-separated
    for several), optionally after ``<|python_tag|>``; any other message is plain content."""

    name = "llama3_json"
    _tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedMessage:
        body = text.strip()
        tagged = body.startswith(self._tag)
        if tagged:
            body = body[len(self._tag) :].lstrip()
        if not body.startswith("{"):
            return ParsedMessage(text.strip(), (), int(tagged))
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):  # not JSON, or nested too deep
                return ParsedMessage(text.strip(), (), 1)
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return ParsedMessage(text.strip(), (), 1)
            calls.append(call)
            rest = body[pos:].lstrip()
            if not rest:
                return ParsedMessage("", tuple(calls), 0)
            if not rest.startswith(";"):
                return ParsedMessage(text.strip(), (), 1)
            rest = rest[1:].lstrip()
            if not rest:  # a trailing separator
                return ParsedMessage("", tuple(calls), 0)
            pos = len(body) - len(rest)


PARSERS: dict[str, ToolCallParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}
"""The tool-call parsers by name."""


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}"
        ) from None


AUTO = "auto"
"""Parser choice: the one the tokenizer's chat template teaches (``detect_tool_call_parser``)."""
NONE = "none"
"""Parser choice: no tool-call parsing (generated text is returned as text)."""
DEFAULT_PARSER = "hermes"
"""What ``auto`` picks when the chat template names no known format (the most common one)."""


def parser_choices() -> tuple[str, ...]:
    """The values of a parser option: ``auto``, ``none`` and the registry's names."""
    return (AUTO, NONE, *sorted(PARSERS))


def detect_tool_call_parser(chat_template: str | None) -> str:
    """The parser name for a chat template: ``hermes`` when it writes ``<tool_call>``,
    ``llama3_json`` when it writes ``<|python_tag|>`` or an ``ipython`` role (Llama 3.1+), else
    ``DEFAULT_PARSER`` (also for no template)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return DEFAULT_PARSER


def resolve_tool_call_parser(choice: str, chat_template: str | None) -> ToolCallParser | None:
    """The parser an option value selects: None for ``none``, the template's for ``auto``, else
    the named one (``ValueError`` naming the known values for an unknown name)."""
    if choice == NONE:
        return None
    if choice == AUTO:
        choice = detect_tool_call_parser(chat_template)
    if choice not in PARSERS:
        raise ValueError(
            f"unknown tool-call parser {choice!r}; known: {', '.join(parser_choices())}"
        )
    return PARSERS[choice]


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template teaches: ``hermes`` when it writes ``<tool_call>`` tags,
    ``llama3_json`` when it uses Llama 3's ``<|python_tag|>``/``ipython`` role, else None."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None
