"""A small, safe parser and exact evaluator for countdown answers (no ``eval`` on model text).

Grammar (whitespace between tokens is ignored)::

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := NUMBER | "(" expr ")"
    NUMBER := "0" | [1-9][0-9]*          (a non-negative integer written without leading zeros)

There is no unary minus: every literal must be one of the puzzle's numbers. Operators have the
usual precedence and associate to the left. Evaluation is exact (``fractions.Fraction``), so
``7/2*2`` is 7 and ``1/3*3`` is 1; dividing by zero raises ``ZeroDivisionError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

OPERATORS = "+-*/"
MAX_NESTING = 32
"""Deepest parenthesis nesting accepted (keeps the recursive parser far from Python's limit)."""
MAX_LENGTH = 1000
"""Longest expression accepted, in characters."""


class ExpressionError(ValueError):
    """The text is not an expression of the grammar above; the message says where."""


@dataclass(frozen=True)
class Number:
    """An integer literal."""

    value: int


@dataclass(frozen=True)
class BinaryOp:
    """``left op right`` with ``op`` one of ``+ - * /``."""

    op: str
    left: Node
    right: Node


Node = Number | BinaryOp


def tokenize(text: str) -> list[str]:
    """Split ``text`` into number, operator and parenthesis tokens, dropping whitespace."""
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    tokens: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in "0123456789":
            j = i
            while j < len(text) and text[j] in "0123456789":
                j += 1
            literal = text[i:j]
            if len(literal) > 1 and literal[0] == "0":
                raise ExpressionError(f"number {literal!r} at position {i} has a leading zero")
            tokens.append(literal)
            i = j
        elif ch in OPERATORS or ch in "()":
            tokens.append(ch)
            i += 1
        else:
            raise ExpressionError(f"unexpected character {ch!r} at position {i}")
    return tokens


class _Parser:
    """Recursive-descent parser over a token list."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ExpressionError("unexpected end of expression")
        self.pos += 1
        return token

    def expr(self) -> Node:
        node = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            node = BinaryOp(op, node, self.term())
        return node

    def term(self) -> Node:
        node = self.factor()
        while self.peek() in ("*", "/"):
            op = self.take()
            node = BinaryOp(op, node, self.factor())
        return node

    def factor(self) -> Node:
        token = self.take()
        if token.isdigit():
            return Number(int(token))
        if token == "(":
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise ExpressionError(f"parentheses nested deeper than {MAX_NESTING}")
            node = self.expr()
            if self.take() != ")":
                raise ExpressionError(f"expected ')' at token {self.pos - 1}")
            self.depth -= 1
            return node
        raise ExpressionError(f"expected a number or '(' at token {self.pos - 1}, got {token!r}")


def parse(text: str) -> Node:
    """The syntax tree of ``text``; raises ``ExpressionError`` if it is not a full expression."""
    tokens = tokenize(text)
    if not tokens:
        raise ExpressionError("empty expression")
    parser = _Parser(tokens)
    node = parser.expr()
    if parser.pos != len(tokens):
        raise ExpressionError(f"unexpected {tokens[parser.pos]!r} at token {parser.pos}")
    return node


def literals(node: Node) -> list[int]:
    """The integer literals of ``node``, left to right."""
    if isinstance(node, Number):
        return [node.value]
    return literals(node.left) + literals(node.right)


def evaluate(node: Node) -> Fraction:
    """The exact value of ``node``; raises ``ZeroDivisionError`` on a division by zero."""
    if isinstance(node, Number):
        return Fraction(node.value)
    left, right = evaluate(node.left), evaluate(node.right)
    if node.op == "+":
        return left + right
    if node.op == "-":
        return left - right
    if node.op == "*":
        return left * right
    return left / right  # Fraction raises ZeroDivisionError for a zero divisor
