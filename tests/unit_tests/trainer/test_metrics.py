"""Per-step metrics: what the record says about the trained batch."""

from __future__ import annotations

from grpo_testing.rollouts import synthetic_groups

from megatron.rl.agent.api import placeholder_rollout
from megatron.rl.rollout.generator import RolloutBatch
from megatron.rl.wire import GroupedRolloutRequest
from megatron.trainer.metrics import rollout_metrics


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
