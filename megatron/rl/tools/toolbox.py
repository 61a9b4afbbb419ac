"""Running a turn's tool calls: each call's answer as an OpenAI ``tool`` message.

A tool is an async function of the call's arguments returning text; one that raises
``ToolError`` (it refused, timed out, ran out of memory) or any other exception, or a call of an
unknown tool or with wrong arguments, answers with ``error: ...`` and counts as a tool error, so
a bad call never ends the rollout. No tool computes on the event loop (the calculator runs in a
worker thread, the python tool in a sandboxed process), and each has a wall-clock limit.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.rl.tools import calculator, sandbox
from megatron.rl.tools.errors import ToolError
from megatron.rl.tools.parsers import ParsedCall
from megatron.rl.wire import ChatMessage


@dataclass(frozen=True)
class Tool:
    """A tool: its OpenAI function schema and the function that answers a call."""

    schema: dict[str, Any]
    call: Callable[..., Awaitable[str]]

    @property
    def name(self) -> str:
        """The function name the model calls."""
        return self.schema["function"]["name"]


CALCULATOR_TIMEOUT_S = 2.0
"""Wall-clock limit of a calculator call (its bounds keep a call to microseconds)."""


def _evaluate(expression: str) -> str:
    return calculator.format_number(calculator.calculate(expression))


async def _calculator(expression: str) -> str:
    work = asyncio.to_thread(_evaluate, str(expression))
    try:
        return await asyncio.wait_for(work, CALCULATOR_TIMEOUT_S)
    except TimeoutError:
        raise ToolError(f"timed out after {CALCULATOR_TIMEOUT_S:g} s") from None


def calculator_tool() -> Tool:
    """``calculator(expression)``: arithmetic, evaluated safely (``calculator.py``)."""
    return Tool(calculator.SCHEMA, _calculator)


def python_tool(
    timeout_s: float = 5.0, memory_mb: int = 256, isolation: sandbox.Isolation = "bubblewrap"
) -> Tool:
    """``python(code)``: runs the code in the sandbox (``sandbox.py``) and returns its output;
    ``RuntimeError`` (one line: what is missing) when this host cannot run ``isolation``."""
    problem = sandbox.isolation_problem(isolation)
    if problem is not None:
        raise RuntimeError(
            f"the python tool cannot start its {isolation} sandbox: {problem}. To run model code "
            "guarded only by an in-process audit hook (not a security boundary), set "
            "python_isolation: unsafe-audit-hook"
        )
    run = functools.partial(
        sandbox.run_python, timeout_s=timeout_s, memory_mb=memory_mb, isolation=isolation
    )

    async def call(code: str) -> str:
        return await run(str(code))

    return Tool(sandbox.SCHEMA, call)


async def answer_calls(
    tools: Sequence[Tool], calls: Sequence[ParsedCall], call_ids: Sequence[str]
) -> tuple[list[ChatMessage], int]:
    """One ``tool`` message per call (in order, ``tool_call_id`` from ``call_ids``) and the
    number of calls that failed."""
    by_name = {t.name: t for t in tools}
    messages, errors = [], 0
    for call, call_id in zip(calls, call_ids, strict=True):
        tool = by_name.get(call.name)
        try:
            if tool is None:
                raise ToolError(f"unknown tool {call.name!r}; tools: {', '.join(by_name)}")
            try:
                content = await tool.call(**call.arguments)
            except TypeError as exc:
                raise ToolError(f"bad arguments for {call.name}: {exc}") from None
        except Exception as exc:  # a tool's failure is the model's feedback, never a crash
            errors += 1
            content = f"error: {exc}"
        messages.append(
            ChatMessage(role="tool", content=content, tool_call_id=call_id, name=call.name)
        )
    return messages, errors
