"""``pretrain_grpo.py``'s command line end to end (``flags.parse.parse_args``): bad flags exit
with status 2 and one message naming the flag, without a traceback. The cross-field checks
themselves are tested in ``test_run.py``. Below: the parser itself (every listed
flag has its help and default once; ``--help`` exits 0; ``parse_explicit`` names exactly what the
command line set, which the ``--hf-checkpoint`` conflicts depend on)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

import pytest

from megatron.trainer.errors import UsageError
from megatron.trainer.flags.parse import build_parser, parse_args, parse_explicit


@pytest.mark.parametrize(
    "argv, flag",
    [
        pytest.param(["--rl-forced-lag", "-1"], "--rl-forced-lag", id="lag"),
        pytest.param(
            ["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size", id="pp"
        ),
        pytest.param(["--grpo-group-size", "1"], "--grpo-group-size", id="group-size"),
    ],
)
def test_entry_script_exits_non_zero_naming_the_flag(argv, flag):
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert flag in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_output_path_exits_within_seconds_with_one_message(tmp_path):
    (tmp_path / "F").write_text("")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", "--metrics-file", str(tmp_path / "F" / "m.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and time.monotonic() - start < 30
    assert proc.stderr.splitlines()[-1].strip().startswith("--metrics-file")
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr


# ----------------------------------------------------------------------------- the parser


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_shown_flag_has_help_and_its_default_once():
    parser = build_parser()
    text = parser.format_help()
    for action in _options(parser):
        if action.help == argparse.SUPPRESS:  # refused Megatron-LM flags: not listed
            assert all(f"  {o} " not in text for o in action.option_strings), action.dest
            continue
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
        assert action.help.count("(default") <= 1, action.option_strings
    for name in ("--rl-forced-lag", "--hf-checkpoint", "--grpo-group-size", "--save"):
        assert len(re.findall(rf"^  {name}(?=[ ,\n])", text, re.M)) == 1, name  # listed once
    assert "--rl-forced-lag N" in text and "(default: 0)" in text


def test_help_lists_the_common_options_and_help_all_every_one(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    short = capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help-all"])
    full = capsys.readouterr().out
    assert exc.value.code == 0
    assert "--rl-forced-lag" in short and "--adam-beta2" not in short
    assert "--help-all lists every option" in short
    hidden = [a for a in _options(build_parser()) if a.help == argparse.SUPPRESS]
    listed = [a for a in hidden if hasattr(a, "full_help")]  # not the refused Megatron-LM flags
    assert listed and all(re.search(rf"^  {a.option_strings[0]}[ ,\n]", full, re.M) for a in listed)
    assert "(default: 0.999)" in full and "Megatron-LM's default: 0" in full  # --lr-warmup-iters


def test_help_and_a_bad_flag_load_neither_torch_nor_megatron_core():
    """What keeps ``--help`` and a usage error under a second: parsing imports no heavy library
    (measured: 0.3 s for --help against 4.2 s when parsing imported megatron-core)."""
    probe = (
        "import sys\n"
        "from megatron.trainer.runtime.exits import run_main\n"
        "from megatron.trainer.flags.parse import parse_args\n"
        "try:\n"
        "    run_main(lambda: parse_args(sys.argv[1:]))\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in sys.modules if m in ('torch', 'megatron.core', 'transformers'))\n"
        "print('loaded:', heavy)\n"
    )
    for argv in (["--help"], ["--help-all"], ["--rl-forced-lagg", "2"]):
        out = subprocess.run(
            [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120
        ).stdout
        assert "loaded: []" in out, (argv, out[-300:])


def test_help_exits_zero_instead_of_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0 and not isinstance(exc.value, UsageError)
    assert "--rl-forced-lag" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, explicit",
    [
        pytest.param([], set(), id="nothing"),
        pytest.param(["--rl-forced-lag", "2"], {"rl_forced_lag"}, id="value"),
        pytest.param(["--grpo-group-size", "8"], {"grpo_group_size"}, id="the-default-value"),
        pytest.param(
            ["--no-rl-deterministic-schedule", "--seed", "7"],
            {"rl_deterministic_schedule", "seed"},
            id="negated-bool-and-int",
        ),
        pytest.param(["--rl-deterministic-schedule"], {"rl_deterministic_schedule"}, id="bool"),
    ],
)
def test_parse_explicit_names_what_the_command_line_set(argv, explicit):
    parser = build_parser()
    args, given = parse_explicit(parser, argv)
    assert given == explicit
    defaults = parser.parse_args([])
    for action in _options(parser):
        if action.dest not in explicit and action.default != argparse.SUPPRESS:
            assert getattr(args, action.dest) == getattr(defaults, action.dest), action.dest
    assert args.grpo_group_size == 8 and (args.rl_forced_lag == 2) == ("rl_forced_lag" in given)
