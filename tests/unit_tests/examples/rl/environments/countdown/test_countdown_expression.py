"""Countdown expression parser and exact evaluator: values, literals and rejected inputs."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from examples.rl.environments.countdown.expression import (
    MAX_LENGTH,
    MAX_NESTING,
    BinaryOp,
    ExpressionError,
    Number,
    evaluate,
    literals,
    parse,
    tokenize,
)


@pytest.mark.parametrize(
    "text, value",
    [
        pytest.param("42", 42, id="single-number"),
        pytest.param("0", 0, id="zero"),
        pytest.param("1+2*3", 7, id="mul-before-add"),
        pytest.param("(1+2)*3", 9, id="parentheses"),
        pytest.param("10-4-3", 3, id="sub-left-assoc"),
        pytest.param("24/4/2", 3, id="div-left-assoc"),
        pytest.param("2*3-4*5", -14, id="negative-result"),
        pytest.param("7/2", Fraction(7, 2), id="exact-fraction"),
        pytest.param("1/3*3", 1, id="no-float-rounding"),
        pytest.param(" 3 * ( 4 + 5 ) ", 27, id="spaces-ignored"),
        pytest.param("((5))", 5, id="nested-parentheses"),
        pytest.param("100-(20-5)*2", 70, id="mixed"),
    ],
)
def test_evaluate(text, value):
    assert evaluate(parse(text)) == value


def test_parse_builds_a_left_associative_tree():
    assert parse("8-3-1") == BinaryOp("-", BinaryOp("-", Number(8), Number(3)), Number(1))
    assert parse("2+3*4") == BinaryOp("+", Number(2), BinaryOp("*", Number(3), Number(4)))


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param("3*(4+5)", [3, 4, 5], id="left-to-right"),
        pytest.param("5*5+3", [5, 5, 3], id="repeated"),
        pytest.param("12", [12], id="single"),
    ],
)
def test_literals(text, expected):
    assert literals(parse(text)) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("8/(3-3)", id="zero-subexpression"),
        pytest.param("5/0", id="literal-zero"),
    ],
)
def test_division_by_zero_raises(text):
    with pytest.raises(ZeroDivisionError):
        evaluate(parse(text))


@pytest.mark.parametrize(
    "text, message",
    [
        pytest.param("", "empty", id="empty"),
        pytest.param("   ", "empty", id="blank"),
        pytest.param("1+", "end of expression", id="dangling-operator"),
        pytest.param("+1", "expected a number", id="unary-plus"),
        pytest.param("-3+5", "expected a number", id="unary-minus"),
        pytest.param("1++2", "expected a number", id="double-operator"),
        pytest.param("(1+2", "end of expression", id="unclosed-parenthesis"),
        pytest.param("1+2)", "unexpected ')'", id="extra-parenthesis"),
        pytest.param("()", "expected a number", id="empty-parentheses"),
        pytest.param("3 4", "unexpected '4'", id="two-numbers"),
        pytest.param("07+1", "leading zero", id="leading-zero"),
        pytest.param("2^3", "unexpected character '^'", id="unknown-operator"),
        pytest.param("1.5*2", "unexpected character '.'", id="decimal"),
        pytest.param("x+1", "unexpected character 'x'", id="letter"),
        pytest.param("3*4=12", "unexpected character '='", id="equation"),
        pytest.param("__import__('os')", "unexpected character '_'", id="code"),
    ],
)
def test_malformed_expressions_raise(text, message):
    with pytest.raises(ExpressionError, match=re.escape(message)):
        parse(text)


def test_nesting_limit():
    assert evaluate(parse("(" * MAX_NESTING + "1" + ")" * MAX_NESTING)) == 1
    with pytest.raises(ExpressionError, match="nested deeper"):
        parse("(" * (MAX_NESTING + 1) + "1" + ")" * (MAX_NESTING + 1))
    with pytest.raises(ExpressionError, match="nested deeper"):
        parse("(" * 900)  # stops long before Python's recursion limit


def test_length_limit():
    assert tokenize("1" + "+1" * ((MAX_LENGTH - 1) // 2))
    with pytest.raises(ExpressionError, match="longer than"):
        tokenize("1" * (MAX_LENGTH + 1))


def test_tokenize():
    assert tokenize(" 12*(3 - 45)/6 ") == ["12", "*", "(", "3", "-", "45", ")", "/", "6"]
