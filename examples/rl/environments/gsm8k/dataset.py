"""GSM8K-format problems from local JSONL or Parquet files, read with the ``datasets`` library.

A GSM8K row is ``{"question": str, "answer": str}`` whose answer is the worked solution ending
in ``#### <final answer>`` (the format of the GSM8K data set; the column names can be changed).
``data_files`` follows ``datasets.load_dataset``: a file, a list of files, or a mapping
``{split: file(s)}``; glob patterns are expanded. Each file is read with
``datasets.load_dataset("json" | "parquet", data_files=file, split="train")`` with the Hub
switched off for the call (local files only, no network). Every problem raises
``GSM8KDatasetError`` naming the file and, for a bad row, the row (counted from 0, as in
``datasets``) and the field.
"""

from __future__ import annotations

import contextlib
import functools
import glob
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DataFiles = str | list[str] | dict[str, str | list[str]]
FileFormat = Literal["auto", "json", "parquet"]
SUFFIX_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
ANSWER_SEPARATOR = "####"


class GSM8KDatasetError(ValueError):
    """Data files that cannot be used; the message names the file and, if any, row and field."""


@dataclass(frozen=True)
class GSM8KRecord:
    """One problem: the question, the worked solution and the final answer after ``####``."""

    question: str
    solution: str
    answer: str
    source: str
    """``<file name>:<row>``: where the problem came from (its problem id)."""


def final_answer(solution: str) -> str | None:
    """The final answer of a GSM8K solution: the text after its last ``####``, thousands
    separators removed (``1,000`` -> ``1000``); None if there is no ``####`` or nothing after."""
    if ANSWER_SEPARATOR not in solution:
        return None
    answer = solution.rsplit(ANSWER_SEPARATOR, 1)[1].strip().replace(",", "")
    return answer or None


def resolve_data_files(data_files: DataFiles, split: str) -> list[Path]:
    """The files of ``split`` (globs expanded, sorted); each must exist."""
    if isinstance(data_files, dict):
        if split not in data_files:
            raise GSM8KDatasetError(
                f"split {split!r} is not in data_files (splits: {sorted(data_files)})"
            )
        chosen = data_files[split]
    elif split != "train":
        raise GSM8KDatasetError(
            f"split {split!r} needs data_files as a mapping {{split: files}}; a file or a list of "
            "files is the split 'train'"
        )
    else:
        chosen = data_files
    patterns = [chosen] if isinstance(chosen, str) else list(chosen)
    if not patterns:
        raise GSM8KDatasetError(f"data_files of split {split!r} is empty")
    files: list[Path] = []
    for pattern in patterns:
        if "://" in pattern:
            raise GSM8KDatasetError(f"{pattern}: only local files can be read (no URLs)")
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise GSM8KDatasetError(f"{pattern}: no file matches this pattern")
            files += [Path(m) for m in matches]
        elif not Path(pattern).is_file():
            raise GSM8KDatasetError(f"{pattern}: no such file")
        else:
            files.append(Path(pattern))
    return files


def file_format(path: Path, fmt: FileFormat) -> str:
    """The ``datasets`` builder of ``path``: ``fmt``, or by the suffix for ``auto``."""
    if fmt != "auto":
        return fmt
    try:
        return SUFFIX_FORMATS[path.suffix.lower()]
    except KeyError:
        raise GSM8KDatasetError(
            f"{path}: cannot tell the format from the suffix {path.suffix!r} (known: "
            f"{sorted(SUFFIX_FORMATS)}); set format: json or parquet"
        ) from None


def load_records(
    data_files: DataFiles,
    split: str = "train",
    fmt: FileFormat = "auto",
    question_field: str = "question",
    answer_field: str = "answer",
    cache_dir: str | None = None,
) -> tuple[GSM8KRecord, ...]:
    """Every problem of ``split``, file by file in order (cached while the files are unchanged)."""
    files = resolve_data_files(data_files, split)
    stamps = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)
    return _load(stamps, fmt, question_field, answer_field, cache_dir)


@functools.lru_cache(maxsize=8)
def _load(
    stamps: tuple[tuple[str, int, int], ...],
    fmt: FileFormat,
    question_field: str,
    answer_field: str,
    cache_dir: str | None,
) -> tuple[GSM8KRecord, ...]:
    records: list[GSM8KRecord] = []
    for name, _, _ in stamps:
        path = Path(name)
        table = _read(path, file_format(path, fmt), cache_dir)
        for field in (question_field, answer_field):
            if field not in table.column_names:
                raise GSM8KDatasetError(
                    f"{path}: no field {field!r} (fields: {table.column_names})"
                )
        questions, solutions = table[question_field], table[answer_field]
        for row, (question, solution) in enumerate(zip(questions, solutions)):
            records.append(_record(path, row, question, solution, question_field, answer_field))
    if not records:
        raise GSM8KDatasetError(f"{', '.join(n for n, _, _ in stamps)}: no rows")
    return tuple(records)


def _record(
    path: Path, row: int, question: object, solution: object, question_field: str, field: str
) -> GSM8KRecord:
    where = f"{path} row {row}"
    if not isinstance(question, str) or not question.strip():
        raise GSM8KDatasetError(f"{where}: field {question_field!r} must be a non-empty string")
    if not isinstance(solution, str):
        raise GSM8KDatasetError(
            f"{where}: field {field!r} must be a string ending in '#### <answer>'"
        )
    answer = final_answer(solution)
    if answer is None:
        raise GSM8KDatasetError(
            f"{where}: field {field!r} has no final answer: GSM8K answers end in '#### <answer>'"
        )
    return GSM8KRecord(
        question=question,
        solution=solution.rsplit(ANSWER_SEPARATOR, 1)[0].strip(),
        answer=answer,
        source=f"{path.name}:{row}",
    )


def _read(path: Path, builder: str, cache_dir: str | None):
    """``path`` as a ``datasets.Dataset`` (its one split, 'train')."""
    import datasets

    try:
        with _hub_off(datasets):
            return datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache_dir
            )
    except Exception as err:  # datasets/pyarrow raise many types for a file they cannot parse
        raise GSM8KDatasetError(
            f"{path}: cannot read it as {builder}: {type(err).__name__}: {err}"
        ) from None


@contextlib.contextmanager
def _hub_off(datasets) -> Iterator[None]:
    """``datasets``' offline mode for the call: local files need no Hub, and without it
    ``load_dataset`` sends a download-count request (seconds of waiting without a network)."""
    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before
