"""No committed text file names a path of the machine that wrote it: a home or work folder, the
root user's home, a pytest or ``tempfile`` temporary folder. Results name such places relatively
(``tools/benchmarks/common.portable``); an example command's own folder, such as ``--out`` under
the temporary directory, is not a machine path."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Not after a name character, ``~`` or ``$``: ``docs/home/`` or ``$WORK/`` is no machine path.
MACHINE_PATH = re.compile(
    r"(?<![\w.~$-])/(?:"
    r"(?:work|root|home|Users)/"  # a work folder, a home folder
    r"|tmp/pytest-"  # pytest's temporary root
    r"|tmp/tmp[a-z0-9_]{8}(?![\w-])"  # tempfile.mkdtemp's
    r"|(?:private/)?var/folders/"  # macOS's temporary folders
    r")"
)


def committed_files() -> list[Path]:
    """The files git tracks in this checkout (the test is skipped outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def machine_paths(path: Path) -> list[str]:
    """``file:line: path`` for each machine path in a text file (none in a binary file)."""
    try:
        data = path.read_bytes()
    except OSError:  # deleted in the work tree, not yet in the index
        return []
    if b"\0" in data[:8192]:
        return []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [
        f"{where}:{text.count(chr(10), 0, m.start()) + 1}: {text[m.start():m.start() + 60]!r}"
        for m in MACHINE_PATH.finditer(text)
    ]


def test_no_committed_file_names_a_machine_path():
    found = [line for path in committed_files() for line in machine_paths(path)]
    assert not found, "machine paths (make them relative):\n" + "\n".join(found)


# {w}, {r}, {h}, {t}: the work folder, root's home, a home and the temporary folder (spelled so,
# this file names none of them itself).
@pytest.mark.parametrize(
    "text, found",
    [
        ('"{w}/main/pretrain_grpo.py"', True),
        ("cache at {r}/.cache/x", True),
        ("{h}/me/run.yaml", True),
        ("--basetemp {t}/pytest-of-me/x", True),
        ("key file {t}/tmpfelhafqo/job.key", True),
        ("`$WORK/teacher_hf`, ~{w}/x, docs{h}/x.md, https://host{r}/x", False),
        ("--out {t}/tiny-qwen2", False),  # an example command's folder
    ],
)
def test_the_checker_sees_machine_paths(tmp_path, text, found):
    path = tmp_path / "file.md"
    places = {"w": "/" + "work", "r": "/" + "root", "h": "/" + "home", "t": "/" + "tmp"}
    path.write_text("line one\n" + text.format(**places))
    assert bool(machine_paths(path)) is found
    assert all(line.split(":")[1] == "2" for line in machine_paths(path))
