"""Digit tasks: positional partial-credit reward and problems that follow the module's task table."""

from __future__ import annotations

import random
import re

import pytest
from pydantic import ValidationError

from megatron.rl.environments import digits
from megatron.rl.environments.digits import (
    DigitTaskArgs,
    DigitTaskEnvironment,
    positional_match_reward,
)
from megatron.rl.tokenizer import CharTokenizer

TASKS = ["copy", "reverse", "sort", "add"]


@pytest.mark.parametrize(
    "answer, completion, reward",
    [
        pytest.param("4071", "4071", 1.0, id="exact"),
        pytest.param("4071", "40", 0.5, id="right-prefix"),
        pytest.param("123", "1", 1 / 3, id="one-of-three"),
        pytest.param("4071", "407123", 4 / 6, id="extra-chars"),
        pytest.param("4071", "1704", 0.0, id="no-position-matches"),
        pytest.param("4071", "4970", 0.5, id="scattered-matches"),
        pytest.param("65", "", 0.0, id="empty-completion"),
        pytest.param("", "12", 0.0, id="empty-answer"),
        pytest.param("", "", 1.0, id="both-empty"),
    ],
)
def test_positional_match_reward(answer, completion, reward):
    assert positional_match_reward(answer, completion) == pytest.approx(reward)


def env(task: str, **kwargs) -> DigitTaskEnvironment:
    return DigitTaskEnvironment(task, DigitTaskArgs(task=task, **kwargs))


def expected_answer(task: str, prompt: str) -> str:
    """The answer read off the task table in the module docstring."""
    if task == "add":
        match = re.fullmatch(r"(\d+)\+(\d+)=", prompt)
        assert match, prompt
        return str(int(match[1]) + int(match[2]))
    marker = {"copy": "=", "reverse": ":", "sort": ","}[task]
    assert prompt.endswith(marker) and prompt[:-1].isdigit(), prompt
    s = prompt[:-1]
    return {"copy": s, "reverse": s[::-1], "sort": "".join(sorted(s))}[task]


def operands(task: str, prompt: str) -> list[str]:
    return prompt[:-1].split("+") if task == "add" else [prompt[:-1]]


@pytest.mark.parametrize("task", TASKS)
def test_problems_follow_the_task_table(task):
    e = env(task, min_digits=2, max_digits=4, slack_tokens=3)
    rng = random.Random(0)
    tokenizer = CharTokenizer()
    lengths = set()
    for _ in range(200):
        p = e.make_problem(rng)
        assert p.answer == expected_answer(task, p.prompt)
        assert p.problem_id == f"{task}:{p.prompt}"
        assert p.max_tokens == len(p.answer) + 3
        tokenizer.encode(p.prompt + p.answer)  # only characters of the tokenizer alphabet
        for operand in operands(task, p.prompt):
            assert 2 <= len(operand) <= 4
            lengths.add(len(operand))
        assert e.reward(p, p.answer) == 1.0
    assert lengths == {2, 3, 4}  # every allowed length is drawn


@pytest.mark.parametrize(
    "task, prompt, answer",
    [
        pytest.param("copy", "4071=", "4071", id="copy"),
        pytest.param("reverse", "4071:", "1704", id="reverse"),
        pytest.param("sort", "4071,", "0147", id="sort"),
        pytest.param("add", "47+18=", "65", id="add"),
    ],
)
def test_reference_answers_agree_with_docstring_table(task, prompt, answer):
    row = re.search(rf"^{task}\s+``\"(.*?)\"``\s+``\"(.*?)\"``$", digits.__doc__, re.M)
    assert row is not None and (row[1], row[2]) == (prompt, answer)
    assert expected_answer(task, prompt) == answer


@pytest.mark.parametrize("task", TASKS)
def test_make_problem_is_deterministic_for_a_seeded_rng(task):
    e = env(task)
    first = [e.make_problem(random.Random(seed)) for seed in range(20)]
    again = [e.make_problem(random.Random(seed)) for seed in range(20)]
    assert first == again
    assert len({p.prompt for p in first}) > 5  # different seeds give different problems


def test_add_keeps_leading_zeros_in_prompt_but_not_in_answer():
    e = env("add", min_digits=3, max_digits=3)
    rng = random.Random(1)
    problems = [e.make_problem(rng) for _ in range(300)]
    with_zero = [p for p in problems if p.prompt.startswith("0")]
    assert with_zero
    for p in with_zero:
        assert p.answer == str(int(p.prompt[:3]) + int(p.prompt[4:7]))
        assert not p.answer.startswith("0") or p.answer == "0"


def test_reward_uses_positional_match():
    e = env("copy")
    p = e.make_problem(random.Random(3))
    assert e.reward(p, p.answer + "9") == pytest.approx(len(p.answer) / (len(p.answer) + 1))
    assert e.reward(p, "") == 0.0


def test_default_args():
    args = DigitTaskArgs()
    assert (args.task, args.min_digits, args.max_digits, args.slack_tokens) == ("copy", 1, 3, 2)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        pytest.param({"min_digits": 4, "max_digits": 3}, "min_digits", id="min-above-max"),
        pytest.param({"min_digits": 0}, "min_digits", id="zero-min"),
        pytest.param({"max_digits": 17}, "max_digits", id="max-too-large"),
        pytest.param({"task": "multiply"}, "task", id="unknown-task"),
        pytest.param({"slack_tokens": 0}, "slack_tokens", id="zero-slack"),
        pytest.param({"max_digit": 3}, "max_digit", id="misspelled-key"),
    ],
)
def test_digit_task_args_rejects(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        DigitTaskArgs(**kwargs)


def test_equal_min_and_max_digits_allowed():
    e = env("reverse", min_digits=5, max_digits=5)
    p = e.make_problem(random.Random(0))
    assert len(p.prompt) == 6 and len(p.answer) == 5
