"""The command line of ``pretrain_grpo.py``: the parser derived from the sections, and the parse.

``build_parser`` declares every option of ``run.SECTIONS`` (and one weight per loss term) with its
help; ``--help`` lists the options users change most (``serve`` and ``evaluate``: the ones they
read), ``--help-all`` every one. ``parse_args`` reads the command line in one pass
(``command_line.py``: Megatron-LM's flags accepted, respelled or refused, unknown flags with the
closest of ours, argparse's own errors, a ``--config`` run file's keys) and exits with status 2
and every problem in one message, never the usage block; then ``resolve.resolve`` returns the
frozen ``RunConfig`` or every problem of the values, again in one message. Parsing imports neither torch nor megatron-core.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from typing import Any

from megatron.trainer.errors import UsageError
from megatron.trainer.flags.command_line import (
    CommandLineError,
    OneLineParser,
    last_value,
    prepare,
    report,
)
from megatron.trainer.flags.megatron_lm import add_refused_flags
from megatron.trainer.flags.option import Section, add_section, default_text
from megatron.trainer.flags.resolve import resolve
from megatron.trainer.flags.run import SECTIONS, RunConfig, term_options
from megatron.trainer.flags.run_file import CONFIG_FLAG, RUN_CONFIG_FILE, file_tokens

DESCRIPTION = "GRPO post-training of a Megatron-Core GPT with forced-lag streaming rollouts."


class HelpAll(argparse.Action):
    """``--help-all``: the help of every option, then exit."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            if hasattr(action, "full_help"):
                action.help = action.full_help
        parser.epilog = "docs/flags.md documents every option."
        parser.print_help()
        parser.exit()


def build_parser(every: bool = False, command: str | None = None) -> OneLineParser:
    """The parser of every option; ``every``: list them all in the help, otherwise only the
    common ones (``--help``; ``--help-all`` shows the rest), or for another ``command``
    (``option.COMMANDS``) the ones it reads (``Option.commands``)."""
    p = OneLineParser(
        prog="pretrain_grpo.py",
        description=DESCRIPTION,
        allow_abbrev=False,
        epilog=None if every else "--help-all lists every option; docs/flags.md documents them.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--help-all", action=HelpAll, help="List every option, then exit.")
    p.add_argument(
        CONFIG_FLAG,
        default=None,
        help="YAML run file of flag: value lines (names as on the command line, without --); "
        "flags given on the command line override it. Every run writes its resolved flags as "
        "such a file next to --metrics-file (<name>.config.yaml) and into each checkpoint "
        f"({RUN_CONFIG_FILE}).",
    )
    for _, section in SECTIONS if command is None else loading_first():
        add_section(p, section, every, command)
        if section.title == "GRPO":
            group = p.add_argument_group("GRPO loss terms (one per megatron/rl/grpo/terms module)")
            for flag, declared, default in term_options():
                text = (declared.help + default_text(declared, default)).replace("%", "%%")
                shown = every or command is None  # training's own: hidden by other commands
                action = group.add_argument(
                    flag,
                    type=float,
                    default=default,
                    metavar="X",
                    help=text if shown else argparse.SUPPRESS,
                )
                action.full_help = text  # what --help-all shows
    add_refused_flags(p)
    return p


def loading_first() -> list[tuple[str, type[Section]]]:
    """``SECTIONS`` in the order of another command's help: what loads the model first."""
    return sorted(SECTIONS, key=lambda item: item[0] not in ("model", "lora", "checkpointing"))


def parse_explicit(
    parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[argparse.Namespace, frozenset[str]]:
    """``parser.parse_args(argv)`` and the dests the command line set explicitly."""
    unset = object()
    dests = {a.dest for a in parser._actions if argparse.SUPPRESS not in (a.dest, a.default)}
    args = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, unset)))
    explicit = frozenset(d for d in dests if getattr(args, d) is not unset)
    for action in parser._actions:
        if action.dest in dests and getattr(args, action.dest) is unset:
            setattr(args, action.dest, action.default)
    return args, explicit


def parse_values(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> tuple[dict[str, Any], frozenset[str]]:
    """Every option's parsed value by dest (run file first, then the command line) and the dests
    given; ``UsageError`` with every problem of the command line in one message."""
    parser = parser or build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    path = last_value(CONFIG_FLAG, argv)
    from_file, problems = file_tokens(path, parser) if path is not None else ([], [])
    argv, more = prepare(from_file + argv, parser)
    problems += more
    parser.one_line_errors = True  # argparse's errors join the problems (no usage block)
    captured = io.StringIO()  # every rank parses; exits.run_main prints on global rank 0
    try:
        with contextlib.redirect_stderr(captured):
            args, explicit = parse_explicit(parser, argv)
    except CommandLineError as exc:
        problems.append(str(exc))
    except SystemExit as exc:
        if exc.code in (None, 0):  # --help
            raise
        problems.append(captured.getvalue().rstrip().splitlines()[-1])
    finally:
        parser.one_line_errors = False
    if problems:
        raise UsageError(report(parser.prog, problems))
    return vars(args), explicit


def parse_command(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> tuple[RunConfig, argparse.Namespace]:
    """The run config and a namespace of the options ``parser`` adds to the trainer's (another
    command on the same flags); ``UsageError`` (status 2, printed once by
    ``megatron.trainer.runtime.exits``) with every message on bad input."""
    parser = parser or build_parser()
    values, explicit = parse_values(argv, parser)
    import torch  # after the parse: --help and a bad flag answer without loading it

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    run, errors = resolve(values, world_size, torch.cuda.is_available(), explicit)
    if errors:
        raise UsageError(f"{parser.prog}: error: invalid arguments:\n  " + "\n  ".join(errors))
    trainer_dests = set(build_parser().parse_args([]).__dict__)
    own = argparse.Namespace(**{k: v for k, v in values.items() if k not in trainer_dests})
    return run, own


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The run config of ``pretrain_grpo.py``'s command line (see ``parse_command``)."""
    return parse_command(argv)[0]


def check(
    argv: list[str], world_size: int = 1, cuda: bool = False
) -> tuple[RunConfig | None, list[str]]:
    """The run config of ``argv`` on ``world_size`` ranks (None when invalid) and every problem
    of its values; a bad command line raises ``UsageError`` (for tests and tools that choose the
    world and the device)."""
    values, explicit = parse_values(argv)
    return resolve(values, world_size, cuda, explicit)
