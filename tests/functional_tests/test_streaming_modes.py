"""Megatron-LM's streaming modes end to end: their flags run unchanged, every mode is reproducible
and keeps its staleness contract at every step, and B/B at an integer lag is our forced lag.

The golden cases ``streaming_*`` (``test_pretrain_grpo.py``) pin each mode's values and its
resume after kill -9; here the properties a user relies on are checked on fresh runs.
"""

from __future__ import annotations

import subprocess

import pytest
from golden_values import ROOT, load_case, run_training, subprocess_env, training_command
from test_exact_resume import assert_same_run, stopped_then_resumed
from test_pretrain_grpo import DETERMINISTIC

from megatron.rl.rollout.granularity import gate_capacity, group_staleness

G_G = {
    "rl-submission-granularity": "G",
    "rl-consumption-granularity": "G",
    "rl-partial-rollouts": True,
}
SMALL = {"train-iters": 6, "lr-warmup-iters": 1, "seed": 7, "grpo-prompts-per-step": 4}


def expected_staleness(batch_id: int, capacity: int, groups: int) -> tuple[int, int]:
    """(min, max) submission staleness of a batch's rollouts under G submission."""
    values = [
        group_staleness(u, capacity, groups)
        for u in range(batch_id * groups, (batch_id + 1) * groups)
    ]
    return min(values), max(values)


@pytest.mark.parametrize(
    "consumption, lag",
    [
        pytest.param("G", 0.5, id="G/G-0.5"),
        pytest.param("G", -1, id="G/G-minus-1"),
        pytest.param("G", 2.25, id="G/G-2.25"),
        pytest.param("B", 0, id="G/B-0"),
    ],
)
def test_every_step_keeps_the_mode_contract_and_reruns_bitwise(consumption, lag):
    args = {**SMALL, **G_G, "rl-consumption-granularity": consumption, "rl-generation-lag": lag}
    first, second = run_training(1, args), run_training(1, args)
    for metric in DETERMINISTIC:
        assert [m[metric] for m in first] == [m[metric] for m in second], metric
    capacity = gate_capacity(lag, SMALL["grpo-prompts-per-step"])
    for m in first:
        want = expected_staleness(m["batch_id"], capacity, SMALL["grpo-prompts-per-step"])
        assert (m["staleness_min"], m["staleness_max"]) == want, m["step"]
        assert m["gate_capacity"] == capacity and 0 <= m["gate_held"] <= capacity


@pytest.mark.parametrize(
    "consumption, lag, exit_at",
    [
        pytest.param("B", 1.5, 3, id="G/B-1.5"),
        pytest.param("G", 0.25, 2, id="G/G-0.25"),
    ],
)
def test_a_stop_off_the_save_grid_then_resume_equals_the_uninterrupted_run(
    tmp_path, consumption, lag, exit_at
):
    """Saved by --exit-interval between two steps (groups of later batches in flight, some
    finished before their batch is collected) and resumed: every step equals the run that never
    stopped, the gate's counts included."""
    args = {**SMALL, **G_G, "rl-consumption-granularity": consumption, "rl-generation-lag": lag}
    resumed = stopped_then_resumed(args, tmp_path, exit_at)
    uninterrupted = run_training(1, args)
    assert_same_run(resumed, uninterrupted)
    for metric in ("gate_held", "mean_kv_cache_staleness"):
        assert [m[metric] for m in resumed] == [m[metric] for m in uninterrupted], metric


def test_b_b_at_an_integer_generation_lag_is_the_forced_lag_bitwise(runs):
    """``--rl-generation-lag 2`` (B/B, Megatron-LM's spelling) is the golden lag2 run."""
    case = load_case("lag2")
    args = {k: v for k, v in case["args"].items() if k != "rl-forced-lag"}
    megatron = run_training(case["nproc_per_node"], {**args, "rl-generation-lag": 2})
    golden = runs("lag2")
    for metric in DETERMINISTIC:
        assert [m[metric] for m in megatron] == [m[metric] for m in golden], metric


def test_megatron_lm_throughput_flags_run_unchanged_with_the_model_scaled_to_cpu():
    """The RL flags of Megatron-LM's 8B throughput case (G/G, partial rollouts, lag 19) with a
    CPU-sized model and batch; then with the lag left out, autotuned from the engine's slots."""
    flags = {**G_G, "rl-generation-lag": 19, "train-iters": 3, "grpo-prompts-per-step": 2}
    flags |= {"grpo-group-size": 2, "inference-max-requests": 16, "lr-warmup-iters": 1}
    flags |= {"micro-batch-size": 4}
    metrics = run_training(1, flags)
    assert [m["gate_capacity"] for m in metrics] == [40] * 3
    assert [m["staleness_max"] for m in metrics] == [0, 1, 2]  # all submitted at version 0
    autotuned = {k: v for k, v in flags.items() if k != "rl-generation-lag"}
    proc = subprocess.run(
        training_command(1, autotuned),
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 16 slots // 2 rollouts = 8 groups = 4 batches of 2: lag 3, a gate of 8 groups
    assert "streaming G/G, lag 3 (autotuned from --inference-max-requests 16): gate of 8" in (
        proc.stdout
    )
    assert "staleness    exact: every group u trained" in proc.stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        pytest.param(
            {"rl-submission-granularity": "G"},
            "--rl-submission-granularity G needs --rl-partial-rollouts",
            id="no-partial-rollouts",
        ),
        pytest.param(
            {"rl-consumption-granularity": "G"},
            "--rl-consumption-granularity G is finer than --rl-submission-granularity B",
            id="finer-consumption",
        ),
        pytest.param(
            {**G_G, "rl-consumption-granularity": "R"},
            "--rl-consumption-granularity R is not supported",
            id="r-consumption",
        ),
        pytest.param(
            {**G_G, "rl-submission-granularity": "R"},
            "--rl-submission-granularity R is not implemented here yet",
            id="r-submission",
        ),
        pytest.param(
            {**G_G, "rl-generation-lag": 1, "rl-max-inflight-requests": 64},
            "two spellings of the lag",
            id="lag-and-inflight",
        ),
        pytest.param(
            {**G_G, "rl-consumption-granularity": "B", "rl-generation-lag": -1},
            "fewer than the 8 of a batch",
            id="g-b-below-a-batch",
        ),
        pytest.param({"rl-generation-lag": -2}, "--rl-generation-lag must be >= -1", id="lag-2"),
    ],
)
def test_streaming_flags_that_cannot_run_exit_2_naming_the_flags(flags, message):
    proc = subprocess.run(
        training_command(1, {"train-iters": 1, **flags}),
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
