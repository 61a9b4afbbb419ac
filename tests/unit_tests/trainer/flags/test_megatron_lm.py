"""Flags that share a name with Megatron-LM's mean what they mean there (one test per row of the
README's "same name, different meaning" list), Megatron-LM spellings of our flags are accepted,
the others are refused naming our equivalent, and the README table is the module's table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.trainer import config
from megatron.trainer.collection import Collection
from megatron.trainer.flags.megatron_lm import MEGATRON_LM_RL_FLAGS, render_table
from megatron.trainer.flags.parse import build_parser, check
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.optimizer import build_scheduler

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
    return TrainBatch(ids, ids, ones, ones, torch.zeros(rows), torch.ones(rows),
                      torch.full((rows,), 3))  # fmt: skip


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
    scheduler = build_scheduler(optimizer, args)
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


def test_the_readme_table_is_the_flag_table():
    readme = (ROOT / "README.md").read_text()
    assert render_table() in readme
