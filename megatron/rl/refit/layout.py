"""``InferenceLayout``: where this rank sits among the inference replicas of a collocated refit,
and the process groups its inference copy is built with.

A copy is one whole pipeline stage (its pipeline group is each rank alone) and has no expert
parallelism: each replica holds every expert, split over its tensor-parallel ranks as the dense
weights are (megatron-core's default expert TP, the TP degree). Its MoE layers exchange tokens
within the replica only, so replicas never wait for each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class InferenceLayout:
    """This rank's place in the inference layout: ``dp_size`` replicas of ``tp_size`` consecutive
    ranks each (one pipeline stage)."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    """The inference replica this rank belongs to."""
    dp_size: int
    """Inference replicas: world size / ``tp_size``."""
    tp_group: dist.ProcessGroup | None
    """The replica's ranks (None: a world of one)."""
    pg_collection: ProcessGroupCollection | None
    """megatron-core's groups with ``tp`` (and ``mp``, ``tp_cp``, the experts' ``expt_tp`` and
    ``tp_ep``) replaced by ``tp_group``, ``ep`` and ``pp`` by this rank alone, no embedding group
    (None: a world of one)."""

    @property
    def is_replica_leader(self) -> bool:
        """TP rank 0 of its replica: reports the replica's sampled tokens."""
        return self.tp_rank == 0


def inference_layout(tp_size: int, alone: bool = False) -> InferenceLayout:
    """The inference layout of ``tp_size`` ranks per replica (collective: every rank creates every
    replica's group, in order; megatron-core's parallel state must be initialized); ``alone``:
    the copy's expert-parallel and pipeline groups are each rank alone (an MoE model, or training
    with pipeline stages; else they stay the parallel state's, of size 1 then)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp_size < 1 or world % tp_size != 0:
        raise ValueError(f"the world size {world} is not divisible by {tp_size} inference ranks")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world == 1:
        return InferenceLayout(0, 1, 0, 1, None, None)
    groups = [dist.new_group(list(range(s, s + tp_size))) for s in range(0, world, tp_size)]
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    tp_group = groups[rank // tp_size]
    pg_collection.tp = pg_collection.tp_cp = pg_collection.expt_tp = pg_collection.tp_ep = tp_group
    pg_collection.mp = tp_group
    if alone:
        singles = groups if tp_size == 1 else [dist.new_group([r]) for r in range(world)]
        pg_collection.ep = pg_collection.pp = singles[rank]
        pg_collection.embd = pg_collection.pos_embd = None
    return InferenceLayout(
        rank % tp_size,
        tp_size,
        rank // tp_size,
        world // tp_size,
        tp_group,
        pg_collection,
    )
