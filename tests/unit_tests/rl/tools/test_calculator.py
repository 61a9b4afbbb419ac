"""The calculator evaluates arithmetic from the syntax tree and refuses everything else."""

from __future__ import annotations

import pytest

from megatron.rl.tools.calculator import MAX_EXPRESSION, calculate, format_number
from megatron.rl.tools.errors import ToolError


@pytest.mark.parametrize(
    "expression, value",
    [
        pytest.param("(12 + 7) * 3", 57, id="parentheses"),
        pytest.param("-2 ** 2 + 7 // 2 + 7 % 4", -4 + 3 + 3, id="precedence"),
        pytest.param(
            "sqrt(16) + abs(-3) + max(1, 5) + min(2, 9) + round(2.6)",
            4 + 3 + 5 + 2 + 3,
            id="functions",
        ),
        pytest.param("1 / 4", 0.25, id="division"),
    ],
)
def test_arithmetic_is_evaluated(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, needle",
    [
        pytest.param("__import__('os').system('ls')", "Call is not allowed", id="import"),
        pytest.param("open('/etc/passwd')", "unknown function 'open'", id="open"),
        pytest.param("(1).__class__", "Attribute is not allowed", id="attribute"),
        pytest.param("x + 1", "Name is not allowed", id="name"),
        pytest.param("'a' * 3", "only numbers", id="string"),
        pytest.param("[1, 2]", "List is not allowed", id="list"),
        pytest.param("9 ** 9 ** 9", "exponents are limited", id="huge-power"),
        pytest.param("10 ** 200", "too large", id="power"),
        pytest.param("10 ** 99 * 10 ** 99", "too large", id="too-large"),
        pytest.param("1 / 0", "ZeroDivisionError", id="zero-division"),
        pytest.param("sqrt(-1)", "ValueError", id="domain"),
        pytest.param("1 +", "not an arithmetic expression", id="syntax"),
        pytest.param("1+" * MAX_EXPRESSION + "1", "longer than", id="too-long"),
        pytest.param("True + 1", "only numbers", id="bool"),
        pytest.param("round(12345, -10 ** 9)", "limited to", id="round-huge-negative-digits"),
        pytest.param("round(1.5, 10 ** 9)", "limited to", id="round-huge-digits"),
        pytest.param("round(2, 1.5)", "must be an integer", id="round-float-digits"),
        pytest.param("9" * 101, "too large", id="huge-literal"),
        pytest.param("(10 ** 99) ** 256", "too large", id="huge-base"),
        pytest.param("max(" + "1," * 300 + "1)", "longer than", id="many-arguments"),
    ],
)
def test_anything_else_is_refused_with_a_reason(expression, needle):
    with pytest.raises(ToolError, match=needle):
        calculate(expression)


def test_integral_results_print_as_integers():
    assert [format_number(v) for v in (4.0, 0.25, 7)] == ["4", "0.25", "7"]


def test_every_bounded_expression_answers_in_milliseconds():
    """The largest work each bound admits (power, rounding, long arithmetic) finishes at once."""
    import time

    for expression in (
        "(10 ** 99) ** 256 % 7",
        "round(10 ** 99, -100)",
        "round(0.5, 100)",
        "+".join(["10 ** 99"] * 40),
    ):
        started = time.perf_counter()
        try:
            calculate(expression)
        except ToolError:
            pass
        assert time.perf_counter() - started < 0.5, expression
