"""Admission of outside requests to the engine: queue, served fairly across clients, then refuse.

An outside request (no rollout key) runs once ``FairQueue.admit`` grants it. It is granted at
once while the engine has free slots for it (``slots``: the slots outside requests may take; a
request of ``n`` samples takes ``n``) and its client has fewer than ``per_client`` requests
running; otherwise it waits in its client's queue. Whenever a running request ends, the waiting
ones are granted in round-robin order over the client addresses with requests waiting (one
request per client per turn; a client at its ``per_client`` limit is passed over), so a client
that sends hundreds of requests at once cannot delay another client's request by more than one
turn. The next request in turn that does not fit the free slots waits for them and nobody
overtakes it, so a large request is not starved by small ones (one larger than ``slots`` runs
when nothing else does).

Past the queue's bound (``max_queued`` waiting in all, ``max_queued_per_client`` of one client)
a request is refused with 429 and a ``Retry-After`` header: the seconds the queue ahead is
expected to take, from the mean time of the requests served so far (at least 1).

Keyed rollout requests never come here: they go straight to the engine, which admits them before
any outside request (``megatron.rl.inference.slots``), so outside traffic never delays them.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import HTTPException


@dataclass
class _Waiter:
    client: str
    weight: int
    granted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class FairQueue:
    """Grants outside requests their turn on the engine, round robin across client addresses.

    Consumes ``admit(client, weight)`` calls, one per outside request. Produces grants: the
    ``release`` function ``admit`` returns, held while the request runs. A waiting ``admit``
    waits for a grant, which a ``release`` (the request ended, failed, or its client left) gives
    it when its turn comes. The queue owns no task: each waiting request's handler awaits its own
    future, and cancelling that handler (its client disconnected) takes it out of the queue at
    once, with nothing taken from the engine.
    """

    def __init__(
        self,
        slots: int | None,
        per_client: int,
        max_queued: int,
        max_queued_per_client: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``slots``: engine slots outside requests may take at once (None: no bound, only
        ``per_client``); ``per_client``: requests of one client running at once;
        ``max_queued`` and ``max_queued_per_client``: requests waiting, in all and per client,
        before the next is refused (429)."""
        if slots is not None and slots < 1:
            raise ValueError(f"slots must be None or >= 1, got {slots}")
        self.slots = slots
        self.per_client = per_client
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client
        self._clock = clock
        self._running: collections.Counter[str] = collections.Counter()
        self._used = 0  # engine slots taken by the running requests
        self._waiting: dict[str, collections.deque[_Waiter]] = {}
        self._turns: collections.deque[str] = collections.deque()  # clients waiting, in turn
        self._queued = 0
        self._served = 0  # requests ended so far, and their total seconds (``retry_after``)
        self._served_seconds = 0.0

    @property
    def queued(self) -> int:
        """Requests waiting for their turn."""
        return self._queued

    @property
    def running(self) -> int:
        """Requests granted and not yet released."""
        return sum(self._running.values())

    def queued_of(self, client: str) -> int:
        """Requests of ``client`` waiting for their turn."""
        return len(self._waiting.get(client, ()))

    async def admit(self, client: str, weight: int = 1) -> Callable[[], None]:
        """Wait for ``client``'s request (taking ``weight`` engine slots) to be granted its turn;
        the returned function releases it (call it once the request ended; later calls do
        nothing). 429 (``HTTPException`` with ``Retry-After``) when the queue is full."""
        waiter = _Waiter(client, max(1, weight))
        self._enqueue(waiter)
        self._dispatch()
        if not waiter.granted.done():
            refusal = self._refusal(client)
            if refusal is not None:
                self._withdraw(waiter)
                raise refusal
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release(waiter)  # granted as the client left
            else:
                self._withdraw(waiter)
                self._dispatch()
            raise
        return self._releaser(waiter)

    def retry_after(self, ahead: int | None = None) -> int:
        """Seconds until a request could be taken with ``ahead`` requests queued before it
        (default: every queued one): the rounds they and it take (``slots``, else every running
        request, per round) times the mean time of a request served so far; at least 1."""
        if not self._served:
            return 1
        mean = self._served_seconds / self._served
        per_round = self.slots or max(1, self.running)
        rounds = math.ceil(((self._queued if ahead is None else ahead) + 1) / per_round)
        return max(1, math.ceil(mean * rounds))

    # ----------------------------------------------------------------- internals

    def _refusal(self, client: str) -> HTTPException | None:
        """429 for a request that would make the queue too long (it is counted already)."""
        if self._queued > self.max_queued:
            reason = (
                f"the server's queue holds {self.max_queued} requests, the most it holds "
                "(--rl-max-queued-requests)"
            )
        elif self.queued_of(client) > self.max_queued_per_client:
            reason = (
                f"{client} has {self.max_queued_per_client} requests queued, the most this "
                "server queues for one client (half of --rl-max-queued-requests)"
            )
        else:
            return None
        seconds = self.retry_after(self._queued - 1)
        return HTTPException(
            429, f"{reason}: retry after {seconds} s", headers={"Retry-After": str(seconds)}
        )

    def _enqueue(self, waiter: _Waiter) -> None:
        queue = self._waiting.get(waiter.client)
        if queue is None:
            queue = self._waiting[waiter.client] = collections.deque()
            self._turns.append(waiter.client)
        queue.append(waiter)
        self._queued += 1

    def _withdraw(self, waiter: _Waiter) -> None:
        """Take a waiting request out of the queue."""
        queue = self._waiting[waiter.client]
        queue.remove(waiter)
        self._queued -= 1
        if not queue:
            del self._waiting[waiter.client]
            self._turns.remove(waiter.client)

    def _fits(self, weight: int) -> bool:
        if self.slots is None or self._used == 0:
            return True
        return self._used + weight <= self.slots

    def _dispatch(self) -> None:
        """Grant waiting requests in turn while they fit."""
        passed = 0  # clients in a row passed over at their per-client limit
        while self._turns and passed < len(self._turns):
            client = self._turns[0]
            if self._running[client] >= self.per_client:
                self._turns.rotate(-1)
                passed += 1
                continue
            queue = self._waiting[client]
            if not self._fits(queue[0].weight):
                return  # the request in turn waits for free slots; nobody overtakes it
            waiter = queue.popleft()
            self._queued -= 1
            self._turns.popleft()
            if queue:
                self._turns.append(client)  # its next request: after every other client's
            else:
                del self._waiting[client]
            self._running[client] += 1
            self._used += waiter.weight
            waiter.granted.set_result(None)
            passed = 0

    def _releaser(self, waiter: _Waiter) -> Callable[[], None]:
        start = self._clock()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self._served += 1
                self._served_seconds += self._clock() - start
                self._release(waiter)

        return release

    def _release(self, waiter: _Waiter) -> None:
        self._running[waiter.client] -= 1
        if not self._running[waiter.client]:
            del self._running[waiter.client]
        self._used -= waiter.weight
        self._dispatch()
