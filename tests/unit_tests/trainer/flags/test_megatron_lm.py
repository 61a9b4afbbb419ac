"""Flags that share a name with Megatron-LM's mean what they mean there (one test per item of the
user guide's "semantics that differ" list), Megatron-LM spellings of our flags are accepted, the
others are refused naming our equivalent, and the user guide's tables are what the parser does:
each refused row's reason is the parser's message, each accepted or alias row's flag parses."""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.trainer import config
from megatron.trainer.config import optimizer_settings
from megatron.trainer.errors import UsageError
from megatron.trainer.flags.megatron_lm import MEGATRON_LM_RL_FLAGS, render_table
from megatron.trainer.flags.megatron_lm_common import BY_FLAG as COMMON_BY_FLAG
from megatron.trainer.flags.parse import build_parser, check, parse_args
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.train.collection import Collection
from megatron.trainer.train.optimizer import build_scheduler

ROOT = Path(__file__).resolve().parents[4]


def parsed(*argv: str, world_size: int = 1) -> tuple[RunConfig | None, list[str]]:
    return check(list(argv), world_size, cuda=False)


def test_grpo_iterations_are_training_iterations_over_one_collection():
    args, errors = parsed("--grpo-iterations", "2", "--train-iters", "10")
    assert errors == [] and args.iterations_per_collection == 2  # 2 passes x 64 / 64
    assert config.step_config(args, 21).needs_old_logprobs  # ratios against pi_old
    _, errors = parsed("--grpo-iterations", "2", "--train-iters", "5")
    assert any("--train-iters (5)" in e and "iterations per collection" in e for e in errors)


def test_a_global_batch_smaller_than_the_collection_gives_several_optimizer_steps():
    args, errors = parsed(
        "--global-batch-size", "32", "--grpo-iterations", "3", "--train-iters", "12"
    )
    assert errors == [] and args.iterations_per_collection == 6  # 3 passes x 2 global batches
    _, errors = parsed("--global-batch-size", "128")
    assert any("--global-batch-size (128) must be in [1" in e for e in errors)
    _, errors = parsed("--global-batch-size", "48")  # 64 x 1 is not a multiple of 48
    assert any("must be a multiple of --global-batch-size (48)" in e for e in errors)


def rows_batch(rows: int) -> TrainBatch:
    ids = torch.arange(rows)[:, None].expand(rows, 3).clone()
    ones = torch.ones(rows, 3)
    return TrainBatch(
        ids, ids, ones, ones, torch.zeros(rows), torch.ones(rows), torch.full((rows,), 3)
    )


@pytest.mark.parametrize(
    "rows, size, iterations, want",
    [
        pytest.param(8, 8, 2, [[0, 1, 2, 3, 4, 5, 6, 7]] * 2, id="whole-collection-twice"),
        pytest.param(8, 4, 2, [[0, 1, 2, 3], [4, 5, 6, 7]] * 2, id="two-global-batches"),
        pytest.param(6, 4, 2, [[0, 1, 2, 3], [4, 5, 0, 1], [2, 3, 4, 5]], id="wraps-around"),
    ],
)
def test_global_batches_walk_the_collection_in_order(rows, size, iterations, want):
    collection = Collection(rows_batch(rows), size, iterations)
    got = [collection.global_batch(j).input_ids[:, 0].tolist() for j in range(len(want))]
    assert got == want


def test_top_p_zero_and_top_k_minus_one_mean_off():
    args, errors = parsed("--rl-default-top-p", "0", "--rl-default-top-k", "-1")
    sampling = config.sampling_params(args)
    assert errors == [] and (sampling.top_p, sampling.top_k) == (1.0, 0)
    defaults, _ = parsed()
    assert (defaults.rollouts.default_top_p, defaults.rollouts.default_top_k) == (0.0, -1)
    args, _ = parsed("--rl-default-top-p", "0.9", "--rl-default-top-k", "5")
    assert (config.sampling_params(args).top_p, config.sampling_params(args).top_k) == (0.9, 5)


def test_rl_ignore_eos_reaches_training_rollouts_but_not_evaluation():
    args, errors = parsed("--rl-ignore-eos")
    assert errors == [] and config.sampling_params(args).ignore_eos
    assert not config.eval_config(args).sampling.ignore_eos  # evaluation ends responses at EOS
    defaults, _ = parsed()
    assert not config.sampling_params(defaults).ignore_eos


def test_truncation_coef_none_means_no_truncation_and_the_default_is_said():
    args, errors = parsed(
        "--rl-inference-logprobs-is-correction", "--rl-importance-sampling-truncation-coef", "none"
    )
    assert errors == [] and config.step_config(args, 21).importance == ImportanceConfig.tis(None)
    defaults, _ = parsed("--rl-inference-logprobs-is-correction")
    assert config.step_config(defaults, 21).importance == ImportanceConfig.tis(1.0)
    help_text = " ".join(build_parser(every=True).format_help().split())
    assert "'none' caps nothing (Megatron-LM's default)" in help_text


def test_dynamic_sampling_with_one_round_is_accepted():
    args, errors = parsed("--grpo-filter-groups-with-same-reward")
    assert errors == [] and config.dynamic_sampling_config(args).max_generation_rounds == 1


def test_a_warmup_longer_than_the_run_is_accepted_and_only_warms_up():
    args, errors = parsed("--train-iters", "5")  # default --lr-warmup-iters 10
    assert errors == []
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.training.lr)
    scheduler = build_scheduler(optimizer, optimizer_settings(args))
    lrs = []
    for _ in range(5):
        scheduler.step(increment=1)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == sorted(lrs) and lrs[-1] == pytest.approx(args.training.lr * 5 / 10)


@pytest.mark.parametrize(
    "megatron, ours, value",
    [
        pytest.param("--langrl-env-config", "env_config", "envs.yaml", id="env-config"),
        pytest.param("--rl-prompts-per-eval", "eval_prompts", "7", id="prompts-per-eval"),
    ],
)
def test_megatron_lm_spellings_of_our_flags_are_accepted(megatron, ours, value):
    args = build_parser().parse_args([megatron, value])
    assert str(getattr(args, ours)) == value  # argparse dest of our flag


@pytest.mark.parametrize(
    "entry", [e for e in MEGATRON_LM_RL_FLAGS if e.status == "refused"], ids=lambda e: e.flag
)
def test_refused_megatron_lm_flags_exit_naming_our_equivalent(entry, capsys):
    argv = [entry.flag, "1"] if entry.takes_value else [entry.flag]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert entry.flag in err and "Megatron-LM" in err
    if entry.ours:
        assert f"use {entry.ours}" in err


def test_every_same_flag_is_one_of_ours_with_help():
    parser = build_parser()
    options = {s: a for a in parser._actions for s in a.option_strings}
    for entry in MEGATRON_LM_RL_FLAGS:
        if entry.status in ("same", "alias"):
            assert entry.flag in options, entry.flag
            action = options[entry.flag]
            assert getattr(action, "full_help", action.help) not in (None, argparse.SUPPRESS)


GUIDE = ROOT / "docs" / "user_guide.md"
RL_HEADER = "| Megatron-LM flag | here | ours | why |"
COMMON_HEADER = "| Megatron-LM flag | here | why |"


def table_rows(header: str) -> list[list[str]]:
    """The cells of each row of the user guide's table whose first line is ``header``."""
    text = GUIDE.read_text()
    assert text.count(header + "\n") == 1, header
    rows = []
    for line in text[text.index(header + "\n") :].splitlines()[2:]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line[2:-2].split(" | ")])
    return rows


def usage_error(argv: list[str]) -> str:
    """The message of the ``UsageError`` that ``argv`` gets."""
    with pytest.raises(UsageError) as exc:
        parse_args(argv)
    return exc.value.message


def test_the_user_guide_table_is_the_flag_table():
    assert render_table() in GUIDE.read_text()
    assert [row[0] for row in table_rows(RL_HEADER)] == [
        f"`{e.flag}`" for e in MEGATRON_LM_RL_FLAGS
    ]


@pytest.mark.parametrize(
    "row", [r for r in table_rows(RL_HEADER) if r[1] == "refused"], ids=lambda r: r[0]
)
def test_each_refused_row_s_reason_is_the_parser_s_message(row):
    """The user guide's row, not the module's entry: what the table says is what a user gets."""
    flag, _, ours, why = (cell.strip("`") for cell in row)
    instead = f"; use {ours}" if ours else ""
    assert f"{flag} (Megatron-LM): not supported: {why}{instead}" in usage_error([flag])


@pytest.mark.parametrize(
    "row", [r for r in table_rows(RL_HEADER) if r[1] != "refused"], ids=lambda r: r[0]
)
def test_each_same_or_alias_row_names_a_flag_the_parser_takes(row):
    flag, here, ours, _ = (cell.strip("`") for cell in row)
    options = {s for a in build_parser()._actions for s in a.option_strings}
    assert here in ("same", "alias") and flag in options and ours in options
    assert (flag == ours) == (here == "same")


def common_status(cell: str) -> tuple[str, list[str], str | None, str | None]:
    """A common-table ``here`` cell: status, the only values, the flag it must equal, the
    rewrite (``accepted (`0` or `0.0` only)``, ``accepted (equal to `--seq-length`)``,
    ``alias (`0` only): `--lr-warmup-iters```)."""
    match = re.fullmatch(r"(accepted|alias|refused)(?: \((.*?)\))?(?:: `(.+)`)?", cell)
    assert match, cell
    status, condition, rewrite = match.groups()
    values = re.findall(r"`([^`]+)`", condition) if condition and "only" in condition else []
    equal = re.fullmatch(r"equal to `(.+)`", condition or "")
    return status, values, equal.group(1) if equal else None, rewrite


@pytest.mark.parametrize("row", table_rows(COMMON_HEADER), ids=lambda r: r[0])
def test_each_common_row_is_what_the_parser_does(row):
    """Refused: the row's reason is the message; accepted: it parses (with an allowed value, or
    one equal to the flag named), another value is refused with the reason; alias: it parses as
    the rewrite does."""
    flag, why = row[0].strip("`"), row[2].replace("`", "")
    status, values, equal, rewrite = common_status(row[1])
    takes_value = COMMON_BY_FLAG[flag].takes_value
    value = values[0] if values else "32" if equal else "1"
    argv = [flag, value] if takes_value else [flag]
    if status == "refused":
        assert f"{flag} (Megatron-LM): not supported: {why}" in usage_error(argv)
        return
    extra = [equal, value] if equal else []
    args = parse_args(argv + extra)
    if status == "alias":
        same = parse_args(rewrite.split() + argv[1:] + extra)
        assert replace(args, started="") == replace(same, started="")  # the clock may tick
    if values:
        assert f"{flag} 7 (Megatron-LM): only " in usage_error([flag, "7"])
        assert usage_error([flag, "7"]).endswith(
            f"is supported: {why} (--help-all lists every flag)"
        )
    if equal:
        assert f"must equal {equal} (33): {why}" in usage_error([flag, value, equal, "33"])
