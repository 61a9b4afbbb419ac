"""Math JSONL loading: records, and errors that name the file and the line."""

from __future__ import annotations

import re

import pytest

from examples.rl.environments.math.dataset import (
    MathDatasetError,
    MathRecord,
    load_jsonl,
)

GOOD = '{"question": "1+1=", "answer": "2"}'


def write(tmp_path, *lines: str):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_records_keep_line_numbers_and_skip_blank_lines(tmp_path):
    path = write(tmp_path, GOOD, "", '  {"question": "2*3=", "answer": 6, "id": "x"}  ')
    assert load_jsonl(path) == (
        MathRecord(question="1+1=", answer="2", line=1),
        MathRecord(question="2*3=", answer="6", line=3),
    )


def test_float_answer_becomes_a_string(tmp_path):
    assert load_jsonl(write(tmp_path, '{"question": "q", "answer": 0.5}'))[0].answer == "0.5"


def test_reload_sees_an_edited_file(tmp_path):
    path = write(tmp_path, GOOD)
    assert len(load_jsonl(path)) == 1
    path.write_text(GOOD + "\n" + GOOD + "\n" + GOOD + "\n")
    assert len(load_jsonl(path)) == 3


@pytest.mark.parametrize(
    "bad_line, message",
    [
        pytest.param('{"question": "1+1=", "answer": "2"', "invalid JSON", id="truncated-json"),
        pytest.param("not json", "invalid JSON", id="not-json"),
        pytest.param('["1+1=", "2"]', "expected a JSON object", id="array"),
        pytest.param('{"question": "1+1="}', "missing field 'answer'", id="missing-answer"),
        pytest.param('{"answer": "2"}', "missing field 'question'", id="missing-question"),
        pytest.param(
            '{"question": 5, "answer": "2"}', "field 'question' must be", id="number-question"
        ),
        pytest.param(
            '{"question": " ", "answer": "2"}', "field 'question' must be", id="blank-question"
        ),
        pytest.param(
            '{"question": "q", "answer": ""}', "field 'answer' must be", id="empty-answer"
        ),
        pytest.param(
            '{"question": "q", "answer": true}', "field 'answer' must be", id="bool-answer"
        ),
        pytest.param(
            '{"question": "q", "answer": null}', "field 'answer' must be", id="null-answer"
        ),
        pytest.param(
            '{"question": "q", "answer": [2]}', "field 'answer' must be", id="list-answer"
        ),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = write(tmp_path, GOOD, GOOD, bad_line, GOOD)
    with pytest.raises(MathDatasetError, match=re.escape(f"{path} line 3: {message}")):
        load_jsonl(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(MathDatasetError, match=re.escape(f"{path}: cannot read")):
        load_jsonl(path)


def test_file_without_records(tmp_path):
    path = write(tmp_path, "", "   ")
    with pytest.raises(MathDatasetError, match=re.escape(f"{path}: no records")):
        load_jsonl(path)


def test_dataset_error_is_a_value_error():
    assert issubclass(MathDatasetError, ValueError)  # pydantic validators report it per field
