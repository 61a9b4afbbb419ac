"""The command line in one pass (``command_line.py``): Megatron-LM's example RL command lines get
every flag accepted or explained in one message, a typo gets one line with the closest flag, and
no error prints argparse's usage block."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from megatron.trainer.errors import UsageError
from megatron.trainer.flags.megatron_lm import MEGATRON_LM_RL_FLAGS
from megatron.trainer.flags.megatron_lm_common import MEGATRON_LM_COMMON_FLAGS, render_table
from megatron.trainer.flags.parse import build_parser, parse_args

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from megatron_lm_rl_commands import QWEN25_3B_SCRIPT, QWEN25_32B_README  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]


def message(argv: list[str]) -> str:
    """The ``UsageError`` message ``argv`` gets."""
    with pytest.raises(UsageError) as exc:
        parse_args(argv)
    return exc.value.message


def flags_of(argv: list[str]) -> list[str]:
    return [t.split("=")[0] for t in argv if t.startswith("--")]


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(QWEN25_32B_README, id="readme-qwen2.5-32b"),
        pytest.param(QWEN25_3B_SCRIPT, id="qwen_2p5_3b.sh"),
    ],
)
def test_megatron_lm_example_command_lines_get_every_flag_accepted_or_explained_at_once(command):
    text = message(command)
    lines = text.splitlines()
    assert lines[0].startswith("pretrain_grpo.py: error: ") and "problems" in lines[0]
    assert "usage:" not in text
    problems = [line.strip() for line in lines[1:]]
    ours = {
        s
        for a in build_parser()._actions
        if hasattr(a, "full_help") or a.help != argparse.SUPPRESS
        for s in a.option_strings
    }
    accepted = {e.flag for e in MEGATRON_LM_COMMON_FLAGS if e.status != "refused"}
    refused = {e.flag for e in MEGATRON_LM_COMMON_FLAGS if e.status == "refused"}
    refused |= {e.flag for e in MEGATRON_LM_RL_FLAGS if e.status == "refused"}
    for flag in flags_of(command):
        named = [p for p in problems if p.startswith(flag + " ") or f"argument {flag}:" in p]
        if flag in refused:
            assert len(named) == 1 and "(Megatron-LM): not supported: " in named[0], flag
        else:  # ours, or accepted with the same meaning: no problem unless its value is refused
            assert flag in ours | accepted, f"{flag} is neither ours nor in a Megatron-LM table"
            assert all("not a flag" not in p for p in named), flag
    assert len(problems) == len({p.split(" ")[0] for p in problems})  # each flag named once


def test_a_typo_is_one_line_with_the_closest_flag():
    assert message(["--rl-forced-lagg", "2"]) == (
        "pretrain_grpo.py: error: --rl-forced-lagg: not a flag of pretrain_grpo.py; did you mean "
        "--rl-forced-lag? (--help-all lists every flag)"
    )


def test_a_bad_value_is_one_line_without_the_usage_block():
    text = message(["--lr", "abc"])
    assert text == (
        "pretrain_grpo.py: error: argument --lr: invalid float value: 'abc' (--help-all lists every "
        "flag)"
    )


def test_megatron_lm_flags_with_our_meaning_are_accepted_or_respelled():
    args = parse_args(
        [
            "--use-mcore-models",
            "--transformer-impl",
            "transformer_engine",
            "--te-rng-tracker",
            "--attention-dropout",
            "0.0",
            "--hidden-dropout",
            "0",
            "--calculate-per-token-loss",
            "--mock-data",
            "--seq-length",
            "48",
            "--inference-max-seq-length",
            "48",
            "--inference-max-batch-size",
            "16",
            "--lr-warmup-samples",
            "0",
            "--use-rotary-position-embeddings",
            "--ckpt-format",
            "torch",
        ]
    )
    assert (args.inference.max_requests, args.training.lr_warmup_iters) == (16, 0)
    assert args.model.position_embedding_type == "rope"


@pytest.mark.parametrize(
    "argv, expected",
    [
        pytest.param(
            ["--attention-dropout", "0.1"],
            "--attention-dropout 0.1 (Megatron-LM): only 0 or 0.0 is supported",
            id="dropout",
        ),
        pytest.param(
            ["--inference-max-seq-length", "64"],
            "--inference-max-seq-length 64 (Megatron-LM): must equal --seq-length (32)",
            id="seq-length",
        ),
        pytest.param(
            ["--lr-warmup-samples", "100"],
            "--lr-warmup-samples 100 (Megatron-LM): only 0 is supported",
            id="warmup-samples",
        ),
        pytest.param(
            ["--transformer-impl", "local"],
            "--transformer-impl local (Megatron-LM): only transformer_engine is supported",
            id="transformer-impl",
        ),
        pytest.param(
            ["--ckpt-format", "torch_dist"],
            "--ckpt-format torch_dist: the CPU tier writes torch checkpoints",
            id="ckpt-format",
        ),
    ],
)
def test_a_megatron_lm_value_with_another_meaning_is_refused_naming_it(argv, expected):
    assert expected in message(argv)


def test_the_common_table_declares_nothing_twice_and_points_at_real_flags():
    ours = {s for a in build_parser()._actions for s in a.option_strings}
    for entry in MEGATRON_LM_COMMON_FLAGS:
        assert entry.flag not in ours, f"{entry.flag} is one of ours: not a Megatron-LM-only flag"
        if entry.rewrite:
            assert entry.rewrite[0] in ours, entry.flag
    flags = [e.flag for e in MEGATRON_LM_COMMON_FLAGS]
    assert len(flags) == len(set(flags))


def test_the_user_guide_table_is_the_common_flag_table():
    assert render_table() in (ROOT / "docs" / "user_guide.md").read_text()
