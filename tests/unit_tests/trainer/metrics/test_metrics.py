"""Per-step metrics: what the record says about the trained batch."""

from __future__ import annotations

import pytest
from grpo_testing.rollouts import synthetic_groups

from megatron.rl.agent.api import placeholder_rollout
from megatron.rl.inference.protocol import EngineCounters
from megatron.rl.rollout.generator import RolloutBatch
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup, TokenRollout
from megatron.trainer.generation.rollouts import CollectedBatch
from megatron.trainer.metrics.log_line import format_log_line
from megatron.trainer.metrics.record import (
    ConstantRewardWarning,
    engine_metrics,
    megatron_lm_staleness,
    rollout_metrics,
    zero_variance_metrics,
)


def batch(batch_id: int, failed_groups: set[int] = frozenset()) -> RolloutBatch:
    groups = synthetic_groups(4, 3, vocab=20)
    for index in failed_groups:
        request = GroupedRolloutRequest(
            batch_id=batch_id,
            index_in_batch=index,
            groups_in_batch=4,
            group_size=3,
            seed=0,
            submission_policy_version=0,
        )
        failed = placeholder_rollout("synthetic", request, RuntimeError("env down"))
        groups[index] = groups[index].model_copy(
            update={"rollouts": [failed] + groups[index].rollouts[1:]}
        )
    return RolloutBatch(batch_id, groups, in_flight=1, queue_depth=0)


def test_the_record_names_the_trained_batch_and_whether_its_groups_were_complete():
    whole = rollout_metrics(batch(7), step=7)
    assert (whole["batch_id"], whole["complete_groups"], whole["batch_complete"]) == (7, 4, True)
    torn = rollout_metrics(batch(9, failed_groups={1, 3}), step=9)
    assert (torn["batch_id"], torn["complete_groups"], torn["batch_complete"]) == (9, 2, False)
    assert torn["placeholder_rollouts"] == 2


def test_engine_metrics_of_a_window_are_the_counters_difference_and_the_idle_rest():
    """A 2 s window in which the engine went from (tokens 5, steps 3, rows 6, 0.5 s) to
    (15, 7, 20, 2.0 s): 10 tokens in 4 steps of 3.5 rows, 1.5 s stepping, 0.5 s idle."""
    before = EngineCounters(generated_tokens=5, steps=3, rows=6, step_seconds=0.5)
    after = EngineCounters(generated_tokens=15, steps=7, rows=20, step_seconds=2.0)
    metrics = engine_metrics(CollectedBatch(batch(0), 2.0, after - before))
    assert metrics == {
        "generated_tokens": 10,
        "generated_tokens_per_s": 5.0,
        "engine_steps": 4,
        "engine_rows_per_step": 3.5,
        "engine_seconds": 1.5,
        "engine_idle_seconds": 0.5,
    }


def rollout(env: str, reward: float | None) -> TokenRollout:
    """A one-token rollout of ``env`` with ``reward``; None: a placeholder (reward 0, error)."""
    return TokenRollout(
        env_id=env,
        problem_id="p",
        prompt="",
        completion="",
        reward=reward or 0.0,
        error="env down" if reward is None else None,
        tokens=[3, 4],
        generation_mask=[False, True],
        logprobs=[-1.0],
        policy_versions=[0],
        submission_policy_version=0,
        temperature=1.0,
    )


def groups(*rewards: list[float | None], env: str = "a", first: int = 0) -> list[RolloutGroup]:
    """One group per list of rewards, all of environment ``env``."""
    return [
        RolloutGroup(batch_id=0, index_in_batch=first + i, rollouts=[rollout(env, r) for r in g])
        for i, g in enumerate(rewards)
    ]


@pytest.mark.parametrize(
    "batch_groups, expected",
    [
        pytest.param(
            groups([1, 1, 1], [0, 0, 0]),
            {"zero_variance_group_fraction": 1.0, "zero_variance_group_fraction/a": 1.0},
            id="all-equal",
        ),
        pytest.param(
            groups([1, 0, 1], [0, 0, 0], [0.5, 0.5, 1], [1, 1, 1]),
            {"zero_variance_group_fraction": 0.5, "zero_variance_group_fraction/a": 0.5},
            id="mixed",
        ),
        pytest.param(
            groups([1, 0, 0.5], [0.2, 0.3, 0.2]),
            {"zero_variance_group_fraction": 0.0, "zero_variance_group_fraction/a": 0.0},
            id="none-equal",
        ),
        pytest.param(
            groups([1, None, 1], [1, None, 0], [0, 0, None]),
            {"zero_variance_group_fraction": 2 / 3, "zero_variance_group_fraction/a": 2 / 3},
            id="placeholders-ignored",
        ),
        pytest.param(
            groups([None, None, 1], [None, None, None], [0, 1, None]),
            {"zero_variance_group_fraction": 2 / 3, "zero_variance_group_fraction/a": 2 / 3},
            id="fewer-than-two-real-rollouts-count",
        ),
        pytest.param(
            groups([1, 0], [1, 1], env="copy") + groups([0, 0], env="sort", first=2),
            {
                "zero_variance_group_fraction": 2 / 3,
                "zero_variance_group_fraction/copy": 0.5,
                "zero_variance_group_fraction/sort": 1.0,
            },
            id="per-env",
        ),
    ],
)
def test_zero_variance_group_fraction(batch_groups, expected):
    assert zero_variance_metrics(batch_groups) == pytest.approx(expected)
    record = rollout_metrics(RolloutBatch(0, batch_groups, in_flight=1, queue_depth=0), step=0)
    assert {k: v for k, v in record.items() if k.startswith("zero_variance")} == expected


def test_the_log_line_shows_the_zero_variance_share():
    record = rollout_metrics(RolloutBatch(0, groups([1, 1], [1, 0]), 1, 0), step=0)
    m = {
        **record,
        "step": 0,
        "loss": 0.0,
        "grad_norm": 0.0,
        "lr": 1e-3,
        "lag": 2,
        "generated_tokens_per_s": 1.0,
        "trained_tokens_per_s": 1.0,
        "step_seconds": 0.1,
    }
    assert "| reward 0.750 ± 0.433 | zero-var groups 0.50 | grad-norm" in format_log_line(m, 10)


def warnings_of(*batches: list[RolloutGroup], first_batches: int = 4) -> list[str]:
    """Every line a ``ConstantRewardWarning`` gives over ``batches`` (batch ids 0, 1, ...)."""
    warn = ConstantRewardWarning(first_batches)
    return [
        line
        for batch_id, batch_groups in enumerate(batches)
        for line in warn.check(RolloutBatch(batch_id, batch_groups, in_flight=1, queue_depth=0))
    ]


def test_equal_rewards_warn_once_naming_environment_batch_and_value():
    lines = warnings_of(groups([0, 0], [0, 0]), groups([0, 0], [0, 0]), groups([1, 1], [1, 1]))
    assert lines == [
        "warning: environment 'a': no group of batch 0 has differing rewards (2 groups, all 0): "
        "its advantages, policy-gradient loss and gradient are 0 for this batch: the task may "
        "be too hard or too easy for the model; see zero_variance_group_fraction/a"
    ]


@pytest.mark.parametrize(
    "batches, warned",
    [
        pytest.param([groups([0, 1], [0, 0])] * 4, [], id="a-group-differs"),
        pytest.param(
            [groups([0, 1]), groups([0, 0], [1, 1])],
            [("batch 1", "(2 groups, each all 0 or 1)")],
            id="later-batch-several-values",
        ),
        pytest.param([groups([0, 1])] * 4 + [groups([0, 0])], [], id="after-the-first-4"),
        pytest.param(
            [groups([0, 1], env="copy") + groups([1, 1], env="sort", first=1)],
            [("'sort'", "batch 0")],
            id="only-the-constant-env",
        ),
        pytest.param([groups([None, None], [0, 1])], [], id="failed-group-beside-a-varied-one"),
        pytest.param([groups([None, None])], [], id="only-placeholders-left-to-failures"),
        pytest.param(
            [groups([1, None], [1, 1])],
            [("batch 0", "(2 groups, all 1)")],
            id="placeholder-ignored",
        ),
    ],
)
def test_the_warning_only_for_a_batch_without_differing_rewards(batches, warned):
    lines = warnings_of(*batches)
    assert len(lines) == len(warned), lines
    for line, parts in zip(lines, warned):
        assert all(part in line for part in parts), line


def test_each_reward_function_is_logged_by_environment_and_name():
    """``reward/<env_id>/<name>``: the mean value of each function over the rollouts it scored
    (placeholders and rollouts it returned None for are left out)."""

    def scored(env: str, components: dict[str, float] | None, error: str | None = None):
        return rollout(env, None if error else 0.0).model_copy(
            update={"reward_components": components}
        )

    groups = [
        RolloutGroup(
            batch_id=0,
            index_in_batch=0,
            rollouts=[
                scored("a", {"rm": 0.2, "format": 1.0}),
                scored("a", {"rm": 0.6}),
                scored("a", None, error="judge down"),
            ],
        ),
        RolloutGroup(
            batch_id=0,
            index_in_batch=1,
            rollouts=[
                scored("b", {"rm": -1.0}),
                scored("c", None),
            ],
        ),
    ]
    record = rollout_metrics(RolloutBatch(0, groups, in_flight=1, queue_depth=0), step=0)
    assert {k: v for k, v in record.items() if k.startswith("reward/")} == pytest.approx(
        {"reward/a/format": 1.0, "reward/a/rm": 0.4, "reward/b/rm": -1.0}
    )


def test_episode_metrics_are_logged_as_means_over_the_rollouts_that_carry_them():
    def episode(metrics: dict[str, float] | None, error: str | None = None):
        return rollout("a", None if error else 0.0).model_copy(
            update={"episode_metrics": metrics, "error": error}
        )

    groups = [
        RolloutGroup(
            batch_id=0,
            index_in_batch=0,
            rollouts=[
                episode({"turns": 3.0, "tool_errors": 1.0}),
                episode({"turns": 2.0, "tool_errors": 0.0}),
                episode(None),
                episode({"turns": 9.0}, error="env down"),
            ],
        ),
    ]
    record = rollout_metrics(RolloutBatch(0, groups, in_flight=1, queue_depth=0), step=0)
    assert {k: v for k, v in record.items() if k.startswith("episode/")} == {
        "episode/tool_errors_mean": 0.5,
        "episode/turns_mean": 2.5,
    }


def test_a_rollout_without_episode_metrics_is_the_same_json_as_before_the_field():
    plain = rollout("a", 0.0)
    assert "episode_metrics" not in plain.model_dump_json()
    tagged = plain.model_copy(update={"episode_metrics": {"turns": 2.0}})
    assert TokenRollout.model_validate_json(tagged.model_dump_json()) == tagged


def test_megatron_lm_staleness_metrics_by_hand():
    """At step 3: a rollout sampled at versions 1, 2, 2 (its prompt's cache filled at 1) and one
    sampled at 3. Policy staleness per token 2, 1, 1, 0; KV-cache staleness 2, 2, 2, 0; last
    tokens: policy 1, 0 and KV cache 2, 0."""
    spanning, fresh = rollout("a", 1.0), rollout("a", 0.0)
    spanning = spanning.model_copy(
        update=dict(
            tokens=[3, 4, 5, 6],
            generation_mask=[False, True, True, True],
            logprobs=[-1.0] * 3,
            policy_versions=[1, 2, 2],
        )
    )
    fresh = fresh.model_copy(update=dict(policy_versions=[3]))
    m = megatron_lm_staleness([spanning, fresh], step=3)
    assert (m["min_policy_staleness"], m["mean_policy_staleness"]) == (0, 1.0)
    assert m["max_policy_staleness"] == 2
    assert (m["min_kv_cache_staleness"], m["mean_kv_cache_staleness"]) == (0, 1.5)
    assert m["max_kv_cache_staleness"] == 2
    assert (m["mean_last_token_policy_staleness"], m["max_last_token_policy_staleness"]) == (0.5, 1)
    assert (m["mean_last_token_kv_cache_staleness"], m["max_last_token_kv_cache_staleness"]) == (
        1.0,
        2,
    )
