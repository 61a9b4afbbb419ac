"""tools/benchmarks/common: a result's machine paths made portable before it is committed."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tools.benchmarks.common import REPO, portable, replace_paths


def test_paths_are_replaced_as_whole_names_longest_first():
    places = {"/a/b/": "", "/a/b": ".", "/a": "~", "/a/b/c/d": "$WORK"}
    value = {"x": ["/a/b/run.py", "/a/b", "/a/bc", "/a/b/c/d/e", 3], "y": ("at /a/.cache",)}
    assert replace_paths(value, places) == {
        "x": ["run.py", ".", "~/bc", "$WORK/e", 3],
        "y": ["at ~/.cache"],
    }


def test_a_result_names_no_place_of_this_machine(tmp_path):
    work = tmp_path / "work"
    result = {
        "command": [sys.executable, str(REPO / "pretrain_grpo.py"), str(work / "run" / "m.jsonl")],
        "cache": str(Path.home() / ".cache" / "x"),
        "key": f"--key-file {Path(tempfile.gettempdir()) / 'tmpabcdefgh' / 'job.key'}",
        "steps": 3,
    }
    assert portable(result, work=work) == {
        "command": ["python", "pretrain_grpo.py", "$WORK/run/m.jsonl"],
        "cache": "~/.cache/x",
        "key": "--key-file $TMPDIR/tmpabcdefgh/job.key",
        "steps": 3,
    }
