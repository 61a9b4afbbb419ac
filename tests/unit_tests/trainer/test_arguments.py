"""``pretrain_grpo.py``'s command line end to end (``arguments.parse_args``): bad flags exit
with status 2 and one message naming the flag, without a traceback. The cross-field checks
themselves are tested in ``test_flag_validation.py``."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize(
    "argv, flag",
    [
        pytest.param(["--rl-forced-lag", "-1"], "--rl-forced-lag", id="lag"),
        pytest.param(
            ["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size", id="pp"
        ),
        pytest.param(["--grpo-group-size", "1"], "--grpo-group-size", id="group-size"),
    ],
)
def test_entry_script_exits_non_zero_naming_the_flag(argv, flag):
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert flag in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_output_path_exits_within_seconds_with_one_message(tmp_path):
    (tmp_path / "F").write_text("")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", "--metrics-file", str(tmp_path / "F" / "m.jsonl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and time.monotonic() - start < 30
    assert proc.stderr.splitlines()[-1].strip().startswith("--metrics-file")
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr
