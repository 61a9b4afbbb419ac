"""Reading GSM8K-format files (JSONL and Parquet) with ``datasets``; errors name the file, the
row and the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from examples.rl.environments.gsm8k.dataset import (
    GSM8KDatasetError,
    final_answer,
    load_records,
)

ROOT = Path(__file__).resolve().parents[6]
SAMPLE = ROOT / "examples/rl/environments/gsm8k/gsm8k_sample.jsonl"
EXPECTED_ANSWERS = ["14", "48", "7", "63", "18", "24", "7", "210", "58", "91"]
EXPECTED_ANSWERS += ["8", "900", "18", "231", "2.5", "16", "16", "-7", "18", "450"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def test_shipped_jsonl_sample(datasets_cache):
    records = load_records(str(SAMPLE), cache_dir=datasets_cache)
    assert [r.answer for r in records] == EXPECTED_ANSWERS
    first = records[0]
    assert first.question.startswith("Mia has 12 apples.")
    assert first.solution.endswith("<<19-5=14>>14 apples.") and "####" not in first.solution
    assert [r.source for r in records[:2]] == ["gsm8k_sample.jsonl:0", "gsm8k_sample.jsonl:1"]


def test_parquet_reads_the_same_problems(tmp_path, sample_rows, datasets_cache):
    path = write_parquet(tmp_path / "train.parquet", sample_rows)
    from_parquet = load_records(path, cache_dir=datasets_cache)
    from_jsonl = load_records(str(SAMPLE), cache_dir=datasets_cache)
    assert [(r.question, r.solution, r.answer) for r in from_parquet] == [
        (r.question, r.solution, r.answer) for r in from_jsonl
    ]
    assert from_parquet[3].source == "train.parquet:3"


def test_splits_lists_globs_and_renamed_fields(tmp_path, sample_rows, datasets_cache):
    rows = [{"problem": r["question"], "solution": r["answer"]} for r in sample_rows]
    a = write_jsonl(tmp_path / "part-0.jsonl", rows[:5])
    b = write_parquet(tmp_path / "part-1.parquet", rows[5:8])
    test = write_jsonl(tmp_path / "held_out.data", rows[8:])
    files = {"train": [a, b], "test": test}
    options = dict(question_field="problem", answer_field="solution", cache_dir=datasets_cache)
    train = load_records(files, "train", **options)
    assert [r.answer for r in train] == EXPECTED_ANSWERS[:8]
    held_out = load_records(files, "test", fmt="json", **options)
    assert [r.answer for r in held_out] == EXPECTED_ANSWERS[8:]
    globbed = load_records(str(tmp_path / "part-*"), **options)
    assert [r.answer for r in globbed] == EXPECTED_ANSWERS[:8]


@pytest.mark.parametrize(
    "text, answer",
    [
        pytest.param("so 3 + 4 = 7\n#### 7", "7", id="plain"),
        pytest.param("#### 1,080", "1080", id="thousands"),
        pytest.param("#### -2.5 ", "-2.5", id="negative-decimal"),
        pytest.param("a #### b\n#### 12", "12", id="last-separator"),
        pytest.param("no final answer", None, id="missing"),
        pytest.param("#### ", None, id="empty"),
    ],
)
def test_final_answer_after_the_last_separator(text, answer):
    assert final_answer(text) == answer


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(GSM8KDatasetError, match=f"{missing}: no such file"):
        load_records(str(missing))


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_row_without_final_answer_names_file_row_and_field(
    tmp_path, sample_rows, fmt, datasets_cache
):
    rows = sample_rows[:3] + [{"question": "How many?", "answer": "I do not know"}]
    write = write_jsonl if fmt == "json" else write_parquet
    path = write(tmp_path / f"bad.{'jsonl' if fmt == 'json' else 'parquet'}", rows)
    with pytest.raises(GSM8KDatasetError) as info:
        load_records(path, cache_dir=datasets_cache)
    assert str(info.value) == (
        f"{path} row 3: field 'answer' has no final answer: GSM8K answers end in '#### <answer>'"
    )


@pytest.mark.parametrize(
    "rows, needle",
    [
        pytest.param([{"question": "Q?"}], ": no field 'answer'", id="missing-column"),
        pytest.param(
            [{"question": "", "answer": "#### 1"}],
            " row 0: field 'question' must be a non-empty string",
            id="empty-question",
        ),
        pytest.param(
            [{"question": "Q?", "answer": 5}],
            " row 0: field 'answer' must be a string ending in '#### <answer>'",
            id="numeric-answer",
        ),
    ],
)
def test_bad_rows_and_columns_are_named(tmp_path, rows, needle, datasets_cache):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(GSM8KDatasetError, match=re.escape(f"{path}{needle}")):
        load_records(path, cache_dir=datasets_cache)


@pytest.mark.parametrize(
    "data_files, split, needle",
    [
        pytest.param({"train": "a.jsonl"}, "test", "split 'test' is not in data_files", id="split"),
        pytest.param("a.jsonl", "test", "needs data_files as a mapping", id="split-of-a-file"),
        pytest.param("https://x/a.jsonl", "train", "only local files", id="url"),
        pytest.param("none-*.jsonl", "train", "no file matches", id="glob"),
        pytest.param([], "train", "is empty", id="no-files"),
    ],
)
def test_data_files_problems_are_named(data_files, split, needle):
    with pytest.raises(GSM8KDatasetError, match=needle):
        load_records(data_files, split)


def test_unknown_suffix_and_unparsable_file(tmp_path, datasets_cache):
    odd = tmp_path / "rows.txt"
    odd.write_text('{"question": "Q?", "answer": "#### 1"}\n')
    with pytest.raises(GSM8KDatasetError, match=f"{odd}: cannot tell the format from the suffix"):
        load_records(str(odd))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(GSM8KDatasetError, match=f"{broken}: cannot read it as parquet"):
        load_records(str(broken), cache_dir=datasets_cache)


def test_reading_leaves_datasets_online_setting_alone(datasets_cache):
    import datasets

    before = datasets.config.HF_HUB_OFFLINE
    load_records(str(SAMPLE), cache_dir=datasets_cache)
    assert datasets.config.HF_HUB_OFFLINE == before
