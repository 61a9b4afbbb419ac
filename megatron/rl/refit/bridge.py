"""``Bridge``: the one channel between the training ranks and the inference ranks of a
non-collocated run (``--refit-mode non-collocated``).

It is a gloo process group of its own over training rank 0 (bridge rank 0) and every inference
rank (bridge ranks 1..N), built beside each side's default process group on the launch's
store. Training rank 0 broadcasts control messages and weights to the inference ranks; inference
rank 0 (bridge rank 1) sends each generated batch back. Objects travel pickled (both ends are
this job's own processes); every operation fails after the group's timeout instead of waiting
for a peer that died.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist


class BridgeBroken(RuntimeError):
    """A bridge operation failed: the peer process ended or stopped answering."""


class Bridge:
    """Training rank 0 and the inference ranks (``size`` members; this process is ``rank``)."""

    TRAINER = 0
    """Bridge rank of training rank 0."""
    INFERENCE_LEADER = 1
    """Bridge rank of inference rank 0 (the one that runs the rollout pipeline)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        peers: str = "the other side",
    ) -> None:
        self.rank, self.size, self.peers = rank, size, peers
        """``peers``: who is on the other side, for messages (``the inference ranks 2..3``)."""
        self.broken = False
        """An operation failed: the other side is gone (nothing more is sent)."""
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), rank, size, timeout)
        self._pending: list[Any] = []
        """Sends not yet known to be complete (``send_object`` does not wait for its peer)."""

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: a closed connection, or the group's timeout
            self.broken = True
            cause = str(exc).split(". This is typically")[0]
            raise BridgeBroken(
                f"{self.peers} ended or stopped answering ({what}): {cause}"
            ) from None

    def broadcast(self, tensor: torch.Tensor, what: str = "a refit") -> torch.Tensor:
        """``tensor`` from training rank 0 to every inference rank (in place; collective)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self.TRAINER
        self._wait(self.group.broadcast([tensor], opts), what)
        return tensor

    def broadcast_object(self, obj: Any = None, what: str = "a control message") -> Any:
        """Training rank 0's ``obj`` on every member (collective)."""
        payload = _encode(obj) if self.rank == self.TRAINER else None
        size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
        self.broadcast(size, what)
        if payload is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        return pickle.loads(self.broadcast(payload, what).numpy().tobytes())

    def send_object(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to bridge rank ``dst`` without waiting for it to be received (a later
        ``send_object`` or ``flush`` waits for the earlier ones)."""
        self.flush()
        payload = _encode(obj)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self._pending = [
            (self.group.send([size], dst, 0), size),
            (self.group.send([payload], dst, 1), payload),
        ]

    def recv_object(self, src: int, what: str = "a batch") -> Any:
        """The next object bridge rank ``src`` sent."""
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(self.group.recv([size], src, 0), f"receiving {what}")
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(self.group.recv([payload], src, 1), f"receiving {what}")
        return pickle.loads(payload.numpy().tobytes())

    def flush(self) -> None:
        """Wait until every earlier ``send_object`` was received."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work, "sending a message")


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
