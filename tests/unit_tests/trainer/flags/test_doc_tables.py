"""The flags that the README's and the user guide's tables name in a row's first cell are flags of
``pretrain_grpo.py`` (ours, or Megatron-LM's of the user guide's tables), with the values and
defaults the row gives: ```--rl-data-plane in-process` (default)`` has that default,
```--rl-reward-wait-steps K` (default 0)`` the default 0, ```--scale-rewards group` / `batch```
those choices. The Megatron-LM tables' other columns: ``test_megatron_lm.py``."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from megatron.trainer.flags.megatron_lm import MEGATRON_LM_RL_FLAGS
from megatron.trainer.flags.megatron_lm_common import MEGATRON_LM_COMMON_FLAGS
from megatron.trainer.flags.parse import build_parser

ROOT = Path(__file__).resolve().parents[4]
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "user_guide.md"]
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
CODE = re.compile(r"`([^`]+)`")


def first_cells(path: Path) -> list[tuple[int, str]]:
    """(line number, first cell) of every table row outside fenced code blocks."""
    cells, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and line.startswith("| ") and not line.startswith("| ---"):
            cells.append((number, line[2:].split(" | ")[0]))
    return cells


ROWS = [
    pytest.param(cell, id=f"{path.name}:{number}")
    for path in DOCUMENTS
    for number, cell in first_cells(path)
    if FLAG.search(" ".join(CODE.findall(cell)))
]


@pytest.fixture(scope="module")
def options() -> dict[str, argparse.Action]:
    return {s: a for a in build_parser(every=True)._actions for s in a.option_strings}


def test_the_documents_have_flag_tables():
    assert len(ROWS) > 100


@pytest.mark.parametrize("cell", ROWS)
def test_a_table_row_s_flags_and_values_are_the_parser_s(cell, options):
    megatron_lm = {e.flag for e in MEGATRON_LM_RL_FLAGS + MEGATRON_LM_COMMON_FLAGS}
    for code in CODE.findall(cell):
        for flag in FLAG.findall(code):
            assert flag in options or flag in megatron_lm, f"{flag}: not a flag ({cell})"
    spans = CODE.findall(cell)
    flag, _, value = spans[0].partition(" ")
    action = options.get(flag)
    if action is None or action.nargs == 0:
        return
    if value.islower() and action.choices:  # a literal value, not a metavar (K, DIR)
        alternatives = re.findall(r" / `([a-z][\w-]*)`", cell)  # `--flag a` / `b` / `c`
        assert {value, *alternatives} <= set(action.choices), (cell, action.choices)
    default = re.search(r"\(default( [^),;]+)?\)", cell)
    if default:
        said = (default.group(1) or f" {value}").strip()
        assert str(action.default) == said, (cell, action.default)
