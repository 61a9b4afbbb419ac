"""Command-line flags of ``pretrain_grpo.py`` (Megatron-style names): the parser and the parse.

Each flag is declared once, with its help text, in the module of its group: ``model_flags``,
``training_flags`` (parallelism, training), ``grpo_flags``, ``rl_flags``, ``eval_flags``,
``output_flags`` and ``megatron_lm_flags`` (Megatron-LM flags refused by name); ``build_parser``
adds them in that order. ``flag_validation.validate_args`` holds every cross-field check; each
message names the flag(s) at fault. ``parse_args`` reads the command line in one pass first
(``command_line.py``: Megatron-LM's flags accepted, respelled or refused, unknown flags with the
closest of ours, argparse's own errors) and exits with status 2 and every problem in one message,
never the usage block; then the same for validation.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

from megatron.trainer.command_line import (
    CommandLineError,
    OneLineParser,
    last_value,
    prepare,
    report,
)
from megatron.trainer.eval_flags import add_evaluation_arguments
from megatron.trainer.exits import UsageError
from megatron.trainer.flag_validation import validate_args
from megatron.trainer.grpo_flags import add_grpo_arguments
from megatron.trainer.megatron_lm_flags import add_refused_flags
from megatron.trainer.model_flags import add_model_arguments
from megatron.trainer.output_flags import add_output_arguments
from megatron.trainer.rl_flags import add_rl_arguments
from megatron.trainer.run_config import CONFIG_FLAG, RUN_CONFIG_FILE, file_tokens, resolved
from megatron.trainer.training_flags import add_parallelism_arguments, add_training_arguments


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends each flag's default to its help, so the default is written once (at the flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False  # 0 and 0.0 are shown
        shown = not unset and action.default != argparse.SUPPRESS and action.nargs != 0
        if shown and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    """The parser of every flag, grouped as in Megatron-LM."""
    p = OneLineParser(
        prog="pretrain_grpo.py",
        description="GRPO post-training of a Megatron-Core GPT with forced-lag streaming rollouts.",
        allow_abbrev=False,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        CONFIG_FLAG,
        default=None,
        help="YAML run file of flag: value lines (names as on the command line, without --); "
        "flags given on the command line override it. Every run writes its resolved flags as "
        "such a file next to --metrics-file (<name>.config.yaml) and into each checkpoint "
        f"({RUN_CONFIG_FILE}).",
    )
    add_model_arguments(p)
    add_parallelism_arguments(p)
    add_training_arguments(p)
    add_grpo_arguments(p)
    add_rl_arguments(p)
    add_evaluation_arguments(p)
    add_output_arguments(p)
    add_refused_flags(p)
    return p


def parse_explicit(
    parser: argparse.ArgumentParser, argv: list[str] | None = None
) -> tuple[argparse.Namespace, frozenset[str]]:
    """``parser.parse_args(argv)`` and the attributes the command line set explicitly."""
    unset = object()
    dests = {a.dest for a in parser._actions if argparse.SUPPRESS not in (a.dest, a.default)}
    args = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, unset)))
    explicit = frozenset(d for d in dests if getattr(args, d) is not unset)
    for action in parser._actions:
        if action.dest in dests and getattr(args, action.dest) is unset:
            setattr(args, action.dest, action.default)
    return args, explicit


def parse_args(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parse and validate; raises ``UsageError`` (status 2, printed once by
    ``megatron.trainer.exits``) with every message on bad input. ``parser``: ``build_parser()``
    or one that extends it (another command on the same flags)."""
    import torch

    parser = parser or build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    from_file, problems = run_file_tokens(argv, parser)
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
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    errors = validate_args(args, world_size, torch.cuda.is_available(), explicit)
    if errors:
        raise UsageError(f"{parser.prog}: error: invalid arguments:\n  " + "\n  ".join(errors))
    args.run_config = resolved(args, parser)  # what the run writes to be reproduced
    return args


def run_file_tokens(
    argv: list[str], parser: argparse.ArgumentParser
) -> tuple[list[str], list[str]]:
    """The tokens of the last ``--config FILE`` of ``argv`` (read before the command line's own,
    which override them), and the file's problems."""
    path = last_value(CONFIG_FLAG, argv)
    return file_tokens(path, parser) if path is not None else ([], [])
