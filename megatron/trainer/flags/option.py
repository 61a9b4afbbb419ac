"""How an option is declared: one dataclass field per option, in the section that owns it.

A section is a frozen dataclass (``Section``) whose fields are ``option(default, help, ...)``: the
field's name, type (``parse``), default, constraint (``minimum``, ``choices``), one-line help, the
Megatron-LM spellings (``aliases``) and default where ours differs, the TRL / NeMo-RL spellings,
whether a resumed run must keep the value (``resume``) and which of the other commands on these
flags read it (``commands``). Everything else is derived from that one declaration: the argparse
flags (``add_section``), each command's ``--help`` and ``--help-all``, the YAML run files,
``docs/flags.md`` and the resume check.

This module imports neither torch nor megatron-core: ``--help`` parses in a fraction of a second.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

NO_VALUE = object()
"""``megatron_lm_default`` of an option whose Megatron-LM default is ours (or that it lacks)."""

SERVE, EVALUATE = "serve", "evaluate"
COMMANDS = (SERVE, EVALUATE)
"""The commands besides ``pretrain_grpo.py`` on these flags (``python -m megatron.trainer.<name>``):
each accepts every option, its ``--help`` lists those whose ``Option.commands`` name it."""


@dataclass(frozen=True)
class Option:
    """The declaration of one option (the metadata of its field)."""

    help: str
    """One line (or a few) of help; ``--help`` appends the default."""
    flag: str | None = None
    """The command-line flag; None: ``--`` + the section's prefix + the field name, dashed."""
    aliases: tuple[str, ...] = ()
    """Other spellings the parser accepts for the same option (Megatron-LM's, or another
    trainer's where it does not clash: ``--opsm-delta``)."""
    parse: Callable[[str], Any] | None = None
    """Text -> value; None: the type of the default (which must then not be None)."""
    choices: tuple[Any, ...] | None = None
    nargs: str | None = None
    switch: bool = False
    """A flag without a value that turns the option on (default False)."""
    negatable: bool = False
    """A boolean with both ``--flag`` and ``--no-flag``."""
    minimum: float | None = None
    """The smallest value allowed (None values always pass): checked in ``bounds_problems``."""
    resume: bool = False
    """A resumed run must keep the checkpoint's value (the check names the flag)."""
    common: bool = False
    """Listed by ``pretrain_grpo.py --help``; every option is listed by ``--help-all``."""
    commands: tuple[str, ...] = ()
    """The other commands (of ``COMMANDS``) whose ``--help`` lists the option: only ones that
    read it. Left out besides: the architecture flags (``--hf-checkpoint``'s config.json or a run
    file gives them) and what only the default fits there (one process: the parallel sizes)."""
    megatron_lm_default: Any = NO_VALUE
    """Megatron-LM's default where it differs from ours (shown by ``--help`` and docs/flags.md)."""
    spellings: tuple[str, ...] = ()
    """The option's names in other trainers, e.g. ``"NeMo-RL: grpo.num_prompts_per_step"``."""


def option(default: Any, help: str, **declaration: Any) -> Any:
    """A section field declaring one option (see ``Option`` for ``declaration``)."""
    unknown = set(declaration.get("commands", ())) - set(COMMANDS)
    if unknown:
        raise ValueError(f"commands {sorted(unknown)}: not one of {COMMANDS}")
    if isinstance(default, list):
        default = tuple(default)
    return dataclasses.field(default=default, metadata={"option": Option(help, **declaration)})


@dataclass(frozen=True)
class Section:
    """One component's options (a frozen dataclass of ``option`` fields)."""

    title: ClassVar[str]
    """The group's title in ``--help``."""
    prefix: ClassVar[str] = ""
    """Dashed prefix of the flags whose ``Option.flag`` is not given (``"rl-"``)."""

    def problems(self) -> list[str]:
        """Cross-field problems within this section, each naming its flags (subclasses add)."""
        return []


def options(section: type[Section] | Section) -> Iterator[tuple[dataclasses.Field, Option, str]]:
    """(field, declaration, flag) of every option of ``section``, in declaration order."""
    for f in dataclasses.fields(section):
        declared = f.metadata.get("option")
        if declared is not None:
            flag = declared.flag or "--" + (section.prefix + f.name).replace("_", "-")
            yield f, declared, flag


def dest_of(flag: str) -> str:
    """The attribute of ``--some-flag`` on argparse's namespace: ``some_flag``."""
    return flag.lstrip("-").replace("-", "_")


def bounds_problems(section: Section) -> list[str]:
    """``--flag must be >= m, got v`` for each option below its ``minimum``."""
    found = []
    for f, declared, flag in options(section):
        value = getattr(section, f.name)
        if declared.minimum is not None and value is not None and value < declared.minimum:
            found.append(f"{flag} must be >= {declared.minimum}, got {value}")
    return found


def default_text(declared: Option, default: Any) -> str:
    """The default as ``--help`` shows it, with Megatron-LM's where it differs."""
    shown = "" if default is None or default is False else f" (default: {_text(default)}"
    if declared.megatron_lm_default is not NO_VALUE:
        theirs = f"Megatron-LM's default: {_text(declared.megatron_lm_default)}"
        shown = f"{shown}; {theirs})" if shown else f" ({theirs})"
    elif shown:
        shown += ")"
    return shown


def listed(declared: Option, command: str | None) -> bool:
    """Whether ``command``'s ``--help`` lists the option (None: ``pretrain_grpo.py``'s)."""
    return declared.common if command is None else command in declared.commands


def add_section(
    parser: argparse.ArgumentParser,
    section: type[Section],
    every: bool,
    command: str | None = None,
) -> None:
    """Declare ``section``'s flags on ``parser`` (hidden from the help unless ``every`` or
    ``listed`` for ``command``, None: ``pretrain_grpo.py``)."""
    group = parser.add_argument_group(section.title)
    for f, declared, flag in options(section):
        shown = every or listed(declared, command)
        text = (declared.help + default_text(declared, f.default)).replace("%", "%%")
        kwargs: dict[str, Any] = dict(
            dest=dest_of(flag), default=f.default, help=text if shown else argparse.SUPPRESS
        )
        if declared.switch:
            kwargs["action"] = "store_true"
        elif declared.negatable:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = declared.parse or type(f.default)
            kwargs["choices"] = declared.choices
            kwargs["nargs"] = declared.nargs
            kwargs["metavar"] = _metavar(declared, f.default)
        action = group.add_argument(flag, *declared.aliases, **kwargs)
        action.full_help = text  # what --help-all shows


def _metavar(declared: Option, default: Any) -> str:
    """``{a,b}`` for choices, else N (integers), X (reals) or VALUE."""
    if declared.choices is not None:
        return "{" + ",".join(map(str, declared.choices)) + "}"
    parse = declared.parse or type(default)
    return {int: "N", float: "X"}.get(parse, "VALUE")


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)
