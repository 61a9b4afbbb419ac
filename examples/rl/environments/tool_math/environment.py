"""Arithmetic with tools: a chat multi-turn environment with a ``calculator`` and a sandboxed
``python`` tool.

Each problem is an expression over three random integers, asked as a word problem. The model
may call the tools (in the format of ``tool_call_parser``, Hermes ``<tool_call>`` JSON by
default) and answers with a line ``Answer: <number>``, which ends the episode. A turn with tool
calls gets their results as ``tool`` messages (a failing call answers ``error: ...`` and counts
as a tool error); a turn with neither a call nor an answer gets a user message asking for one,
so the episode goes on until ``max_turns`` (a random model still produces multi-turn episodes).
Reward: 1 when the last turn's answer equals the value, else 0.
"""

from __future__ import annotations

import random
import re
from typing import Any, Literal

from pydantic import Field

from megatron.rl.agent.api import Problem
from megatron.rl.agent.chat_episode import ChatEpisode, ChatTurn, Reply, call_id
from megatron.rl.agent.chat_multi_turn import ChatMultiTurnArgs, ChatMultiTurnEnvironment
from megatron.rl.tools.calculator import calculate, format_number
from megatron.rl.tools.toolbox import Tool, answer_calls, calculator_tool, python_tool
from megatron.rl.wire import ChatMessage

SYSTEM = (
    "Solve the problem. You may call the tools. When you know the result, reply with a last "
    "line 'Answer: <number>'."
)
NUDGE = "No tool call and no 'Answer: <number>' line found. Call a tool or give the answer."
_ANSWER = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")
_TEMPLATES = (
    "A shop has {a} boxes of {b} apples and sells {c}. How many apples are left?",
    "What is ({a} + {c}) * {b}?",
    "A train covers {a} km per hour for {b} hours, then {c} km more. How far does it go?",
)
_EXPRESSIONS = ("{a} * {b} - {c}", "({a} + {c}) * {b}", "{a} * {b} + {c}")


class ToolMathArgs(ChatMultiTurnArgs):
    """``agent_args`` of ``ToolMathEnvironment``."""

    max_turns: int = Field(4, ge=1, le=64, description="Most model turns per rollout.")
    tools: list[Literal["calculator", "python"]] = Field(
        ["calculator", "python"], description="The tools offered to the model."
    )
    max_value: int = Field(99, ge=2, le=10**6, description="Operands are drawn from 2..max_value.")
    max_tokens: int | None = Field(
        None, ge=1, le=1 << 20, description="Tokens per model turn (None: the trainer's)."
    )
    python_timeout_s: float = Field(5.0, gt=0, le=60, description="Wall time of a python call.")
    python_memory_mb: int = Field(256, ge=64, le=8192, description="Memory of a python call.")
    python_isolation: Literal["bubblewrap", "unsafe-audit-hook"] = Field(
        "bubblewrap",
        description="How the python tool isolates the model's code: 'bubblewrap' (the kernel's "
        "namespaces, seccomp and limits; the environment refuses to start where the host cannot "
        "run it) or 'unsafe-audit-hook' (an in-process guard against mistakes, no boundary).",
    )


class ToolMathEnvironment(ChatMultiTurnEnvironment):
    """Arithmetic word problems solved with tools (see the module docstring)."""

    Args = ToolMathArgs
    args: ToolMathArgs

    def __init__(self, env_id: str, args: ToolMathArgs | None = None) -> None:
        super().__init__(env_id, args)
        made = {"calculator": calculator_tool, "python": self._python}
        self._tools: list[Tool] = [made[name]() for name in self.args.tools]

    def _python(self) -> Tool:
        args = self.args
        return python_tool(args.python_timeout_s, args.python_memory_mb, args.python_isolation)

    def make_problem(self, rng: random.Random) -> Problem:
        """Three operands and one of the question shapes."""
        a, b, c = (rng.randint(2, self.args.max_value) for _ in range(3))
        shape = rng.randrange(len(_TEMPLATES))
        value = calculate(_EXPRESSIONS[shape].format(a=a, b=b, c=c))
        question = _TEMPLATES[shape].format(a=a, b=b, c=c)
        return Problem(
            problem_id=f"tool_math:{shape}:{a}:{b}:{c}",
            prompt=None,
            answer=format_number(value),
            max_tokens=self.args.max_tokens,
            messages=(
                ChatMessage(role="system", content=SYSTEM),
                ChatMessage(role="user", content=question),
            ),
        )

    def tools(self, problem: Problem) -> list[dict[str, Any]] | None:
        """The schemas of the configured tools."""
        return [t.schema for t in self._tools] or None

    async def respond(self, problem: Problem, turns: list[ChatTurn]) -> Reply | None:
        """Tool results, the end (an answer), or a nudge."""
        last = turns[-1]
        calls = last.parsed.tool_calls
        if calls:
            ids = [call_id(last.turn, i) for i in range(len(calls))]
            messages, errors = await answer_calls(self._tools, calls, ids)
            return Reply(messages, tool_errors=errors)
        if _ANSWER.search(last.parsed.content):
            return None
        return Reply([ChatMessage(role="user", content=NUDGE)])

    async def reward(self, problem: Problem, episode: ChatEpisode) -> float:
        """1 when the last turn answers the value."""
        found = _ANSWER.findall(episode.turns[-1].parsed.content)
        if not found:
            return 0.0
        return float(format_number(float(found[-1])) == problem.answer)
