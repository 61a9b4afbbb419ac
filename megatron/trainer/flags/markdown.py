"""``docs/flags.md``: every option of the config tree, generated from the declarations.

    python -m megatron.trainer.flags.markdown > docs/flags.md

A test fails when the file differs from ``render()``; the user guide's table of defaults that differ
from Megatron-LM's is ``defaults_table()``.
"""

from __future__ import annotations

from typing import Any

from megatron.trainer.flags.grpo import GRPO, term_options
from megatron.trainer.flags.option import NO_VALUE, Option, options
from megatron.trainer.flags.run import SECTIONS

HEADER = """# Flags of `pretrain_grpo.py`

Generated from the config tree (`megatron/trainer/flags`) by
`python -m megatron.trainer.flags.markdown > docs/flags.md`; a test fails when it is stale.
`python pretrain_grpo.py --help` lists the common options (marked * here), `--help-all` every one.
`python -m megatron.trainer.serve --help` and `python -m megatron.trainer.evaluate --help` list
the options those commands read (marked serve, evaluate; their own flags are in the
[user guide](user_guide.md#serving-a-checkpoint)); both accept every option, `--help-all` lists
them. A run file (`--config run.yaml`) takes the same names without the dashes. *Resume*: a
resumed run must keep the value. Megatron-LM's flags that are not ours (accepted, respelled or
refused) are in the [user guide](user_guide.md#coming-from-megatron-lm).
"""


def render() -> str:
    """The text of ``docs/flags.md``."""
    parts = [HEADER]
    for name, section in SECTIONS:
        parts.append(f"## {section.title} (`RunConfig.{name}`)\n")
        rows = [_row(flag, f.name, declared, f.default) for f, declared, flag in options(section)]
        if section is GRPO:
            rows += [
                _row(flag, f"weight('{flag}')", declared, default)
                for flag, declared, default in term_options()
            ]
        parts.append(_table(rows))
    return "\n".join(parts)


def defaults_table() -> str:
    """The markdown table of our defaults that differ from Megatron-LM's."""
    rows = ["| flag | ours | Megatron-LM |", "| --- | --- | --- |"]
    for _, section in SECTIONS:
        for f, declared, flag in options(section):
            if declared.megatron_lm_default is not NO_VALUE:
                ours = _derived(declared.help) if f.default is None else _text(f.default)
                rows.append(f"| `{flag}` | {ours} | {_text(declared.megatron_lm_default)} |")
    return "\n".join(rows)


def _row(flag: str, field: str, declared: Option, default: Any) -> list[str]:
    names = ", ".join(f"`{a}`" for a in declared.aliases)
    others = "; ".join(declared.spellings)
    theirs = "" if declared.megatron_lm_default is NO_VALUE else _text(declared.megatron_lm_default)
    marks = " ".join(
        ["*"] * declared.common + ["resume"] * declared.resume + list(declared.commands)
    )
    return [
        f"`{flag}`" + (f" ({names})" if names else ""),
        f"`{field}`",
        "" if default is None else f"`{_text(default)}`",
        theirs,
        marks,
        " ".join(declared.help.split()).replace("|", "\\|"),
        others,
    ]


def _table(rows: list[list[str]]) -> str:
    head = ["flag", "field", "default", "Megatron-LM default", "", "help", "in TRL / NeMo-RL"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)


def _derived(help_text: str) -> str:
    """The default a help text names (``(default: --lr / 10)``), flags in code spans."""
    named = help_text.split("(default: ", 1)[-1].split(")", 1)[0]
    return " ".join(f"`{w}`" if w.startswith("--") else w for w in named.split())


if __name__ == "__main__":
    print(render(), end="")
