"""``flags.resolve`` with an ``--env-config``: each entry's generation budget against the sequence
length, and a bad env config ending the run with status 2 and its message."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron.rl.agent.env_config import load_env_config
from megatron.trainer.flags.parse import check
from megatron.trainer.flags.rollouts import env_config_problems
from megatron.trainer.grpo import load_agent
from megatron.trainer.runtime.exits import run_main

ROOT = Path(__file__).resolve().parents[4]


MATH_DATA = ROOT / "examples/rl/environments/math/tiny_arithmetic.jsonl"


def math_entry(max_tokens: int, evaluation_only: bool = False) -> str:
    """An env-config entry of the math example with its own generation budget."""
    return (
        f"- agent_type: examples.rl.environments.math:MathEnvironment\n  env_id: math\n"
        f"  agent_args: {{path: {MATH_DATA}, max_tokens: {max_tokens}}}\n"
        f"  evaluation_only: {str(evaluation_only).lower()}\n"
    )


def env_config_args(tmp_path, text: str, *argv: str):
    """Validated flags of a run on the env config ``text``."""
    config = tmp_path / "envs.yaml"
    config.write_text(text)
    args, errors = check(["--env-config", str(config), *argv])
    assert errors == []
    return args


@pytest.mark.parametrize(
    "entries, seq_length, refused",
    [
        pytest.param(math_entry(32), 32, True, id="budget-equals-seq-length"),
        pytest.param(math_entry(300), 256, True, id="budget-beyond-seq-length"),
        pytest.param(
            "- {agent_type: digits}\n" + math_entry(32, evaluation_only=True),
            32,
            True,
            id="evaluation-only-entry",
        ),
        pytest.param(math_entry(31), 32, False, id="room-for-a-one-token-prompt"),
    ],
)
def test_an_entry_budget_must_leave_room_for_a_prompt(tmp_path, entries, seq_length, refused):
    args = env_config_args(tmp_path, entries, "--seq-length", str(seq_length))
    agent = load_env_config(args.rollouts.env_config)
    errors = env_config_problems(args.rollouts.env_config, args.model.seq_length, agent)
    budget = agent.evaluated[-1].args.max_tokens
    expected = (
        f"--env-config {args.rollouts.env_config}, entry 'math': agent_args.max_tokens ({budget}) must "
        f"be smaller than --seq-length ({seq_length}) to leave room for the prompt"
    )
    assert errors == ([expected] if refused else [])


def missing_datasets(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # importing it raises ImportError


@pytest.mark.parametrize(
    "config, argv, patch, lines",
    [
        pytest.param(
            str(ROOT / "examples/rl/environment_configs/gsm8k.yaml"),
            [],
            missing_datasets,
            [
                "pretrain_grpo.py: error: --env-config: env config {config}, entry 0 (agent_type "
                "'examples.rl.environments.gsm8k:GSM8KEnvironment'): needs the 'datasets' "
                "package, which cannot be imported (import of datasets halted; None in "
                "sys.modules): pip install -e '.[math]'"
            ],
            id="missing-package",
        ),
        pytest.param(
            math_entry(256),
            ["--seq-length", "256", "--rl-default-max-tokens", "16"],
            None,
            [
                "pretrain_grpo.py: error: invalid arguments:",
                "  --env-config {config}, entry 'math': agent_args.max_tokens (256) must be "
                "smaller than --seq-length (256) to leave room for the prompt",
            ],
            id="budget-beyond-seq-length",
        ),
    ],
)
def test_a_bad_env_config_ends_the_run_with_status_2_and_its_message(
    tmp_path, monkeypatch, capsys, config, argv, patch, lines
):
    if config.startswith("- "):  # YAML text
        args = env_config_args(tmp_path, config, *argv)
    else:
        monkeypatch.chdir(ROOT)
        args, errors = check(["--env-config", config, *argv])
    if patch is not None:
        patch(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        run_main(lambda: load_agent(args))
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.splitlines() == [line.format(config=args.rollouts.env_config) for line in lines]
