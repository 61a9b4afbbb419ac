"""``python -m megatron.trainer.evaluate``: its flags (the trainer's evaluation flags, no training
flag needed), the numbers it derives from an evaluation, and its table.

Evaluating a checkpoint end to end (a subprocess, the JSON against the dump, the trainer's
held-out split) is in ``tests/functional_tests/test_serve_and_evaluate.py``.
"""

from __future__ import annotations

import json

import pytest

from megatron.rl.eval.confidence import wilson_interval
from megatron.rl.eval.runner import EnvEvaluation, EvalConfig, ResponseLengths
from megatron.trainer.checkpoint_model import CheckpointModel
from megatron.trainer.errors import UsageError
from megatron.trainer.evaluate import (
    PROG,
    environment_numbers,
    evaluate,
    format_table,
    parse_evaluate_args,
    report,
    summary,
    write_json,
)
from megatron.trainer.flags.run import RunConfig


@pytest.fixture
def tiny(tiny_hf_checkpoints, monkeypatch) -> str:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return str(tiny_hf_checkpoints["llama3"])


def record(pass_name: str, problem: int, reward: float, error: str | None = None, sample=0):
    return {
        "env_id": "math",
        "pass": pass_name,
        "problem": problem,
        "sample": sample,
        "problem_id": f"p{problem}",
        "prompt": "1+1=",
        "response": "2",
        "reward": reward,
        "response_tokens": 2,
        "truncated": False,
        "error": error,
    }


def math_result() -> EnvEvaluation:
    """Three problems: greedy rewards 1 (correct), 0.5 (not), and a placeholder."""
    greedy = [record("greedy", 0, 1.0), record("greedy", 1, 0.5), record("greedy", 2, 0.0, "boom")]
    sampled = [record("sample", p, r, sample=s) for p in range(3) for s, r in enumerate([1.0, 0])]
    return EnvEvaluation(
        env_id="math",
        greedy_reward=0.5,
        sample_reward=0.5,
        pass_at_k={1: 0.5, 2: 1.0},
        failed=1,
        prompts=3,
        greedy_lengths=ResponseLengths(2.0, 3, 0.0),
        sample_lengths=ResponseLengths(4.5, 9, 0.25),
        records=greedy + sampled,
        seconds=1.25,
    )


def test_greedy_accuracy_counts_rewards_at_the_threshold_and_no_placeholder():
    numbers = environment_numbers(math_result(), threshold=1.0)
    assert (numbers["greedy_correct"], numbers["prompts"]) == (1, 3)
    assert numbers["greedy_accuracy"] == pytest.approx(1 / 3)
    assert numbers["greedy_accuracy_ci95"] == list(wilson_interval(1, 3))
    assert numbers["pass_at_k"] == {"1": 0.5, "2": 1.0}
    assert numbers["sample_response_length_mean"] == 4.5 and numbers["failed"] == 1
    lower = environment_numbers(math_result(), threshold=0.5)
    assert lower["greedy_correct"] == 2  # the placeholder never counts, whatever its reward


def numbers_of(results: list[EnvEvaluation]) -> dict:
    config = EvalConfig(
        num_prompts=3, samples_per_prompt=2, pass_k=(1, 2), correct_threshold=1.0, seed=5
    )
    loaded = CheckpointModel(None, None, None, 7, "--load CK (iteration 7)")
    args = RunConfig().with_flags(env_config="envs.yaml", val_split_fraction=0.25)
    return summary(results, config, args, loaded, seconds=2.5)


def test_the_summary_says_what_was_evaluated_and_keeps_the_trainers_metrics(tmp_path):
    numbers = numbers_of([math_result()])
    assert numbers["checkpoint"] == "--load CK (iteration 7)" and numbers["policy_version"] == 7
    assert (numbers["seed"], numbers["pass_k"], numbers["val_split_fraction"]) == (5, [1, 2], 0.25)
    assert numbers["dump"] is None and numbers["environments"][0]["env_id"] == "math"
    assert numbers["metrics"]["eval/greedy_reward"] == 0.5
    path = tmp_path / "out" / "eval.json"
    write_json(path, numbers)
    assert json.loads(path.read_text()) == json.loads(json.dumps(numbers))


def test_the_table_has_a_row_per_environment_with_the_interval():
    other = EnvEvaluation(
        "copy",
        1.0,
        0.75,
        {1: 0.75, 2: 1.0},
        0,
        prompts=2,
        seconds=0.5,
        records=[record("greedy", 0, 1.0), record("greedy", 1, 1.0)],
    )
    text = report(numbers_of([math_result(), other]))
    lines = text.splitlines()
    assert lines[0].startswith("evaluated    --load CK (iteration 7) (policy version 7) on 2")
    header, math, copy = lines[1:4]
    assert header.split("  ")[0] == "environment" and "pass@1" in header and "pass@2" in header
    low, high = wilson_interval(1, 3)
    assert math.startswith("math ") and f"0.333 [{low:.3f}, {high:.3f}]" in math
    assert "2.0 / 4.5" in math and "0.00 / 0.25" in math and math.endswith("1.2")
    assert copy.startswith("copy ") and "1.000 [0.342, 1.000]" in copy
    assert "reward >= 1" in lines[4]


def test_format_table_aligns_columns():
    table = format_table(["env", "n"], [["a", "10"], ["long-name", "2"]])
    assert table.splitlines() == ["env         n", "a          10", "long-name   2"]


def test_the_validation_flags_need_no_training_flag(tiny, tmp_path):
    args, _ = parse_evaluate_args(
        [
            "--hf-checkpoint",
            tiny,
            "--val-split-fraction",
            "0.5",
            "--val-dump-dir",
            str(tmp_path / "dump"),
            "--output-json",
            str(tmp_path / "eval.json"),
        ]
    )
    assert args.evaluation.val_split_fraction == 0.5 and args.evaluation.val_dump_dir.endswith(
        "dump"
    )


@pytest.mark.parametrize(
    "extra, needle",
    [
        pytest.param([], "no checkpoint: give --hf-checkpoint DIR", id="no-checkpoint"),
        pytest.param(["--eval-pass-k", "9"], "--eval-pass-k values must be in", id="pass-k"),
        pytest.param(["--env-config", "/no/such.yaml"], "--env-config: no such file", id="config"),
    ],
)
def test_bad_flags_are_refused_by_name(extra, needle, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UsageError) as exc:
        parse_evaluate_args(extra)
    assert exc.value.message.startswith(f"{PROG}: error:") and needle in exc.value.message


def test_an_unwritable_output_json_is_refused(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UsageError) as exc:
        parse_evaluate_args(["--hf-checkpoint", tiny, "--output-json", str(blocker / "x.json")])
    assert f"--output-json {blocker / 'x.json'}" in exc.value.message


@pytest.mark.parametrize(
    "config, extra, needle",
    [
        pytest.param(
            "- {agent_type: remote, env_id: far, agent_args: {url: 'http://127.0.0.1:9'}}\n",
            [],
            "--env-config: environments ['far'] generate through the trainer's inference server",
            id="remote",
        ),
        pytest.param(
            "- {agent_type: digits, env_id: copy, agent_args: {task: copy}}\n",
            ["--val-split-fraction", "0.5"],
            "--val-split-fraction: no trained environment is file-backed",
            id="split-without-a-data-set",
        ),
    ],
)
def test_environments_that_cannot_be_evaluated_are_refused_before_loading(
    config, extra, needle, tiny, tmp_path
):
    path = tmp_path / "envs.yaml"
    path.write_text(config)
    args, own = parse_evaluate_args(["--hf-checkpoint", tiny, "--env-config", str(path), *extra])
    with pytest.raises(SystemExit) as exc:
        evaluate(args, own)  # before torch.distributed is started
    assert needle in str(exc.value.code)
