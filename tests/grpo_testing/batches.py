"""The padded training rows of rollout groups in one call, for tests and tools: GRPO's
advantages, then one row per rollout (the trainer publishes the rows to its data plane and reads
them back instead: ``megatron/rl/dataplane/batches.py``)."""

from __future__ import annotations

from megatron.rl.grpo.advantages.compute import AdvantageConfig
from megatron.rl.grpo.batch import (
    SAMPLE_FIELDS,
    TrainBatch,
    batch_advantages,
    padded_width,
    rollout_sample,
    rows_from_samples,
)
from megatron.rl.wire import RolloutGroup

GRPO = AdvantageConfig("grpo", "group")
"""The default run's advantages: the group mean over the group's reward std."""


def build_train_batch(
    groups: list[RolloutGroup], pad_id: int, config: AdvantageConfig = GRPO
) -> TrainBatch:
    """Advantages per group (``config``), then one padded row per rollout in (group, rollout)
    order.

    Placeholder rollouts (environment errors) stay as rows so that batch shapes and data-parallel
    shards do not depend on failures, but they carry no loss and do not enter group statistics.
    """
    advantages = batch_advantages(groups, config)
    samples = [rollout_sample(r) for g in groups for r in g.rollouts]
    fields = {name: [s[name] for s in samples] for name in SAMPLE_FIELDS}
    fields["advantages"] = list(advantages.unbind())
    return rows_from_samples(fields, pad_id, padded_width(groups))
