r"""Answer extraction from a completion, and scoring with ``math-verify``.

Extraction (``extract_answer(text, mode)``):

* ``boxed``: the content of the last ``\boxed{...}`` (braces may nest);
* ``hashes``: the text after the last ``####`` up to the end of its line (GSM8K's own format);
* ``last_number``: the last number in the text (``-7``, ``2.5``, ``1,200``);
* ``auto``: ``boxed``, else ``hashes``, else ``last_number``.

``stated_answer(text, mode)``: the answer the completion gives in the asked form, or None: for
``auto`` the content of the last ``\boxed{}`` if it is not blank, else the text after the last
``####`` (not just some number); for the other modes ``extract_answer``'s, if not blank.
``states_answer(text, mode)``: whether that answer exists and math-verify parses it (an answer
``verify_answer`` refuses to evaluate does not count); the format reward. So an empty
``\boxed{}``, ``\boxed{ }``, a bare ``#### `` or a box of words earns no format reward.

``verify_answer(gold, predicted)``: ``math_verify.verify(parse(gold), parse(predicted))``, so
``18``, ``18.0``, ``$18``, ``\frac{36}{2}`` all match ``18``. GSM8K answers are numbers: an
answer longer than ``MAX_ANSWER_CHARS`` or with a power or factorial (``^``, ``**``, ``!``) is
not evaluated and scores as wrong, because sympy computes them exactly and a short one such as
``9^{9^{9^9}}`` never finishes. On the main thread (where the trainer and the env server score)
math-verify's own signal timeouts apply as well, without cancelling a SIGALRM timer the host has
set (pytest-timeout's); math-verify cannot time out on other threads.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Literal

from examples.rl.environments.math.answers import extract_boxed

AnswerExtraction = Literal["auto", "boxed", "hashes", "last_number"]
MAX_ANSWER_CHARS = 64
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_EXPLODING = re.compile(r"\^|\*\*|!")


def extract_hashes(text: str) -> str | None:
    """The text after the last ``####`` up to the end of that line, or None."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].split("\n", 1)[0].strip()
    return answer or None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands separators removed), or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_answer(text: str, mode: AnswerExtraction = "auto") -> str | None:
    """The completion's answer by ``mode`` (see the module docstring), or None."""
    if mode == "boxed":
        return extract_boxed(text)
    if mode == "hashes":
        return extract_hashes(text)
    if mode == "last_number":
        return extract_last_number(text)
    if mode != "auto":
        raise ValueError(f"unknown answer extraction {mode!r}")
    for extract in (extract_boxed, extract_hashes, extract_last_number):
        answer = extract(text)
        if answer is not None and answer.strip():
            return answer
    return None


def stated_answer(text: str, mode: AnswerExtraction = "auto") -> str | None:
    """The non-blank answer ``text`` gives in the form ``mode`` asks for (``auto``: the last
    ``\\boxed{}``, else ``####``; never a bare number), or None."""
    if mode == "auto":
        answer = extract_boxed(text)
        if answer is None or not answer.strip():
            answer = extract_hashes(text)
    else:
        answer = extract_answer(text, mode)
    return answer if answer is not None and answer.strip() else None


def states_answer(text: str, mode: AnswerExtraction = "auto", timeout_s: int = 5) -> bool:
    """Whether ``text`` gives an answer in the form ``mode`` asks for that math-verify parses."""
    answer = stated_answer(text, mode)
    return answer is not None and parses(answer, timeout_s)


def parses(answer: str, timeout_s: int = 5) -> bool:
    """Whether math-verify parses ``answer`` into a value (``verify_answer``'s refusals: no)."""
    from math_verify import parse

    if _refused(answer):
        return False
    with _timeout(timeout_s) as timeout:
        return bool(parse(answer, parsing_timeout=timeout))


def verify_answer(gold: str, predicted: str, timeout_s: int = 5) -> bool:
    """Whether math-verify finds ``predicted`` equal to ``gold`` (see the module docstring)."""
    from math_verify import parse, verify

    if _refused(predicted):
        return False
    with _timeout(timeout_s) as timeout:
        gold_parsed = parse(gold, parsing_timeout=timeout)
        predicted_parsed = parse(predicted, parsing_timeout=timeout)
        if not gold_parsed or not predicted_parsed:
            return False
        return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))


def _refused(answer: str) -> bool:
    """Answers not given to math-verify: too long, or with a power or factorial."""
    return len(answer) > MAX_ANSWER_CHARS or bool(_EXPLODING.search(answer))


@contextlib.contextmanager
def _timeout(timeout_s: int) -> Iterator[int | None]:
    """math-verify's timeout on the main thread (keeping the host's timer), None elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    with _outer_alarm_kept():
        yield timeout_s


@contextlib.contextmanager
def _outer_alarm_kept() -> Iterator[None]:
    """Re-arm the real-time timer math-verify's ``signal.alarm`` calls cancel (math-verify
    restores the handler itself)."""
    delay, interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    try:
        yield
    finally:
        if delay > 0:
            left = max(delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, interval)
