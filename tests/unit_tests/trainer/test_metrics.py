"""Per-step metrics: what the record says about the trained batch."""

from __future__ import annotations

from grpo_testing.rollouts import synthetic_groups

from megatron.rl.agent.api import placeholder_rollout
from megatron.rl.inference.protocol import EngineCounters
from megatron.rl.rollout.generator import RolloutBatch
from megatron.rl.wire import GroupedRolloutRequest
from megatron.trainer.metrics import engine_metrics, rollout_metrics
from megatron.trainer.rollouts import CollectedBatch


def batch(batch_id: int, failed_groups: set[int] = frozenset()) -> RolloutBatch:
    groups = synthetic_groups(4, 3, vocab=20)
    for index in failed_groups:
        request = GroupedRolloutRequest(
            batch_id=batch_id, index_in_batch=index, groups_in_batch=4, group_size=3, seed=0,
            submission_policy_version=0,
        )  # fmt: skip
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
