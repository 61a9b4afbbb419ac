"""YAML run files (``--config run.yaml``) and the resolved flags a run writes for reproduction.

A run file maps flag names, as on the command line without the dashes (``rl-forced-lag: 2``;
``rl_forced_lag`` works too), to values: ``true`` for a switch, ``false`` for its ``--no-`` form
where it has one, a list for a flag of several values, ``null`` to keep the default. Its flags are
read before the command line's, so every flag given on the command line overrides the file's,
wherever ``--config`` stands. A key that is not a flag is an error naming the file, the key and
the closest flag.

``resolved(run)`` is every option's final value (the command line's, the file's, the
default or what validation derived), as a run file: ``write`` puts it next to ``--metrics-file``
(``<metrics>.config.yaml``) and into each checkpoint (``run_config.yaml``), and
``--config`` of that file with the same ``--train-iters`` reruns the run.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path
from typing import Any

import yaml

from megatron.trainer.flags.option import dest_of, options
from megatron.trainer.flags.run import SECTIONS, RunConfig


def every_option(run: RunConfig) -> list[tuple[str, Any]]:
    """(flag, default) of every option, loss-term weights included, in ``--help-all``'s order."""
    found = []
    for name, _ in SECTIONS:
        found += [(flag, f.default) for f, _, flag in options(getattr(run, name))]
    found += [(flag, 0.0) for flag, _ in run.grpo.term_weights]
    return found


CONFIG_FLAG = "--config"
RUN_CONFIG_FILE = "run_config.yaml"


def file_tokens(path: str, parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """The command-line tokens of run file ``path``, and its problems (one line each)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        return [], [f"{CONFIG_FLAG} {path}: cannot read it: {' '.join(str(exc).split())}"]
    if data is None:
        return [], []
    if not isinstance(data, dict):
        return [], [
            f"{CONFIG_FLAG} {path}: expected a mapping of flag: value, got a "
            f"{type(data).__name__}"
        ]
    options = {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}
    tokens: list[str] = []
    problems: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        action = options.get(flag)
        if action is None or flag == CONFIG_FLAG:
            close = difflib.get_close_matches(flag, list(options), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0][2:]}?" if close else ""
            problems.append(f"{CONFIG_FLAG} {path}: {key}: not a flag{hint}")
            continue
        tokens += _tokens(flag, value, action, options)
    return tokens, problems


def _tokens(flag: str, value: Any, action: argparse.Action, options: dict) -> list[str]:
    """``flag`` with ``value`` as command-line tokens."""
    if value is None:
        return []
    if isinstance(value, bool) and action.nargs == 0:
        if value:
            return [flag]
        negative = "--no-" + flag[2:]
        return [negative] if negative in options else []
    if isinstance(value, list):
        return [flag, *map(str, value)]
    return [flag, str(value)]


def resolved(run: RunConfig) -> dict[str, Any]:
    """Every option of ``run`` with its final value (run-file keys; the architecture as
    ``config.json`` gave it under ``--hf-checkpoint``)."""
    values = run.flat()
    out: dict[str, Any] = {}
    for flag, default in every_option(run):
        value = values[dest_of(flag)]
        if value is None and default is not None:  # e.g. a cap set to 'none'
            value = "none"
        out[flag[2:]] = list(value) if isinstance(value, tuple) else value
    return out


def dump(config: dict[str, Any]) -> str:
    """A run file's text."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=None)


def write(config: dict[str, Any], path: Path) -> None:
    """Write run file ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(config))


def next_to_metrics(metrics_file: str) -> Path:
    """Where the run file of a run with ``--metrics-file metrics_file`` goes."""
    return Path(metrics_file).with_suffix(".config.yaml")
