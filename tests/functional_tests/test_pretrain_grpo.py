"""End-to-end runs of ``pretrain_grpo.py`` under torchrun: golden values and the acceptance checks.

Runs are cached per module, so each configuration trains once; they use OMP_NUM_THREADS=1 so that
single-process and two-process runs do the same arithmetic.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest
from golden_values import ROOT, compare, load_case, run_case, run_training

CASES = ["grpo_tiny_lag2", "grpo_tiny_lag0", "grpo_tiny_tp2_lag2", "grpo_tiny_dp2_lag2"]


@pytest.fixture(scope="module")
def runs():
    cache: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in cache:
            cache[name] = run_case(name)
        return cache[name]

    return get


@pytest.mark.parametrize("case", CASES)
def test_metrics_match_golden_values(runs, case):
    assert compare(case, runs(case)) == []


def test_lag_2_submission_staleness_is_exactly_2_after_warm_up(runs):
    for m in runs("grpo_tiny_lag2"):
        expected = min(m["step"], 2)
        assert (m["staleness_min"], m["staleness_max"]) == (expected, expected), m["step"]
        assert m["lag"] == 2 and m["in_flight_batches"] == 3
        assert 0 <= m["token_staleness_min"] <= m["token_staleness_max"] <= expected


def test_lag_0_is_on_policy_at_every_step(runs):
    for m in runs("grpo_tiny_lag0"):
        assert m["staleness_min"] == m["staleness_max"] == 0
        assert m["token_staleness_max"] == 0 and m["in_flight_batches"] == 1
        assert m["queue_depth"] == 0


@pytest.mark.parametrize("case", ["grpo_tiny_tp2_lag2", "grpo_tiny_dp2_lag2"])
def test_two_process_runs_match_the_single_process_run(runs, case):
    """Rewards are identical (same tokens); losses agree to float32 rounding.

    The GRPO loss sums terms whose group-normalized advantages nearly cancel, so a step's loss
    can be ~1e-3 while TP's different reduction order moves it by ~1e-7: relative 1e-4, with an
    absolute floor of 1e-6 for losses that close to zero.
    """
    single, parallel = runs("grpo_tiny_lag2"), runs(case)
    for a, b in zip(single[:5], parallel[:5]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_same_command_twice_gives_identical_per_step_loss(runs):
    first = runs("grpo_tiny_lag2")
    case = load_case("grpo_tiny_lag2")
    second = run_training(case["nproc_per_node"], case["args"])
    assert [m["loss"] for m in second] == [m["loss"] for m in first]
    assert [m["reward_mean"] for m in second] == [m["reward_mean"] for m in first]


def test_bad_env_config_exits_naming_file_entry_and_field(tmp_path):
    config = tmp_path / "envs.yaml"
    config.write_text("- agent_type: digits\n  agent_args: {task: copy, max_digitz: 3}\n")
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", f"--env-config={config}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert str(config) in proc.stderr and "entry 0" in proc.stderr
    assert "agent_args.max_digitz" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_default_main_job_learns_within_ten_minutes():
    """The README's main command: reward rises from ~0.03 to >= 0.5 with forced lag 2."""
    start = time.monotonic()
    metrics = run_training(1, {"rl-forced-lag": 2}, timeout=600)
    elapsed = time.monotonic() - start
    rewards = [m["reward_mean"] for m in metrics]
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    print(
        f"default run: {len(metrics)} steps in {elapsed:.0f} s, reward first-10 {first:.3f} "
        f"last-10 {last:.3f}"
    )
    assert elapsed < 600
    assert last >= 0.5 and last >= 2 * first
    assert all(m["staleness_min"] == m["staleness_max"] == min(m["step"], 2) for m in metrics)


def test_resuming_from_a_checkpoint_continues_the_same_run(tmp_path):
    """At L=0 a run saved at step 3 and resumed reproduces the uninterrupted run exactly."""
    common = {"rl-forced-lag": 0, "train-iters": 6, "lr-warmup-iters": 2, "seed": 5}
    full = run_training(1, common)
    first = run_training(1, {**common, "save": tmp_path, "save-interval": 3})
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3\n")  # resume from step 3
    resumed = run_training(1, {**common, "load": tmp_path})
    assert [m["step"] for m in resumed] == [3, 4, 5]
    assert [m["loss"] for m in first] == [m["loss"] for m in full]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full[3:]]
    assert [m["lr"] for m in resumed] == [m["lr"] for m in full[3:]]
