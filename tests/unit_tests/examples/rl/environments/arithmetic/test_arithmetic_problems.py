"""The arithmetic word-problem generator: a pure function of its arguments, distinct questions,
answers that follow from the numbers the questions state."""

from __future__ import annotations

import re

import pytest

from examples.rl.environments.arithmetic.problems import (
    NAMES,
    OBJECTS,
    capacity,
    generate_problems,
)

ALL = ("add", "subtract", "multiply")


def test_the_same_arguments_give_the_same_list():
    assert generate_problems(500, 0) == generate_problems(500, 0)
    assert generate_problems(500, 3, ALL, 12, 7) == generate_problems(500, 3, ALL, 12, 7)


def test_another_dataset_seed_gives_another_list():
    first = [p.question for p in generate_problems(500, 0)]
    other = [p.question for p in generate_problems(500, 1)]
    assert first != other
    assert len(set(first) & set(other)) < 50  # 5% of 500 out of 351360 questions, by chance


def test_a_longer_list_starts_with_the_shorter_one():
    assert generate_problems(800, 0)[:300] == generate_problems(300, 0)


@pytest.mark.parametrize(
    "num, operations, max_operand, max_factor",
    [
        pytest.param(2000, ("add", "subtract"), 20, 9, id="default"),
        pytest.param(2000, ALL, 20, 9, id="all"),
        pytest.param(576, ("add",), 1, 9, id="add-every-question"),
        pytest.param(1728, ("subtract",), 2, 9, id="subtract-every-question"),
        pytest.param(576, ("multiply",), 20, 2, id="multiply-every-question"),
    ],
)
def test_questions_are_distinct(num, operations, max_operand, max_factor):
    """Up to every question the arguments can give (3 phrasings x 16 names x 12 objects x the
    operand pairs: 1 for add with max_operand 1, 3 for subtract with 2, 1 for multiply with 2)."""
    assert num <= capacity(operations, max_operand, max_factor)
    problems = generate_problems(num, 0, operations, max_operand, max_factor)
    assert len({p.question for p in problems}) == len(problems) == num


@pytest.mark.parametrize(
    "operations, max_operand, max_factor",
    [
        pytest.param(("add",), 20, 9, id="add"),
        pytest.param(("subtract",), 20, 9, id="subtract"),
        pytest.param(("multiply",), 20, 9, id="multiply"),
        pytest.param(ALL, 7, 4, id="all-small"),
    ],
)
def test_every_answer_follows_from_the_numbers_of_its_question(operations, max_operand, max_factor):
    problems = generate_problems(1000, 5, operations, max_operand, max_factor)
    assert {p.operation for p in problems} == set(operations)
    for p in problems:
        a, b = (int(n) for n in re.findall(r"\d+", p.question))  # exactly two numbers
        assert (a, b) == p.operands, p
        expected = {"add": a + b, "subtract": a - b, "multiply": a * b}[p.operation]
        assert p.answer == expected >= 0, p
        if p.operation == "multiply":
            assert 2 <= a <= max_factor and 2 <= b <= max_factor, p
        else:
            assert 1 <= a <= max_operand and 1 <= b <= max_operand, p
        assert p.question.endswith("?") and any(name in p.question for name in NAMES)


def test_counts_of_one_are_singular():
    problems = generate_problems(2000, 0, ALL, max_operand=3)
    ones = [p.question for p in problems if 1 in p.operands]
    assert len(ones) > 100
    plurals = "|".join(plural for _, plural in OBJECTS)
    for question in ones:
        assert not re.search(rf"\b1 (more )?({plurals})\b", question), question


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(
            {"num_problems": 577, "operations": ("add",), "max_operand": 1},
            "num_problems must be in 1..576",
            id="over-capacity",
        ),
        pytest.param({"num_problems": 0}, "num_problems must be in 1..", id="none"),
        pytest.param({"operations": ()}, "operations must be distinct", id="no-operation"),
        pytest.param({"operations": ("add", "add")}, "operations must be distinct", id="repeated"),
        pytest.param({"operations": ("divide",)}, "operations must be distinct", id="unknown"),
        pytest.param({"max_factor": 1}, "max_factor >= 2", id="factor"),
    ],
)
def test_impossible_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        generate_problems(**{"num_problems": 10, "seed": 0, **kwargs})
