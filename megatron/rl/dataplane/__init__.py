"""The keyed rollout data plane: samples written once under their keys, fetched by key per rank.

``store.SampleStore`` holds samples in one process; ``keyed.KeyedDataPlane`` (backend
``in-process``) serves rank 0's store to the other ranks point to point;
``transferqueue.TransferQueueDataPlane`` (backend ``transferqueue``) keeps them in the
TransferQueue package's storage units on Ray. ``batches`` maps rollout groups to samples and
training rows back.
"""

from __future__ import annotations

import torch

from megatron.rl.dataplane.base import DataPlane, TransferStats
from megatron.rl.dataplane.keyed import DataPlaneError, KeyedDataPlane

BACKENDS = ("in-process", "transferqueue")
"""The data-plane backends, by name."""

__all__ = [
    "BACKENDS",
    "DataPlane",
    "DataPlaneError",
    "KeyedDataPlane",
    "TransferStats",
    "make_data_plane",
]


def make_data_plane(
    backend: str, rank: int, world_size: int, device: torch.device, owner: int = 0
) -> DataPlane:
    """The data plane of ``backend`` on this rank (collective for ``transferqueue``)."""
    if backend == "in-process":
        return KeyedDataPlane(rank, world_size, device, owner)
    if backend == "transferqueue":
        from megatron.rl.dataplane.transferqueue import TransferQueueDataPlane

        return TransferQueueDataPlane(rank, world_size, device, owner)
    raise ValueError(f"unknown data-plane backend {backend!r} (choose from {list(BACKENDS)})")
