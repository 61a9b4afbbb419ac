"""``ParallelContext``: where this process sits in the job (ranks, sizes, process groups), the
one type every layer of the trainer passes around; ``runtime/initialize.py`` builds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    device: torch.device
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    ep_rank: int = 0
    """Expert-parallel rank (``--expert-model-parallel-size``: a DP rank holding 1/EP of the
    experts)."""
    ep_size: int = 1
    expert_dp_rank: int = 0
    """Rank among the DP ranks that hold the same experts (``dp_rank`` at EP = 1)."""
    expert_dp_group: dist.ProcessGroup | None = None
    """Where expert gradients are reduced: DP / EP ranks (None: ``dp_group``)."""
    expert_model_group: dist.ProcessGroup | None = None
    """TP x EP ranks that together hold every expert (None: ``tp_group``)."""
    generates_only: bool = False
    """An inference rank of ``--refit-mode non-collocated``: ``rank`` and the groups are of the
    inference ranks' own world, and the process only generates."""
    bridge: Any = None
    """The ``megatron.rl.refit.bridge.Bridge`` to the other side of a non-collocated run, on
    training rank 0 and every inference rank (None elsewhere)."""

    @property
    def is_main(self) -> bool:
        """Rank 0 (of its side, in a non-collocated run): runs the agents and the rollout
        generator (the inference ranks'), or the logging (the training ranks')."""
        return self.rank == 0

    @property
    def is_replica_leader(self) -> bool:
        """TP rank 0 of a data-parallel replica: reports that replica's sampled tokens."""
        return self.tp_rank == 0
