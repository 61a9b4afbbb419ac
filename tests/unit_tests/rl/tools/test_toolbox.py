"""A turn's tool calls become tool messages; failures are counted and answered, never raised."""

from __future__ import annotations

import asyncio

from megatron.rl.tools.parsers import ParsedCall
from megatron.rl.tools.toolbox import answer_calls, calculator_tool, python_tool


def test_each_call_is_answered_in_order_and_failures_are_counted():
    calls = [
        ParsedCall("calculator", {"expression": "6 * 7"}),
        ParsedCall("calculator", {"expr": "1"}),
        ParsedCall("search", {}),
        ParsedCall("python", {"code": "print(open('/etc/passwd').read())"}),
        ParsedCall("calculator", {"expression": "1 / 0"}),
    ]
    ids = [f"c{i}" for i in range(len(calls))]
    tools = [calculator_tool(), python_tool(timeout_s=3)]
    messages, errors = asyncio.run(answer_calls(tools, calls, ids))
    assert [(m.role, m.tool_call_id, m.name) for m in messages] == [
        ("tool", i, c.name) for i, c in zip(ids, calls)
    ]
    assert messages[0].content == "42"
    assert messages[1].content.startswith("error: bad arguments for calculator")
    assert messages[2].content == "error: unknown tool 'search'; tools: calculator, python"
    assert "error: PermissionError: sandbox: opening '/etc/passwd'" in messages[3].content
    assert messages[4].content.startswith("error: ZeroDivisionError")
    assert errors == 4
