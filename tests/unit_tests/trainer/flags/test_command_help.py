"""Each command's ``--help`` is its own: ``serve`` and ``evaluate`` list the options they read
(``Option.commands``) and their own group, ``--help-all`` every option of ``pretrain_grpo.py``;
every command still accepts every option (a shared run file or command line), and
``pretrain_grpo.py --help`` lists its common options only."""

from __future__ import annotations

import argparse
import inspect
import re

import pytest

from megatron.trainer import checkpoint_model, config, evaluate, grpo, serve
from megatron.trainer.flags.option import COMMANDS, EVALUATE, SERVE, option, options
from megatron.trainer.flags.parse import build_parser
from megatron.trainer.flags.run import SECTIONS, term_options
from megatron.trainer.runtime import exits, initialize

TRAINING_ONLY = (
    "--train-iters",
    "--lr",
    "--grpo-group-size",
    "--save-interval",
    "--eval-interval",
    "--rl-forced-lag",
    "--micro-batch-size",
    "--save",
    "--tensor-model-parallel-size",
    "--grpo-kl-beta",  # a loss term's weight
)

PARSERS = {SERVE: serve.build_serve_parser, EVALUATE: evaluate.build_evaluate_parser}

READERS = {
    SERVE: (serve.serve, serve.serve_problems, serve.served_key),
    EVALUATE: (evaluate.evaluate, evaluate.summary, grpo.load_agent, config.eval_config),
}
"""What each command calls with the run config (besides the loading both share)."""

SHARED_READERS = (
    checkpoint_model.load_checkpoint_model,
    checkpoint_model.read_trainer_weights,
    checkpoint_model.describe,
    config.model_build,
    config.lora_config,
    config.tokenizer,
    config.scheduler_config,
    config.server_limits,
    config.sampling_params,
    initialize.initialize_distributed,
    exits.debug_tracebacks,
)


def listed_flags(text: str) -> set[str]:
    """The flags an argparse help lists (first spelling of each entry)."""
    return set(re.findall(r"^  (--[\w-]+)", text, re.M))


def help_output(parse, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_no_training_flag_and_help_all_every_one(command, capsys):
    parse = {SERVE: serve.parse_serve_args, EVALUATE: evaluate.parse_evaluate_args}[command]
    short = listed_flags(help_output(parse, ["--help"], capsys))
    full = listed_flags(help_output(parse, ["--help-all"], capsys))
    assert not short & set(TRAINING_ONLY), short & set(TRAINING_ONLY)
    assert {"--hf-checkpoint", "--load", "--seq-length", "--bf16", "--help-all"} <= short
    trainer = listed_flags(build_parser(every=True).format_help())
    assert set(TRAINING_ONLY) <= trainer <= full and short < full
    own = {a.option_strings[0] for a in PARSERS[command]()._action_groups[-1]._group_actions}
    assert own <= short and own <= full  # the command's own group, in both


@pytest.mark.parametrize("command", COMMANDS)
def test_every_listed_option_is_one_the_command_reads(command):
    """Each listed option's field is read (``section.field``) by a function the command calls
    with the run config (its whole source: a branch the command never takes counts too); every
    other listed flag is the command's own or ``--config``."""
    source = "\n".join(inspect.getsource(f) for f in (*READERS[command], *SHARED_READERS))
    listed = listed_flags(PARSERS[command]().format_help())
    declared = set()
    for name, section in SECTIONS:
        for f, declared_option, flag in options(section):
            if flag not in listed:
                continue
            declared.add(flag)
            assert command in declared_option.commands, flag
            read = re.search(rf"\b{name}\.{f.name}\b", source) or f'"{flag}"' in source
            assert read, f"{command} --help lists {flag}, which nothing it calls reads"
    own = {a.option_strings[0] for a in PARSERS[command]()._action_groups[-1]._group_actions}
    assert listed - declared == own | {"--config", "--help-all"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_is_still_accepted(command, tiny_hf_checkpoints, monkeypatch, tmp_path):
    """Training's flags parse (and are checked) as before: a shared run file or command line
    works for every command."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("MEGATRON_RL_API_KEY", raising=False)
    parse = {SERVE: serve.parse_serve_args, EVALUATE: evaluate.parse_evaluate_args}[command]
    argv = ["--hf-checkpoint", str(tiny_hf_checkpoints["llama3"]), "--seq-length", "64"]
    argv += ["--train-iters", "4", "--lr", "0.01", "--grpo-group-size", "4", "--save-interval", "2"]
    argv += ["--eval-interval", "2", "--grpo-kl-beta", "0.1", "--save", str(tmp_path / "ck")]
    cfg, _ = parse(argv)
    assert (cfg.training.train_iters, cfg.training.lr, cfg.grpo.group_size) == (4, 0.01, 4)
    assert (cfg.evaluation.interval, cfg.grpo.weight("--grpo-kl-beta")) == (2, 0.1)


def test_the_trainers_help_lists_its_common_options_only():
    parser = build_parser()
    shown = {
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and a.help != argparse.SUPPRESS and a.dest != "help"
    }
    common = {flag for _, s in SECTIONS for _, d, flag in options(s) if d.common}
    terms = {flag for flag, _, _ in term_options()}
    assert shown == common | terms | {"--help-all", "--config"}
    assert "--tokenizer-model" not in listed_flags(parser.format_help())  # serve's, not common


def test_an_unknown_command_is_refused_where_the_option_is_declared():
    with pytest.raises(ValueError, match="serv"):
        option(1, "A count.", commands=("serv",))
