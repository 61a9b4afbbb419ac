"""How ``megatron.trainer.launch`` ends a job from its workers' failures."""

from __future__ import annotations

import json
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megatron.trainer.launch import report
from megatron.trainer.runtime.exits import write_error_file


def failure(tmp_path, monkeypatch, rank: int, exitcode: int, message=None, expected="own"):
    path = tmp_path / f"error-{rank}.json"
    if message is not None:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        write_error_file(message, expected)
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_an_expected_error_ends_with_the_workers_status_and_no_report(
    tmp_path, monkeypatch, capsys
):
    failures = {
        0: failure(tmp_path, monkeypatch, 0, 1, "--load CK: cannot read iteration 2"),
        1: failure(tmp_path, monkeypatch, 1, -signal.SIGTERM),  # killed by torchelastic after
    }
    assert report(failures, "pretrain_grpo.py") == 1
    assert capsys.readouterr().err == ""
    data = json.loads((tmp_path / "error-0.json").read_text())
    assert data["message"]["message"] == "--load CK: cannot read iteration 2"


@pytest.mark.parametrize("exitcode", [143, -15, 130])
def test_workers_stopped_by_a_signal_end_with_128_plus_signum(tmp_path, monkeypatch, exitcode):
    failures = {0: failure(tmp_path, monkeypatch, 0, exitcode)}
    expected = 128 - exitcode if exitcode < 0 else exitcode
    assert report(failures, "pretrain_grpo.py") == expected


def test_a_bug_gets_one_line_naming_its_rank(tmp_path, monkeypatch, capsys):
    failures = {
        0: failure(tmp_path, monkeypatch, 0, -signal.SIGTERM),
        1: failure(tmp_path, monkeypatch, 1, 1, "ZeroDivisionError: division by zero", None),
        2: failure(tmp_path, monkeypatch, 2, 1, "rank 0 aborted generation", "peer"),
    }
    assert report(failures, "/x/pretrain_grpo.py") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "pretrain_grpo.py: rank 1 failed with exit status 1 (ZeroDivisionError: division by "
        "zero); its output is above"
    ]


def test_an_expected_error_of_another_rank_only_is_printed_by_the_launcher(
    tmp_path, monkeypatch, capsys
):
    failures = {
        0: failure(tmp_path, monkeypatch, 0, 1, "rank 1 failed", "peer"),
        1: failure(tmp_path, monkeypatch, 1, 1, "--load CK: cannot read mp_rank_01"),
    }
    assert report(failures, "pretrain_grpo.py") == 1
    assert capsys.readouterr().err == "pretrain_grpo.py: error: --load CK: cannot read mp_rank_01\n"


def test_the_status_is_that_of_a_rank_that_exited_with_its_error(tmp_path, monkeypatch):
    """Every rank failed validation (status 2); rank 1 recorded it, then torchelastic stopped it
    before it exited."""
    failures = {
        1: failure(tmp_path, monkeypatch, 1, -signal.SIGTERM, "invalid arguments"),
        0: failure(tmp_path, monkeypatch, 0, 2, "invalid arguments"),
    }
    assert report(failures, "pretrain_grpo.py") == 2
