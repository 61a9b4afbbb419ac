"""Output paths (``flags/output.py``): ``flags.resolve.resolve`` probes every path a run will write and
refuses an unusable one at start-up, leaving nothing behind."""

from __future__ import annotations

import pytest

from megatron.trainer.flags.parse import check


def errors_for(argv: list[str], world_size: int = 1, cuda: bool = False) -> list[str]:
    return check(argv, world_size, cuda)[1]


@pytest.mark.parametrize(
    "flag, path, problem",
    [
        pytest.param(
            "--metrics-file", "F/m.jsonl", "F is not a directory", id="metrics-under-file"
        ),
        pytest.param("--metrics-file", "D", "is a directory, not a file", id="metrics-is-dir"),
        pytest.param("--metrics-file", "/proc/m/m.jsonl", "cannot write there", id="metrics-proc"),
        pytest.param("--save", "F/ck", "F is not a directory", id="save-under-file"),
        pytest.param("--save", "F", "exists and is not a directory", id="save-is-file"),
        pytest.param("--save", "/proc/self/ck", "cannot write there", id="save-proc"),
    ],
)
def test_unusable_output_paths_are_refused_at_start_up(tmp_path, monkeypatch, flag, path, problem):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "F").write_text("a regular file")
    (tmp_path / "D").mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    errors = errors_for([flag, path])
    assert len(errors) == 1 and errors[0].startswith(f"{flag} {path}: {problem}")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # the probe leaves nothing


def test_a_val_dump_dir_that_is_a_file_is_refused_at_start_up(tmp_path):
    (tmp_path / "F").write_text("a regular file")
    errors = errors_for(["--val-at-end", "--val-dump-dir", str(tmp_path / "F")])
    assert errors == [f"--val-dump-dir {tmp_path / 'F'}: exists and is not a directory"]


def test_writable_output_paths_pass_and_leave_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.jsonl").write_text('{"step": 0}\n')
    argv = ["--save", "a/b/ck", "--metrics-file", "old.jsonl"]
    assert errors_for(argv) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl"]
    assert (tmp_path / "old.jsonl").read_text() == '{"step": 0}\n'
