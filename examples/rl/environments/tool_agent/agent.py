"""A calculator agent written against the ``openai`` package (``agent_type: openai_agent``).

Each episode makes two tool calls: after each of the model's first two turns the agent runs the
calculator and answers with a ``tool`` message; the third turn is the final answer, rewarded 1
when it contains the problem's answer. When the model's turn carries no tool call (a small or
untrained model rarely writes a valid one) the agent calls the tool itself, under its own call id,
so every episode has its two tool rounds either way.

Only the ``openai`` package is needed: the trainer gives each rollout its own ``base_url``.
"""

from __future__ import annotations

import json
from typing import Any

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOL_ROUNDS = 2


def add(arguments: dict[str, Any]) -> str:
    """The calculator: ``a + b`` as text, or an error message the model sees."""
    try:
        return str(int(arguments["a"]) + int(arguments["b"]))
    except (KeyError, TypeError, ValueError) as exc:
        return f"error: {exc}"


def episode(client, task) -> tuple[float, list[Any]]:
    """Run one episode with ``client`` (an ``openai.OpenAI``); the reward and every completion."""
    problem = task.problem
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the add tool, then answer with the number."},
        {"role": "user", "content": problem["question"]},
    ]
    completions = []
    for round_ in range(TOOL_ROUNDS + 1):
        completion = client.chat.completions.create(
            model=task.model, messages=messages, tools=[CALCULATOR], max_tokens=task.max_tokens
        )
        completions.append(completion)
        message = completion.choices[0].message
        if round_ == TOOL_ROUNDS:
            break
        echoed: dict[str, Any] = {"role": "assistant", "content": message.content}
        calls = [(c.id, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        if calls:
            echoed["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        else:  # no valid call: the agent asks the tool itself
            calls = [(f"agent-call-{round_}", {"a": problem["a"], "b": problem["b"]})]
        messages.append(echoed)
        for call_id, arguments in calls:
            messages.append({"role": "tool", "tool_call_id": call_id, "content": add(arguments)})
    answer = completions[-1].choices[0].message.content or ""
    return (1.0 if str(problem["answer"]) in answer else 0.0), completions


def solve(task) -> float:
    """The environment's agent function: one episode, its reward."""
    from openai import OpenAI

    with OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0) as client:
        return episode(client, task)[0]
