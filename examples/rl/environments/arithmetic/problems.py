"""One-step arithmetic word problems, generated from a seed (pure: no I/O, no global RNG).

``generate_problems(num_problems, seed, operations, max_operand, max_factor)`` returns the same
tuple for the same arguments, on every machine and Python 3 version (it uses only
``random.Random(seed)``'s ``randrange`` and ``choice``). Each problem is drawn as:

1. an operation, uniformly from ``operations``;
2. a phrasing of that operation, uniformly from its ``PHRASINGS`` (three each), a name from
   ``NAMES``, an object from ``OBJECTS``;
3. the numbers:

   * ``add``: a and b uniform in 1..max_operand; answer a + b;
   * ``subtract``: a uniform in 1..max_operand, b uniform in 1..a; answer a - b (0..a - 1);
   * ``multiply``: k and e uniform in 2..max_factor; answer k x e.

Every template names the person, so each (phrasing, name, object, a, b) is its own question. A
question whose text was drawn before is dropped and drawn again, so the list holds
``num_problems`` distinct questions in draw order; asking for more than ``capacity`` (the number
of distinct questions the arguments can give) raises ``ValueError``. Every answer is a
non-negative integer and the question states both numbers as digits, first a (or k), then b (or
e). Counts of one use the singular ("1 apple").
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Operation = Literal["add", "subtract", "multiply"]
OPERATIONS: tuple[Operation, ...] = ("add", "subtract", "multiply")
MIN_FACTOR = 2

NAMES: tuple[str, ...] = tuple(
    "Anna Ben Carla David Emma Farid Grace Hugo Ines Jack Kemal Lena Maya Noah Olga Pedro".split()
)
OBJECTS: tuple[tuple[str, str], ...] = (
    ("apple", "apples"),
    ("marble", "marbles"),
    ("sticker", "stickers"),
    ("pencil", "pencils"),
    ("book", "books"),
    ("cookie", "cookies"),
    ("stamp", "stamps"),
    ("shell", "shells"),
    ("card", "cards"),
    ("balloon", "balloons"),
    ("coin", "coins"),
    ("toy car", "toy cars"),
)
"""(singular, plural) of each object."""

PHRASINGS: dict[Operation, tuple[str, ...]] = {
    "add": (
        "{name} has {a}. {name} gets {b_count} more {b_noun}. "
        "How many {objects} does {name} have now?",
        "A box holds {a}. {name} puts {b_count} more {b_noun} in the box. "
        "How many {objects} are in the box now?",
        "{name} collected {a} on Monday and {b} on Tuesday. "
        "How many {objects} did {name} collect in all?",
    ),
    "subtract": (
        "{name} has {a}. {name} gives {b} away. How many {objects} does {name} have left?",
        "A basket holds {a}. {name} takes {b} out of the basket. "
        "How many {objects} are left in the basket?",
        "{name} had {a} and lost {b}. How many {objects} does {name} have now?",
    ),
    "multiply": (
        "{name} has {a_count} bags with {b} in each bag. How many {objects} does {name} have?",
        "{name} buys {a_count} boxes of {objects}. Each box holds {b}. "
        "How many {objects} does {name} buy?",
        "{name} makes {a_count} rows of {objects} with {b} in each row. "
        "How many {objects} are in the rows?",
    ),
}
"""Question templates: ``{a}``/``{b}`` become counts with their noun ("3 apples"),
``{a_count}``/``{b_count}`` the bare numbers, ``{b_noun}`` the noun agreeing with b,
``{objects}`` the plural and ``{name}`` the name."""


@dataclass(frozen=True)
class ArithmeticProblem:
    """One word problem: its text, its operation and numbers, and the answer."""

    question: str
    operation: Operation
    operands: tuple[int, int]
    """(a, b) in the order the question states them."""
    answer: int


def count(number: int, noun: tuple[str, str]) -> str:
    """``number`` with its noun: "1 apple", "3 apples"."""
    return f"{number} {noun[0] if number == 1 else noun[1]}"


def solve(operation: Operation, a: int, b: int) -> int:
    """The answer of ``a <operation> b``."""
    if operation == "add":
        return a + b
    if operation == "subtract":
        return a - b
    return a * b


def operand_pairs(operation: Operation, max_operand: int, max_factor: int) -> int:
    """How many (a, b) pairs ``operation`` can draw."""
    if operation == "add":
        return max_operand * max_operand
    if operation == "subtract":
        return max_operand * (max_operand + 1) // 2
    return (max_factor - MIN_FACTOR + 1) ** 2


def capacity(operations: Sequence[Operation], max_operand: int, max_factor: int) -> int:
    """How many distinct questions the arguments can give."""
    return sum(
        len(PHRASINGS[op]) * len(NAMES) * len(OBJECTS) * operand_pairs(op, max_operand, max_factor)
        for op in set(operations)
    )


def draw_problem(
    rng: random.Random, operations: Sequence[Operation], max_operand: int, max_factor: int
) -> ArithmeticProblem:
    """One problem drawn with ``rng`` (steps 1-3 of the module docstring)."""
    operation = rng.choice(operations)
    template = rng.choice(PHRASINGS[operation])
    name = rng.choice(NAMES)
    noun = rng.choice(OBJECTS)
    if operation == "add":
        a, b = rng.randrange(1, max_operand + 1), rng.randrange(1, max_operand + 1)
    elif operation == "subtract":
        a = rng.randrange(1, max_operand + 1)
        b = rng.randrange(1, a + 1)
    else:
        a, b = rng.randrange(MIN_FACTOR, max_factor + 1), rng.randrange(MIN_FACTOR, max_factor + 1)
    question = template.format(
        name=name,
        a=count(a, noun),
        b=count(b, noun),
        a_count=a,
        b_count=b,
        b_noun=noun[0] if b == 1 else noun[1],
        objects=noun[1],
    )
    return ArithmeticProblem(question, operation, (a, b), solve(operation, a, b))


def generate_problems(
    num_problems: int,
    seed: int,
    operations: Sequence[Operation] = ("add", "subtract"),
    max_operand: int = 20,
    max_factor: int = 9,
) -> tuple[ArithmeticProblem, ...]:
    """``num_problems`` distinct problems drawn from ``random.Random(seed)`` (module docstring)."""
    if (
        not operations
        or set(operations) - set(OPERATIONS)
        or len(set(operations)) < len(operations)
    ):
        raise ValueError(f"operations must be distinct names from {OPERATIONS}, got {operations}")
    if max_operand < 1 or max_factor < MIN_FACTOR:
        raise ValueError(f"max_operand must be >= 1 and max_factor >= {MIN_FACTOR}")
    available = capacity(operations, max_operand, max_factor)
    if not 1 <= num_problems <= available:
        raise ValueError(
            f"num_problems must be in 1..{available} (the distinct questions of these operations "
            f"and operand ranges), got {num_problems}"
        )
    rng = random.Random(seed)
    problems: dict[str, ArithmeticProblem] = {}
    while len(problems) < num_problems:
        problem = draw_problem(rng, operations, max_operand, max_factor)
        problems.setdefault(problem.question, problem)
    return tuple(problems.values())
