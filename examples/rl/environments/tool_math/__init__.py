"""Arithmetic with a calculator and a sandboxed python tool (a chat multi-turn environment).

Use it as ``agent_type: examples.rl.environments.tool_math:ToolMathEnvironment``; see
``environment.py``.
"""

from examples.rl.environments.tool_math.environment import ToolMathArgs, ToolMathEnvironment

__all__ = ["ToolMathArgs", "ToolMathEnvironment"]
