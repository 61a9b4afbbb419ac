"""``docs/flags.md`` and the user guide's table of defaults that differ from Megatron-LM's are
generated from the config tree (``flags/markdown.py``): a stale copy fails here."""

from __future__ import annotations

from pathlib import Path

from megatron.trainer.flags.markdown import defaults_table, render
from megatron.trainer.flags.option import options
from megatron.trainer.flags.run import SECTIONS

ROOT = Path(__file__).resolve().parents[4]


def test_docs_flags_md_is_the_generated_reference():
    stale = (ROOT / "docs" / "flags.md").read_text() != render()
    assert not stale, "regenerate: python -m megatron.trainer.flags.markdown > docs/flags.md"


def test_the_reference_lists_every_option_once():
    text = render()
    for _, section in SECTIONS:
        for _, _, flag in options(section):
            assert text.count(f"| `{flag}`") == 1, flag


def test_the_user_guide_table_of_differing_defaults_is_generated():
    table = defaults_table()
    assert "| `--min-lr` | `--lr` / 10 | 0.0 |" in table
    assert "| `--lr-warmup-iters` | 10 | 0 |" in table
    assert table in (ROOT / "docs" / "user_guide.md").read_text()
