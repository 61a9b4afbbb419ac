"""The in-process data plane: the owner (global rank 0) holds the ``SampleStore`` and serves it.

Every transfer is point-to-point over the world group (``frames.py``), between the owner and one
other rank:

* ``fetch``: each other rank sends its request (partition, keys, fields) and receives exactly
  those values; the owner serves the ranks in rank order, then reads its own from memory. The
  tensor-parallel peers of a replica name the same keys and so receive the same shard.
* ``write``: each other rank sends its keys and fields (possibly none) and waits for the owner's
  acknowledgement; the owner stores them in rank order, then its own.

A request the owner cannot serve (an unknown key or field, a field written twice) is answered with
the error, which the asking rank raises; the owner raises it after serving every rank, so every
rank stops instead of waiting for a message that never comes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from megatron.rl.dataplane.base import DataPlane
from megatron.rl.dataplane.frames import pack, recv_frame, send_frame, unpack
from megatron.rl.dataplane.store import BatchMeta, Fields, SampleStore

EMPTY = torch.zeros(0, dtype=torch.uint8)


class DataPlaneError(RuntimeError):
    """The owner could not serve a rank's request (raised on that rank and on the owner)."""


class KeyedDataPlane(DataPlane):
    """The owner's ``SampleStore``, fetched from and written to by key over point-to-point.

    The owner's own ``fetch`` returns the stored tensors themselves: read them, do not modify.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, owner: int = 0) -> None:
        super().__init__(rank, world_size, device, owner)
        self.store = SampleStore() if self.is_owner else None

    def put(
        self,
        partition: str,
        step: int,
        keys: Sequence[str],
        fields: Fields,
        tags: Mapping[str, Sequence[int]] | None = None,
        attrs: Mapping[str, int] | None = None,
    ) -> None:
        """Write new samples into the owner's store (owner only; no communication)."""
        with self.stats.timed():
            self._owned_store().put(partition, step, keys, fields, tags, attrs)

    def update(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        """Add fields to samples of the owner's store (owner only; no communication)."""
        with self.stats.timed():
            self._owned_store().update(partition, keys, fields)

    def meta(self, partition: str) -> BatchMeta:
        """What ``partition`` holds in the owner's store (owner only)."""
        return self._owned_store().meta(partition)

    def fetch(
        self, partition: str, keys: Sequence[str], fields: Sequence[str]
    ) -> dict[str, list[torch.Tensor]]:
        """``fields`` of ``keys`` from the owner's store (collective)."""
        request = {"partition": partition, "keys": list(keys), "fields": list(fields)}
        with self.stats.timed():
            if not self.is_owner:
                self._send(request, EMPTY)
                answer, payload = self._recv()
                if answer.get("error"):
                    raise DataPlaneError(answer["error"])
                return unpack(answer, payload)
            errors = []
            for rank in self._others():
                asked, _ = self._recv(rank)
                try:
                    values = self.store.get(asked["partition"], asked["keys"], asked["fields"])
                    header, payload = pack(values)
                except (KeyError, ValueError) as exc:
                    errors.append(f"rank {rank}: {exc}")
                    header, payload = {"error": errors[-1]}, EMPTY
                self._send(header, payload, rank)
            self._raise(errors)
            return self.store.get(partition, keys, fields)

    def write(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        """Add each rank's ``fields`` to its ``keys`` in the owner's store (collective)."""
        with self.stats.timed():
            if not self.is_owner:
                header, payload = pack(fields)
                self._send({"partition": partition, "keys": list(keys), **header}, payload)
                answer, _ = self._recv()
                if answer.get("error"):
                    raise DataPlaneError(answer["error"])
                return
            errors = []
            for rank in self._others():
                header, payload = self._recv(rank)
                error = None
                try:
                    values = {
                        k: [v.clone() for v in vs] for k, vs in unpack(header, payload).items()
                    }
                    if header["keys"]:
                        self.store.update(header["partition"], header["keys"], values)
                except (KeyError, ValueError) as exc:
                    error = f"rank {rank}: {exc}"
                    errors.append(error)
                self._send({"error": error}, EMPTY, rank)
            self._raise(errors)
            if keys:
                owned = {k: [v.detach().cpu().clone() for v in vs] for k, vs in fields.items()}
                self.store.update(partition, keys, owned)

    def clear(self, partition: str) -> None:
        """Drop ``partition`` from the owner's store (every rank's writes are acknowledged)."""
        with self.stats.timed():
            if self.is_owner:
                self.store.clear(partition)

    def _owned_store(self) -> SampleStore:
        if self.store is None:
            raise RuntimeError(f"rank {self.rank} does not hold the store (rank {self.owner} does)")
        return self.store

    def _others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.owner]

    def _send(self, header: dict, payload: torch.Tensor, dst: int | None = None) -> None:
        send_frame(header, payload, self.owner if dst is None else dst, self.device)
        self.stats.messages += 1

    def _recv(self, src: int | None = None) -> tuple[dict, torch.Tensor]:
        header, payload, received = recv_frame(self.owner if src is None else src, self.device)
        self.stats.bytes_moved += received
        self.stats.messages += 1
        return header, payload

    @staticmethod
    def _raise(errors: list[str]) -> None:
        if errors:
            raise DataPlaneError("; ".join(errors))
