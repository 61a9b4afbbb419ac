"""The tool-math environment: tool calls get tool messages, an answer ends the episode, anything
else gets a nudge; the reward checks the last answer."""

from __future__ import annotations

import asyncio
import random

from examples.rl.environments.tool_math import ToolMathArgs, ToolMathEnvironment
from megatron.rl.agent.chat_episode import ChatEpisode, ChatTurn
from megatron.rl.tools.calculator import calculate
from megatron.rl.tools.parsers import tool_call_parser

ENV = ToolMathEnvironment("tool_math", ToolMathArgs(tools=["calculator"]))
PROBLEM = ENV.make_problem(random.Random(3))


def turns(*texts: str) -> list[ChatTurn]:
    parser = tool_call_parser("hermes")
    return [ChatTurn(None, parser.parse(t), i) for i, t in enumerate(texts)]  # type: ignore


def test_problems_are_arithmetic_with_their_value():
    _, shape, a, b, c = PROBLEM.problem_id.split(":")
    expression = ("{a} * {b} - {c}", "({a} + {c}) * {b}", "{a} * {b} + {c}")[int(shape)]
    assert PROBLEM.answer == str(calculate(expression.format(a=a, b=b, c=c)))
    assert [t["function"]["name"] for t in ENV.tools(PROBLEM)] == ["calculator"]


def test_calls_are_answered_answers_end_and_anything_else_is_nudged():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 21"}}</tool_call>'
    bad = '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
    reply = asyncio.run(ENV.respond(PROBLEM, turns("hm", call + bad)))
    assert [(m.content, m.tool_call_id) for m in reply.messages] == [
        ("42", "call_1_0"),
        ("error: unknown tool 'python'; tools: calculator", "call_1_1"),
    ]
    assert reply.tool_errors == 1
    assert asyncio.run(ENV.respond(PROBLEM, turns("Answer: 5"))) is None
    (nudge,) = asyncio.run(ENV.respond(PROBLEM, turns("no idea"))).messages
    assert nudge.role == "user" and "Answer: <number>" in nudge.content


def test_the_reward_checks_the_last_turns_answer():
    def reward(*texts):
        episode = ChatEpisode(turns(*texts), [], [1], [False], [], [], True)
        return asyncio.run(ENV.reward(PROBLEM, episode))

    assert reward("x", f"Answer: {PROBLEM.answer}") == 1.0
    assert reward(f"Answer: {PROBLEM.answer}", "Answer: -1") == 0.0
    assert reward("no answer") == 0.0
