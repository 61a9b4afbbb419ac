"""The training loop with the optional algorithm flags, end to end on a tiny model (CPU).

Each run is ``python pretrain_grpo.py`` for a few steps in a subprocess; runs are cached per module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from grpo_testing.distributed import env_without_world

ROOT = Path(__file__).resolve().parents[3]
SMALL = [
    "--rl-forced-lag",
    "2",
    "--train-iters",
    "4",
    "--lr-warmup-iters",
    "1",
    "--grpo-prompts-per-step",
    "4",
    "--grpo-group-size",
    "4",
    "--micro-batch-size",
    "8",
    "--seed",
    "3",
]
DETERMINISTIC = (
    "loss",
    "grad_norm",
    "reward_mean",
    "reward_std",
    "clip_fraction",
    "mismatch_kl",
    "staleness_min",
    "staleness_max",
    "token_staleness_min",
    "token_staleness_mean",
    "token_staleness_max",
    "completion_tokens_mean",
)


def train(tmp_path: Path, name: str, *flags: str) -> subprocess.CompletedProcess:
    """One run in a world of its own (the rendezvous variables of this process are not
    inherited)."""
    metrics = tmp_path / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    return subprocess.run(
        [sys.executable, "pretrain_grpo.py", *SMALL, *flags, "--metrics-file", str(metrics)],
        cwd=ROOT,
        env=env_without_world(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def metrics_of(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    cache: dict[str, list[dict]] = {}

    def get(name: str, *flags: str) -> list[dict]:
        if name not in cache:
            proc = train(tmp, name, *flags)
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[name] = metrics_of(tmp, name)
        return cache[name]

    return get


def test_evaluation_does_not_perturb_training(runs):
    plain = runs("plain")
    evaluated = runs(
        "eval",
        "--eval-interval",
        "2",
        "--eval-prompts",
        "4",
        "--eval-samples",
        "4",
        "--eval-pass-k",
        "1",
        "4",
    )
    for a, b in zip(plain, evaluated):
        assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}
    logged = [m for m in evaluated if "eval/greedy_reward" in m]
    assert [m["step"] for m in logged] == [1, 3]
    assert [m["eval/policy_version"] for m in logged] == [2, 4]
    for m in logged:
        assert 0 <= m["eval/pass@1"] <= m["eval/pass@4"] <= 1
        assert 0 <= m["eval/greedy_reward"] <= 1


def test_evaluation_only_entries_are_evaluated_and_do_not_change_training(runs, tmp_path):
    """Megatron-LM's `evaluation_only: true` and `weight: 0`: evaluated, never trained on."""
    config = tmp_path / "envs.yaml"
    config.write_text(
        "- {agent_type: digits, env_id: copy, agent_args: {task: copy}}\n"
        "- {agent_type: digits, env_id: sort, agent_args: {task: sort}, evaluation_only: true}\n"
        "- {agent_type: digits, env_id: add, agent_args: {task: add}, weight: 0}\n"
    )
    flags = ("--eval-interval", "2", "--eval-prompts", "4", "--eval-samples", "4")
    single = runs("eval-copy", *flags)  # the default env config: the copy task alone
    mixed = runs("eval-only-entries", *flags, "--env-config", str(config))
    for a, b in zip(single, mixed):
        assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}
        assert [k for k in b if k.startswith("reward_mean/")] == ["reward_mean/copy"]
    for a, b in zip(single[1::2], mixed[1::2]):
        assert b["eval/greedy_reward/copy"] == a["eval/greedy_reward"]
        assert {"eval/greedy_reward/sort", "eval/greedy_reward/add"} <= set(b)


def test_optional_terms_log_their_metrics_and_keep_the_lag_exact(runs):
    metrics = runs(
        "terms",
        "--rl-inference-logprobs-is-correction",
        "--grpo-kl-beta",
        "0.05",
        "--grpo-entropy-term-weight",
        "0.001",
        "--grpo-iterations",
        "2",
        "--rl-use-sequence-packing",
    )
    assert [m["batch_id"] for m in metrics] == [0, 0, 1, 1]  # two iterations per collection
    for m in metrics:
        assert m["batch_staleness"] == min(m["batch_id"], 2)
        submitted_at = 2 * max(0, m["batch_id"] - 2)  # policy version: 2 updates per collection
        assert m["staleness_min"] == m["staleness_max"] == m["step"] - submitted_at
        for key in ("ref_kl", "entropy", "is_abs_delta_p", "is_kl", "is_truncated_fraction"):
            assert key in m
    assert len({m["lr"] for m in metrics}) == 4  # the schedule steps every iteration
    assert all(m["is_abs_delta_p"] > 0 and m["is_kl"] > 0 for m in metrics[2:])  # stale tokens


def test_dynamic_sampling_keeps_the_lag_exact(runs):
    metrics = runs(
        "dynamic",
        "--grpo-filter-groups-with-same-reward",
        "--grpo-max-generation-rounds",
        "6",
        "--rl-default-temperature",
        "2.0",
    )
    for m in metrics:
        assert m["staleness_min"] == m["staleness_max"] == min(m["step"], 2)
        assert m["dynamic_sampling_generated_groups"] == 24  # L > 0: every round, eagerly
        assert m["dynamic_sampling_generated_rounds"] == 6
        assert 1 <= m["dynamic_sampling_rounds"] <= 6
        assert m["in_flight_batches"] == 3


def test_dynamic_sampling_at_lag_zero_generates_rounds_only_while_the_batch_is_short(runs):
    metrics = runs(
        "dynamic-lazy",
        "--rl-forced-lag",
        "0",
        "--grpo-filter-groups-with-same-reward",
        "--grpo-max-generation-rounds",
        "3",
        "--rl-default-temperature",
        "1.0",
    )
    for m in metrics:
        assert m["staleness_min"] == m["staleness_max"] == 0
        full = m["dynamic_sampling_kept_groups"] == 4
        rounds = m["dynamic_sampling_rounds"] if full else 3  # a short batch takes all R rounds
        assert m["dynamic_sampling_generated_rounds"] == rounds
        assert m["dynamic_sampling_generated_groups"] == 4 * rounds
        assert m["dynamic_sampling_surplus_groups"] < 4  # the last round was needed
    # seed 3 at temperature 1: some batch fills before its last round, so it is never generated
    assert min(m["dynamic_sampling_generated_groups"] for m in metrics) < 12


def test_dynamic_sampling_without_qualifying_groups_trains_on_nothing_and_goes_on(runs):
    metrics = runs(
        "exhausted", "--grpo-filter-groups-with-same-reward", "--rl-default-temperature", "0"
    )  # greedy: every group's rollouts are identical, so no group qualifies
    assert len(metrics) == 4
    for m in metrics:
        assert m["dynamic_sampling_kept_groups"] == 0
        assert m["dynamic_sampling_dropped_groups"] == 4
        assert m["loss"] == 0.0 and m["grad_norm"] == 0.0  # every row masked
        assert m["zero_variance_group_fraction"] == m["zero_variance_group_fraction/copy"] == 1.0


def test_seq_logprob_error_masks_the_stale_sequences_above_the_threshold(runs):
    """Seed 6: steps 0-1 train on tokens of their own policy (the engine's logprobs are the
    trainer's up to rounding: error 1); step 2's tokens come from an older policy."""
    plain = runs("plain-seed6", "--seed", "6")
    measured = runs("seq-error", "--seed", "6", "--rl-log-seq-logprob-error")
    for a, b in zip(plain, measured):  # measuring costs a forward pass and changes nothing
        assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}
        assert "seq_logprob_error_masked_sequences" not in b
        low, mean = b["seq_mult_prob_error_min"], b["seq_mult_prob_error_mean"]
        assert 1.0 <= low <= mean <= b["seq_mult_prob_error_max"]
    assert all(m["seq_mult_prob_error_max"] < 1.0001 for m in measured[:2])
    stale = measured[2]
    assert stale["token_staleness_min"] > 0 and stale["seq_mult_prob_error_max"] > 1.01
    threshold = (stale["seq_mult_prob_error_mean"] + stale["seq_mult_prob_error_max"]) / 2
    masked = runs("seq-mask", "--seed", "6", "--rl-seq-logprob-error-threshold", repr(threshold))
    for a, b in zip(measured[:2], masked[:2]):  # nothing above the threshold yet
        assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}
        assert b["seq_logprob_error_masked_sequences"] == 0
    m = masked[2]
    for key in ("seq_mult_prob_error_min", "seq_mult_prob_error_mean", "seq_mult_prob_error_max"):
        assert m[key] == stale[key]  # the same weights and rollouts up to here
    assert m["seq_logprob_error_masked_sequences"] >= 1
    assert m["seq_mult_prob_error_after_mask_max"] <= threshold < m["seq_mult_prob_error_max"]
    assert 0.0 <= m["seq_logprob_error_masked_rewarded_fraction"] <= 1.0
    assert m["reward_mean"] == stale["reward_mean"] and m["loss"] != stale["loss"]
    assert all(r["staleness_min"] == r["staleness_max"] == min(r["step"], 2) for r in masked)
