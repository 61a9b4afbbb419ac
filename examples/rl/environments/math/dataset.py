"""Loading a local JSONL file of ``{"question": ..., "answer": ...}`` records.

One JSON object per line; blank lines are skipped; other keys are ignored. ``question`` must be a
non-empty string; ``answer`` a non-empty string or a number (converted with ``str``). Every
problem raises ``MathDatasetError`` naming the file and the 1-based line.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path


class MathDatasetError(ValueError):
    """A JSONL file that cannot be used; the message names the file and, if any, the line."""


@dataclass(frozen=True)
class MathRecord:
    """One question with its reference answer and where it came from."""

    question: str
    answer: str
    line: int


def load_jsonl(path: str | os.PathLike[str]) -> tuple[MathRecord, ...]:
    """The records of ``path`` (cached while the file's size and mtime are unchanged)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as err:
        raise MathDatasetError(f"{path}: cannot read: {err.strerror}") from None
    return _load(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> tuple[MathRecord, ...]:
    del mtime_ns, size  # cache key only
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise MathDatasetError(f"{path}: cannot read: {err}") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            records.append(_record(path, number, line))
    if not records:
        raise MathDatasetError(f"{path}: no records (expected one JSON object per line)")
    return tuple(records)


def _record(path: str, number: int, line: str) -> MathRecord:
    where = f"{path} line {number}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise MathDatasetError(f"{where}: invalid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(obj, dict):
        raise MathDatasetError(
            f"{where}: expected a JSON object with 'question' and 'answer', got "
            f"{type(obj).__name__}"
        )
    for field in ("question", "answer"):
        if field not in obj:
            raise MathDatasetError(f"{where}: missing field {field!r}")
    question, answer = obj["question"], obj["answer"]
    if not isinstance(question, str) or not question.strip():
        raise MathDatasetError(f"{where}: field 'question' must be a non-empty string")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise MathDatasetError(f"{where}: field 'answer' must be a non-empty string or a number")
    return MathRecord(question=question, answer=answer, line=number)
