"""The ``calculator`` tool: arithmetic on numbers, evaluated from the syntax tree (never ``eval``).

Accepted: int and float literals, ``+ - * / // % **``, unary ``+ -``, parentheses and the
functions ``abs``, ``round``, ``min``, ``max``, ``sqrt``. Everything else (names, attributes,
calls of anything else, strings, comprehensions) is refused with ``ToolError``, as are
expressions longer than ``MAX_EXPRESSION`` characters and powers or results whose size could
exhaust the process (``MAX_EXPONENT``, ``MAX_MAGNITUDE``, ``MAX_ROUND_DIGITS``): every argument that
sets the size of the work is bounded before the work is done, so a call costs microseconds.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from megatron.rl.tools.errors import ToolError

MAX_EXPRESSION = 512
"""Longest expression accepted, in characters."""
MAX_EXPONENT = 256
"""Largest absolute exponent of ``**``."""
MAX_MAGNITUDE = 10**100
"""Largest absolute value of any intermediate result."""
MAX_ROUND_DIGITS = 100
"""Largest absolute ``ndigits`` of ``round`` (``round(n, -10**9)`` would build 10**(10**9))."""

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
}

SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % **, parentheses, abs, "
        "round, min, max, sqrt).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
}
"""The tool's OpenAI function schema."""


def calculate(expression: str) -> int | float:
    """The value of ``expression``; ``ToolError`` saying what is refused or failed."""
    if len(expression) > MAX_EXPRESSION:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None
    try:
        return _value(tree.body)
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise ToolError(f"{type(exc).__name__}: {exc}") from None


def format_number(value: int | float) -> str:
    """``value`` as the tool answers it: integral floats without ``.0``."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ToolError(f"only numbers are allowed, not {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponents are limited to {MAX_EXPONENT}")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        function = _FUNCTIONS.get(node.func.id)
        if function is None:
            raise ToolError(f"unknown function {node.func.id!r}; known: {', '.join(_FUNCTIONS)}")
        args = [_value(arg) for arg in node.args]
        if function is round and len(args) == 2:
            _check_round_digits(args[1])
        return _bounded(function(*args))
    raise ToolError(f"{type(node).__name__} is not allowed in an arithmetic expression")


def _check_round_digits(ndigits: int | float) -> None:
    if not isinstance(ndigits, int):
        raise ToolError("round's second argument must be an integer")
    if abs(ndigits) > MAX_ROUND_DIGITS:
        raise ToolError(f"round's second argument is limited to +-{MAX_ROUND_DIGITS}")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError("the result is too large")
    return value
