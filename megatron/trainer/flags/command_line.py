"""The command line in one pass: every flag that cannot be used is reported in one message.

``prepare(argv, parser)`` reads the command line before argparse does and applies the two
Megatron-LM tables: refused RL flags (``megatron/trainer/flags/megatron_lm.py``) and general flags
(``megatron/trainer/flags/megatron_lm_common.py``: accepted ones are dropped, aliases respelled, refused ones and
refused values reported). A flag that is none of these and not ours is reported with the closest
of our flags. ``report`` makes the message: one line for one problem, otherwise a count and one
line each; never argparse's usage block (``OneLineParser`` raises instead of printing it).
"""

from __future__ import annotations

import argparse
import difflib

from megatron.trainer.flags.megatron_lm import MEGATRON_LM_RL_FLAGS
from megatron.trainer.flags.megatron_lm_common import BY_FLAG as COMMON, CommonFlag

REFUSED_RL = {e.flag: e for e in MEGATRON_LM_RL_FLAGS if e.status == "refused"}


class CommandLineError(Exception):
    """argparse's own error (a bad value, a missing value), one line."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise ``CommandLineError`` while ``one_line_errors`` is
    set (``arguments.parse_args``), so that they join the other problems of the command line
    instead of printing the usage block; otherwise argparse's own behaviour."""

    one_line_errors = False

    def error(self, message: str):  # type: ignore[override]
        if self.one_line_errors:
            raise CommandLineError(message)
        super().error(message)


def prepare(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """``argv`` as argparse should parse it, and the problems found (one line each)."""
    known = {s for a in parser._actions for s in a.option_strings}
    out: list[str] = []
    problems: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        if (
            not token.startswith("--")
            or token == "--"
            or (flag in known and flag not in REFUSED_RL)
        ):
            out.append(token)  # ours (its value follows as the next token) or a value
            i += 1
            continue
        value = inline if eq else None
        takes_value = _takes_value(flag)
        if value is None and takes_value is not False and i + 1 < len(argv):
            if not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
        i += 1
        if flag in REFUSED_RL:
            entry = REFUSED_RL[flag]
            instead = f"; use {entry.ours}" if entry.ours else ""
            problems.append(f"{flag} (Megatron-LM): not supported: {entry.reason}{instead}")
        elif flag in COMMON:
            problem = _common_problem(COMMON[flag], value, argv, parser)
            if problem is not None:
                problems.append(problem)
            elif COMMON[flag].status == "alias":
                out += [*COMMON[flag].rewrite, *([value] if value is not None else [])]
        else:
            problems.append(f"{flag}: not a flag of {parser.prog}{_suggestion(flag, parser)}")
    return out, problems


def report(prog: str, problems: list[str]) -> str:
    """The one message of a command line's problems."""
    if len(problems) == 1:
        return f"{prog}: error: {problems[0]} (--help-all lists every flag)"
    lines = "\n  ".join(problems)
    return (
        f"{prog}: error: {len(problems)} problems with the command line (--help-all lists every "
        f"flag):\n  {lines}"
    )


def _takes_value(flag: str) -> bool | None:
    """Whether a Megatron-LM flag takes a value (None: unknown flag, guessed from the tokens)."""
    if flag in REFUSED_RL:
        return REFUSED_RL[flag].takes_value
    if flag in COMMON:
        return COMMON[flag].takes_value
    return None


def _common_problem(
    entry: CommonFlag, value: str | None, argv: list[str], parser: argparse.ArgumentParser
) -> str | None:
    """Why ``entry`` with ``value`` cannot be used, or None (accepted, or an alias)."""
    name = f"{entry.flag} {value}" if value is not None else entry.flag
    if entry.takes_value and value is None:
        return f"{entry.flag} (Megatron-LM): expects a value"
    if entry.status == "refused":
        instead = f"; use {entry.rewrite[0]}" if entry.rewrite else ""
        return f"{entry.flag} (Megatron-LM): not supported: {entry.reason}{instead}"
    if entry.values is not None and value not in entry.values:
        allowed = " or ".join(entry.values)
        return f"{name} (Megatron-LM): only {allowed} is supported: {entry.reason}"
    if entry.same_as is not None:
        other = _value_of(entry.same_as, argv, parser)
        if not _equal(value, other):
            return f"{name} (Megatron-LM): must equal {entry.same_as} ({other}): {entry.reason}"
    return None


def last_value(flag: str, argv: list[str]) -> str | None:
    """The last value given to ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), or None."""
    found = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif token.startswith(flag + "="):
            found = token.split("=", 1)[1]
    return found


def _value_of(flag: str, argv: list[str], parser: argparse.ArgumentParser) -> str:
    """The last value given to our ``flag`` in ``argv``, else its default."""
    found = last_value(flag, argv)
    if found is not None:
        return found
    action = next(a for a in parser._actions if flag in a.option_strings)
    return str(action.default)


def _equal(a: str | None, b: str) -> bool:
    try:
        return a is not None and float(a) == float(b)
    except ValueError:
        return a == b


def _suggestion(flag: str, parser: argparse.ArgumentParser) -> str:
    """'; did you mean --x?' for the closest listed flag of ours, if any is close."""
    listed = [
        s
        for a in parser._actions
        if a.help != argparse.SUPPRESS or hasattr(a, "full_help")
        for s in a.option_strings
        if s.startswith("--")
    ]
    close = difflib.get_close_matches(flag, listed, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""
