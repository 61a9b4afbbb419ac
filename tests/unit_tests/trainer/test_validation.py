"""Validation as NeMo-RL's ``validate_sync`` in a short CPU run: a held-out partition of the math
environment's file, evaluation before the first and after the last step, response lengths, and
the JSONL dump of every evaluated rollout."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from grpo_testing.distributed import env_without_world

from examples.rl.environments.math.environment import MathArgs, MathEnvironment

ROOT = Path(__file__).resolve().parents[3]
DATA = "examples/rl/environments/math/tiny_arithmetic.jsonl"  # 8 problems: 2 held out at 0.25
FLAGS = [
    "--rl-forced-lag",
    "1",
    "--train-iters",
    "3",
    "--lr-warmup-iters",
    "1",
    "--grpo-prompts-per-step",
    "2",
    "--grpo-group-size",
    "2",
    "--micro-batch-size",
    "4",
    "--seed",
    "3",
    "--env-config",
    "examples/rl/environment_configs/math.yaml",
    "--val-split-fraction",
    "0.25",
    "--val-at-start",
    "--val-at-end",
    "--eval-samples",
    "2",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(metrics records, dump directory) of one run."""
    tmp = tmp_path_factory.mktemp("validation")
    argv = [*FLAGS, "--val-dump-dir", str(tmp / "dump"), "--metrics-file", str(tmp / "m.jsonl")]
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", *argv],
        cwd=ROOT,
        env=env_without_world(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]
    return records, tmp / "dump"


def held_out_ids() -> list[str]:
    """The problem ids of the validation partition, in validation order."""
    env = MathEnvironment("math", MathArgs(path=str(ROOT / DATA), max_tokens=6))
    env.hold_out(0.25)
    return [env.problem(i).problem_id for i in env.validation_indices]


def test_validation_runs_at_start_and_at_end_and_logs_lengths(run):
    records, _ = run
    assert [r["step"] for r in records] == [0, 1, 2]
    start, middle, end = records
    assert start["eval_at_start/policy_version"] == 0  # before the first update
    assert end["eval/policy_version"] == 3  # after the last one
    assert not any(k.startswith("eval") for k in middle)
    assert not any(k.startswith("eval/") for k in start)
    for prefix, r in (("eval_at_start/", start), ("eval/", end)):
        assert r[f"{prefix}prompts"] == 2  # every held-out problem, once
        for p in ("greedy", "sample"):
            assert (
                1
                <= r[f"{prefix}{p}_response_length_mean"]
                <= r[f"{prefix}{p}_response_length_max"]
                <= 6
            )
            assert 0 <= r[f"{prefix}{p}_truncated_fraction"] <= 1


@pytest.mark.parametrize(
    "version, prefix, step",
    [pytest.param(0, "eval_at_start/", 0, id="at-start"), pytest.param(3, "eval/", 2, id="at-end")],
)
def test_each_evaluation_dumps_its_rollouts_of_held_out_problems(run, version, prefix, step):
    records, dump = run
    assert sorted(p.name for p in dump.iterdir()) == ["eval-v0.jsonl", "eval-v3.jsonl"]
    lines = [json.loads(x) for x in (dump / f"eval-v{version}.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * (1 + 2)  # per held-out problem: one greedy, two sampled rollouts
    ids = held_out_ids()
    assert [x["problem_id"] for x in lines if x["pass"] == "greedy"] == ids
    assert sorted(x["problem_id"] for x in lines if x["pass"] == "sample") == sorted(ids * 2)
    metrics = records[step]
    for p in ("greedy", "sample"):
        mine = [x for x in lines if x["pass"] == p]
        assert all(x["policy_version"] == version and x["error"] is None for x in mine)
        assert statistics.fmean(x["reward"] for x in mine) == pytest.approx(
            metrics[f"{prefix}{p}_reward"]
        )
        lengths = [x["response_tokens"] for x in mine]
        assert statistics.fmean(lengths) == metrics[f"{prefix}{p}_response_length_mean"]
        assert max(lengths) == metrics[f"{prefix}{p}_response_length_max"]
        cut = statistics.fmean(x["truncated"] for x in mine)
        assert cut == metrics[f"{prefix}{p}_truncated_fraction"]
        for x in mine:
            assert not x["truncated"] or x["response_tokens"] == 6  # cut at the 6-token budget
            assert set(x) >= {"prompt", "response", "reward"}
