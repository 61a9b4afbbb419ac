"""Rollout groups as keyed samples of a data plane, and one rank's training rows read back.

The owner (rank 0) writes each rollout of a collection once, under the key ``"<step>/<row>"`` of
partition ``train`` (``publish_groups``): the ``SAMPLE_FIELDS`` of ``rollout_sample``, per-key
tags ``length`` (real input positions), ``loss_tokens`` (generated targets) and ``rewarded``
(1 when the reward is > 0) and, when asked, ``masked`` (1: kept out of the loss), the padded
width of the whole batch as attribute ``width``, then the ``advantages`` as a field written back
to the same keys. A data-parallel rank builds its rows from the keys it names
(``shard_batch``): the padded rows of ``rows_from_samples``, plus the global counts the loss is
normalized by (from the tags, without fetching the other rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron.rl.dataplane.base import DataPlane
from megatron.rl.dataplane.store import BatchMeta
from megatron.rl.grpo.batch import (
    SAMPLE_FIELDS,
    TRAIN_FIELDS,
    GlobalCounts,
    TrainBatch,
    padded_width,
    rollout_sample,
    rows_from_samples,
)
from megatron.rl.wire import RolloutGroup

TRAIN_PARTITION = "train"
"""The partition of the collection being trained on."""
LOGPROBS = "logprobs"
"""Field written back: (n,) float32 log pi_old of each input position (the trainer's policy)."""
REFERENCE_LOGPROBS = "reference_logprobs"
"""Field written back: (n,) float32 log pi_ref of each input position."""


def sample_keys(step: int, count: int) -> list[str]:
    """The keys of a collection's ``count`` rows, in (group, rollout) order."""
    return [f"{step}/{row}" for row in range(count)]


def publish_groups(
    plane: DataPlane,
    groups: list[RolloutGroup],
    step: int,
    partition: str = TRAIN_PARTITION,
    *,
    advantages: torch.Tensor,
    masked: torch.Tensor | None = None,
) -> BatchMeta:
    """Write the rollouts of ``groups`` as the samples of ``step``, then their advantages
    (owner only); what the partition holds.

    ``advantages``: (B,) the rows' advantages (``grpo.batch.shaped_advantages``);
    ``masked``: (B,) bool rows to keep out of the loss (truncated completions), published as
    the tag ``masked`` (absent without it) that ``KeyedCollection`` applies on every rank.
    """
    samples = [rollout_sample(r) for g in groups for r in g.rollouts]
    keys = sample_keys(step, len(samples))
    fields = {name: [s[name] for s in samples] for name in SAMPLE_FIELDS}
    if not any(len(routes) for routes in fields["routed_experts"]):
        del fields["routed_experts"]  # no engine record (dense models): not a field at all
    tags = {
        "length": [max(len(s["tokens"]) - 1, 0) for s in samples],
        "loss_tokens": [int(s["loss_mask"].sum()) for s in samples],
        "rewarded": [int(float(s["reward"]) > 0) for s in samples],
    }
    if masked is not None:
        tags["masked"] = [int(m) for m in masked.tolist()]
    plane.put(partition, step, keys, fields, tags, attrs={"width": padded_width(groups)})
    plane.update(partition, keys, {"advantages": list(advantages.float().unbind())})
    return plane.meta(partition)


def shard_batch(
    plane: DataPlane, meta: BatchMeta, rows: Sequence[int], mine: Sequence[int], pad_id: int
) -> TrainBatch:
    """This rank's rows ``mine`` of the global batch ``rows`` (indices of ``meta.keys``), fetched
    by key, as a shard carrying the global batch's counts (collective: every rank calls it)."""
    names = tuple(name for name in TRAIN_FIELDS if name in meta.fields)  # routes: when recorded
    samples = plane.fetch(meta.partition, [meta.keys[i] for i in mine], names)
    batch = rows_from_samples(samples, pad_id, meta.attrs["width"])
    index = torch.as_tensor(list(rows), dtype=torch.long)
    loss_tokens = meta.tag("loss_tokens")[index]
    counts = GlobalCounts(
        rows=len(rows),
        loss_tokens=int(loss_tokens.sum()),
        trained_tokens=int(meta.tag("length")[index].sum()),
        loss_sequences=int((loss_tokens > 0).sum()),
    )
    return batch.as_shard(counts)
