"""Math answers: boxed extraction, final-answer fallback, normalization and matching."""

from __future__ import annotations

import pytest

from examples.rl.environments.math.answers import (
    answers_match,
    extract_boxed,
    final_answer,
    normalize_answer,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param(r"so \boxed{42}.", "42", id="latex"),
        pytest.param("boxed{42}", "42", id="no-backslash"),
        pytest.param(r"\boxed {7}", "7", id="space-before-brace"),
        pytest.param(r"\boxed{1} then \boxed{2}", "2", id="last-wins"),
        pytest.param(r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", id="nested-braces"),
        pytest.param(r"\boxed{3} then \boxed{4", "3", id="last-unclosed-falls-back"),
        pytest.param(r"\boxed{12", None, id="unclosed"),
        pytest.param(r"\boxed{}", "", id="empty-box"),
        pytest.param("42", None, id="no-box"),
        pytest.param("", None, id="empty"),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, require_boxed, expected",
    [
        pytest.param("42", False, "42", id="bare"),
        pytest.param("6*7=42", False, "42", id="after-equals"),
        pytest.param("1=2=3", False, "3", id="after-last-equals"),
        pytest.param(r"\boxed{5} = 6", False, "5", id="boxed-wins"),
        pytest.param("6*7=", False, None, id="nothing-after-equals"),
        pytest.param("  ", False, None, id="blank"),
        pytest.param("", False, None, id="empty"),
        pytest.param("42", True, None, id="required-box-missing"),
        pytest.param(r"\boxed{42}", True, "42", id="required-box-present"),
    ],
)
def test_final_answer(text, require_boxed, expected):
    assert final_answer(text, require_boxed) == expected


@pytest.mark.parametrize(
    "text, normalized",
    [
        pytest.param("42", "42", id="integer"),
        pytest.param(" 42 ", "42", id="whitespace"),
        pytest.param("42.", "42", id="trailing-period"),
        pytest.param("42.0", "42", id="integral-decimal"),
        pytest.param("+42", "42", id="plus-sign"),
        pytest.param("-3", "-3", id="negative"),
        pytest.param("-0", "0", id="negative-zero"),
        pytest.param("0.5", "1/2", id="decimal"),
        pytest.param(".50", "1/2", id="leading-dot"),
        pytest.param("3.75", "15/4", id="decimal-to-fraction"),
        pytest.param("2/4", "1/2", id="reduced-fraction"),
        pytest.param("-6/4", "-3/2", id="negative-fraction"),
        pytest.param(r"\frac{1}{2}", "1/2", id="latex-frac"),
        pytest.param(r"\dfrac{1}{2}", "1/2", id="dfrac"),
        pytest.param(r"\tfrac{3}{6}", "1/2", id="tfrac"),
        pytest.param(r"$\frac12$", "1/2", id="short-frac-in-dollars"),
        pytest.param(r"-\frac{1}{2}", "-1/2", id="negative-latex-frac"),
        pytest.param("1,000", "1000", id="thousands-separator"),
        pytest.param("1,234,567.0", "1234567", id="thousands-with-decimal"),
        pytest.param("1,2", "1,2", id="list-not-thousands"),
        pytest.param("$42$", "42", id="dollars"),
        pytest.param(r"\$42", "42", id="escaped-dollar"),
        pytest.param(r"50\%", "50", id="percent"),
        pytest.param(r"90^\circ", "90", id="degrees"),
        pytest.param(r"90^{\circ}", "90", id="degrees-braced"),
        pytest.param(r"\text{ yes }", "yes", id="text-wrapper"),
        pytest.param(r"5\,\text{cm}", "5cm", id="units-kept"),
        pytest.param(r"\left(1, 2\right)", "(1,2)", id="left-right"),
        pytest.param(r"\frac{a+b}{c}", "(a+b)/(c)", id="symbolic-frac"),
        pytest.param("1/0", "1/0", id="zero-denominator-kept"),
        pytest.param("x + 1", "x+1", id="expression"),
    ],
)
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


@pytest.mark.parametrize(
    "predicted, reference, match",
    [
        pytest.param("42", "42", True, id="same"),
        pytest.param("42.0", "42", True, id="decimal-vs-integer"),
        pytest.param("0.5", r"\frac{1}{2}", True, id="decimal-vs-frac"),
        pytest.param("1000", "1,000", True, id="thousands"),
        pytest.param("41", "42", False, id="wrong"),
        pytest.param("3", "-3", False, id="sign"),
        pytest.param("0.33", "1/3", False, id="rounded-is-wrong"),
        pytest.param(None, "42", False, id="no-answer"),
        pytest.param("", "", False, id="empty-never-matches"),
        pytest.param("$ $", "", False, id="normalizes-to-empty"),
    ],
)
def test_answers_match(predicted, reference, match):
    assert answers_match(predicted, reference) is match
