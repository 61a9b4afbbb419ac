"""Ordered reassembly of finished rollout groups: point 2 of the generator's contract.

Group workers finish in any order (later groups and later batches often first). The
``OrderedReassembly`` buffer consumes each finished ``RolloutGroup`` as its worker ``put``s it,
and produces, for the one consumer (``GroupedRolloutGenerator.next_batch``), the groups of one
``batch_id`` in ``index_in_batch`` order (``pop``: the whole batch, or the ``indices`` of one
generation round). A ``pop`` waits until every group it asks for is in: the ``put`` that delivers
the last missing one unblocks it. A failure unblocks it too: ``fail`` (a worker raised, or the
generator was closed) makes the waiting ``pop`` and every later one raise that error instead of
waiting for a group that will never come. Groups of later batches stay buffered (``depth``,
``buffered``) until their own ``pop``; a drained generator's checkpoint saves them.
"""

from __future__ import annotations

import asyncio

from megatron.rl.wire import RolloutGroup


class OrderedReassembly:
    """Collects finished groups in any order and hands out whole batches in ``batch_id`` order.

    ``put`` is called by group workers; ``pop(batch_id)`` by the consumer, which waits until all
    groups of that batch are in. ``fail`` makes current and later ``pop`` calls raise.
    """

    def __init__(self, groups_per_batch: int) -> None:
        self.groups_per_batch = groups_per_batch
        self._groups: dict[int, dict[int, RolloutGroup]] = {}
        self._waiters: dict[int, tuple[asyncio.Future, range]] = {}
        self._error: BaseException | None = None

    @property
    def depth(self) -> int:
        """Finished groups buffered, over all batches."""
        return sum(len(g) for g in self._groups.values())

    def put(self, group: RolloutGroup) -> None:
        """Add a finished group; wakes the consumer when the groups it waits for are in."""
        if not 0 <= group.index_in_batch < self.groups_per_batch:
            raise ValueError(f"group index {group.index_in_batch} outside its batch")
        batch = self._groups.setdefault(group.batch_id, {})
        if group.index_in_batch in batch:
            raise ValueError(f"group {group.batch_id}/{group.index_in_batch} delivered twice")
        batch[group.index_in_batch] = group
        waiter, wanted = self._waiters.get(group.batch_id, (None, ()))
        if waiter is not None and not waiter.done() and all(i in batch for i in wanted):
            waiter.set_result(None)

    async def pop(self, batch_id: int, indices: range | None = None) -> list[RolloutGroup]:
        """The groups ``indices`` (default: all) of ``batch_id`` in ``index_in_batch`` order,
        once they are all in."""
        wanted = range(self.groups_per_batch) if indices is None else indices
        if self._error is None and not all(i in self._groups.get(batch_id, ()) for i in wanted):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[batch_id] = (waiter, wanted)
            try:
                await waiter
            finally:
                self._waiters.pop(batch_id, None)
        if self._error is not None:
            raise self._error
        batch = self._groups[batch_id]
        groups = [batch.pop(i) for i in wanted]
        if not batch:
            del self._groups[batch_id]
        return groups

    def buffered(self) -> list[RolloutGroup]:
        """Every buffered group, ordered by (batch_id, index_in_batch)."""
        return [g for b in sorted(self._groups) for _, g in sorted(self._groups[b].items())]

    def raise_if_failed(self) -> None:
        """Raise the error passed to ``fail``, if any."""
        if self._error is not None:
            raise self._error

    def fail(self, error: BaseException) -> None:
        """Make every current and future ``pop`` raise ``error`` (first failure wins)."""
        if self._error is None:
            self._error = error
        for waiter, _ in self._waiters.values():
            if not waiter.done():
                waiter.set_result(None)
