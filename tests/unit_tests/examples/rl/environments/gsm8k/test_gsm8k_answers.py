"""Answer extraction from completions and math-verify scoring, by hand-chosen cases."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from examples.rl.environments.gsm8k.answers import (
    extract_answer,
    stated_answer,
    states_answer,
    verify_answer,
)


@pytest.mark.parametrize(
    "text, mode, answer",
    [
        pytest.param("so the answer is \\boxed{14}.", "boxed", "14", id="boxed"),
        pytest.param(
            "\\boxed{3} then \\boxed{\\frac{1}{2}}", "boxed", "\\frac{1}{2}", id="last-box"
        ),
        pytest.param("The answer is 14.", "boxed", None, id="boxed-missing"),
        pytest.param("12 + 7 = 19\n#### 19\nextra 5", "hashes", "19", id="hashes-line"),
        pytest.param("#### \n", "hashes", None, id="hashes-empty"),
        pytest.param("#### \n5 more", "hashes", None, id="hashes-own-line-only"),
        pytest.param("2 boxes of 6 is 12 pencils.", "last_number", "12", id="last-number"),
        pytest.param("It costs $1,200.50 in total", "last_number", "1200.50", id="thousands"),
        pytest.param("down to -7 degrees", "last_number", "-7", id="negative"),
        pytest.param("no digits here", "last_number", None, id="no-number"),
        pytest.param("7 then #### 9 or \\boxed{11}", "auto", "11", id="auto-boxed-first"),
        pytest.param("7 then #### 9", "auto", "9", id="auto-hashes-next"),
        pytest.param("7 then 9 dollars", "auto", "9", id="auto-last-number"),
        pytest.param("\\boxed{} and 5", "auto", "5", id="auto-skips-empty-box"),
    ],
)
def test_extract_answer(text, mode, answer):
    assert extract_answer(text, mode) == answer


@pytest.mark.parametrize(
    "text, mode, stated",
    [
        pytest.param("\\boxed{3}", "auto", True, id="auto-box"),
        pytest.param("#### 3", "auto", True, id="auto-hashes"),
        pytest.param("it is 3", "auto", False, id="auto-bare-number"),
        pytest.param("it is 3", "last_number", True, id="number-mode"),
        pytest.param("#### 3", "boxed", False, id="boxed-mode"),
        pytest.param("\\boxed{}", "auto", False, id="empty-box"),
        pytest.param("\\boxed{ }", "auto", False, id="blank-box"),
        pytest.param("\\boxed{} = 4 + 7 = 11", "auto", False, id="empty-box-then-number"),
        pytest.param("\\boxed{}", "boxed", False, id="empty-box-boxed-mode"),
        pytest.param("#### ", "auto", False, id="bare-hashes"),
        pytest.param("\\boxed{the answer}", "auto", False, id="unparseable-box"),
        pytest.param("#### N/A", "hashes", False, id="unparseable-hashes"),
        pytest.param("\\boxed{2^{9^{9}}}", "auto", False, id="refused-power"),
        pytest.param("\\boxed{\\frac{1}{2}}", "auto", True, id="latex-box"),
        pytest.param("\\boxed{5} then \\boxed{}", "auto", False, id="last-box-empty"),
        pytest.param("\\boxed{} #### 7", "auto", True, id="empty-box-then-hashes"),
    ],
)
def test_states_answer(text, mode, stated):
    assert states_answer(text, mode) is stated


@pytest.mark.parametrize(
    "text, mode, answer",
    [
        pytest.param("\\boxed{ 7 }", "auto", " 7 ", id="box-as-written"),
        pytest.param("\\boxed{ }", "auto", None, id="blank-box"),
        pytest.param("\\boxed{ } #### 7", "auto", "7", id="hashes-after-blank-box"),
        pytest.param("it is 7", "auto", None, id="bare-number-is-not-stated"),
        pytest.param("it is 7", "last_number", "7", id="number-mode"),
    ],
)
def test_stated_answer(text, mode, answer):
    assert stated_answer(text, mode) == answer


@pytest.mark.parametrize(
    "gold, predicted, correct",
    [
        pytest.param("18", "18", True, id="same"),
        pytest.param("18", "18.0", True, id="decimal-zero"),
        pytest.param("18", "$18", True, id="dollars"),
        pytest.param("18", "\\frac{36}{2}", True, id="fraction"),
        pytest.param("2.5", "\\frac{5}{2}", True, id="decimal-vs-fraction"),
        pytest.param("1200", "1,200", True, id="thousands"),
        pytest.param("-7", "-7", True, id="negative"),
        pytest.param("18", "19", False, id="wrong"),
        pytest.param("-7", "7", False, id="sign"),
        pytest.param("18", "eighteen", False, id="words"),
        pytest.param("8", "2^3", False, id="power-not-evaluated"),
        pytest.param("1", "9^{9^{9^{9}}}", False, id="tower-refused-fast"),
        pytest.param("6", "3!", False, id="factorial-not-evaluated"),
        pytest.param("5", "5" + " " * 80, False, id="too-long"),
    ],
)
def test_verify_answer(gold, predicted, correct):
    start = time.monotonic()
    assert verify_answer(gold, predicted) is correct
    assert time.monotonic() - start < 3


def test_a_timer_of_the_host_survives_verification():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert verify_answer("14", "14")
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left <= 30.0  # math-verify's alarm(0) would have cancelled it
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired


def test_verification_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(verify_answer("2.5", "5/2")))
    thread.start()
    thread.join(timeout=30)
    assert results == [True]
