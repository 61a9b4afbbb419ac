"""The data-plane interface both backends implement, and what it counts.

Every method is called on every rank of the job at the same point (collective), except ``put``
and ``update``, which only the owner (global rank 0, the producer of samples) calls:

* ``put``/``update`` (owner): write new samples under their keys / add fields to them;
* ``share`` (collective): the owner's ``BatchMeta`` on every rank;
* ``fetch`` (collective): each rank reads the fields of the keys it names, and only those;
* ``write`` (collective): each rank adds fields to the keys it names (possibly none);
* ``clear`` (collective): drop a partition once its step is finished.

``TransferStats`` counts the bytes each rank received from another process (and, for a remote
store, the bytes it sent there) and the seconds spent in the plane's calls.
"""

from __future__ import annotations

import pickle
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.rl.dataplane.store import BatchMeta, Fields


@dataclass
class TransferStats:
    """Counters of one rank (monotonic; take differences per step)."""

    bytes_moved: int = 0
    """Bytes this rank received from another process, plus those it sent to a remote store."""
    seconds: float = 0.0
    """Wall time spent inside the plane's calls."""
    messages: int = 0
    """Point-to-point messages or remote calls this rank made or served."""

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Add the block's wall time to ``seconds``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start


class DataPlane(ABC):
    """Samples under keys, written once by the owner and fetched by key on every rank."""

    def __init__(self, rank: int, world_size: int, device: torch.device, owner: int = 0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        """Where messages travel (a CUDA device when the world group is NCCL)."""
        self.owner = owner
        self.stats = TransferStats()

    @property
    def is_owner(self) -> bool:
        """Whether this rank produces the samples (``put``/``update``)."""
        return self.rank == self.owner

    @abstractmethod
    def put(
        self,
        partition: str,
        step: int,
        keys: Sequence[str],
        fields: Fields,
        tags: Mapping[str, Sequence[int]] | None = None,
        attrs: Mapping[str, int] | None = None,
    ) -> None:
        """Write the new samples ``keys`` of ``step`` (owner only)."""

    @abstractmethod
    def update(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        """Add ``fields`` to existing samples (owner only)."""

    @abstractmethod
    def meta(self, partition: str) -> BatchMeta:
        """What ``partition`` holds (owner only)."""

    @abstractmethod
    def fetch(
        self, partition: str, keys: Sequence[str], fields: Sequence[str]
    ) -> dict[str, list[torch.Tensor]]:
        """``fields`` of ``keys`` on this rank, in that order (collective)."""

    @abstractmethod
    def write(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        """Add this rank's ``fields`` to its ``keys`` (collective; ``keys`` may be empty)."""

    @abstractmethod
    def clear(self, partition: str) -> None:
        """Drop ``partition`` (collective, after every rank's writes to it)."""

    def close(self) -> None:
        """Release the backend (every rank; idempotent)."""

    def share(self, meta: BatchMeta | None) -> BatchMeta:
        """The owner's ``meta`` on every rank (collective; others pass None)."""
        if self.world_size == 1:
            return meta
        with self.stats.timed():
            message = [meta if self.is_owner else None]
            dist.broadcast_object_list(message, src=self.owner, device=self._object_device())
            if not self.is_owner:  # a size per object, then the pickle
                self.stats.bytes_moved += 8 + len(pickle.dumps(message[0]))
            self.stats.messages += 1
        return message[0]

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
