r"""Answer extraction from a completion, and scoring with ``math-verify``.

Extraction (``extract_answer(text, mode)``):

* ``boxed``: the content of the last ``\boxed{...}`` (braces may nest);
* ``hashes``: the text after the last ``####`` up to the end of its line (GSM8K's own format);
* ``last_number``: the last number in the text (``-7``, ``2.5``, ``1,200``);
* ``auto``: ``boxed``, else ``hashes``, else ``last_number``.

``states_answer(text, mode)``: whether the completion gives its answer in the asked form (for
``auto``: an explicit ``\boxed{}`` or ``####``, not just some number); the format reward.

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
    answer = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
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


def states_answer(text: str, mode: AnswerExtraction = "auto") -> bool:
    """Whether ``text`` gives its answer in the form ``mode`` asks for (``auto``: an explicit
    ``\\boxed{}`` or ``####``)."""
    if mode == "auto":
        return extract_boxed(text) is not None or extract_hashes(text) is not None
    return extract_answer(text, mode) is not None


def verify_answer(gold: str, predicted: str, timeout_s: int = 5) -> bool:
    """Whether math-verify finds ``predicted`` equal to ``gold`` (see the module docstring)."""
    from math_verify import parse, verify

    if len(predicted) > MAX_ANSWER_CHARS or _EXPLODING.search(predicted):
        return False
    on_main = threading.current_thread() is threading.main_thread()
    timeout = timeout_s if on_main else None
    with _outer_alarm_kept() if on_main else contextlib.nullcontext():
        gold_parsed = parse(gold, parsing_timeout=timeout)
        predicted_parsed = parse(predicted, parsing_timeout=timeout)
        if not gold_parsed or not predicted_parsed:
            return False
        return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))


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
