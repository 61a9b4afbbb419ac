"""A turn's tool calls become tool messages; failures are counted and answered, never raised."""

from __future__ import annotations

import asyncio
import time

import pytest

from megatron.rl.tools import bubblewrap
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
    assert "error: FileNotFoundError" in messages[3].content  # no /etc in the sandbox
    assert messages[4].content.startswith("error: ZeroDivisionError")
    assert errors == 4


def test_a_host_without_the_sandbox_refuses_the_python_tool_in_one_line(monkeypatch):
    monkeypatch.setattr(bubblewrap, "problem", lambda: "'bwrap' is not on PATH")
    with pytest.raises(RuntimeError) as refused:
        python_tool()
    message = str(refused.value)
    assert "\n" not in message and "'bwrap' is not on PATH" in message
    assert "python_isolation: unsafe-audit-hook" in message
    python_tool(isolation="unsafe-audit-hook")  # the explicit opt-in starts


def test_calculator_calls_leave_the_event_loop_free():
    """Many calculator calls, among them the slowest expressions the bounds allow, while a
    ticker on the same loop keeps ticking: no call computes on the loop."""

    async def main() -> tuple[list, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        worst = ["(10**100) ** 256", "round(10**99, -100)", "9" * 500 + " % 7"]
        calls = [ParsedCall("calculator", {"expression": e}) for e in worst * 20]
        started = time.monotonic()
        messages, _ = await answer_calls([calculator_tool()], calls, [str(i) for i in range(60)])
        task.cancel()
        assert time.monotonic() - started < 10
        return messages, ticks

    messages, ticks = asyncio.run(main())
    assert messages[0].content == "error: the result is too large"
    assert messages[1].content == "0"
    assert ticks >= 60  # the loop ran between (and during) the calls
