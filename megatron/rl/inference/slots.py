"""The engine's slots: which requests may take which KV-cache slot of each data-parallel replica.

Per replica, slots ``0 .. max_requests - 1`` are the rollouts' (keyed requests: what
``--inference-max-requests`` counts) and ``max_requests .. max_requests + outside_slots - 1`` are
reserved for unkeyed requests, the ones from outside training (evaluators, judges, people at the
endpoint). A keyed request never takes a reserved slot and, under the deterministic schedule, an
unkeyed one never takes a rollout's: so outside traffic neither waits for the rollouts' slots nor
delays the admission of a rollout, and the training run's schedule does not depend on it.

Without reserved slots, or without the deterministic schedule (``share``), unkeyed requests also
take a rollout slot that no waiting keyed request wants (keyed requests are admitted first).
"""

from __future__ import annotations

import heapq

from megatron.rl.inference.protocol import RowWork
from megatron.rl.inference.requests import Request


class SlotPools:
    """Free slots of every replica, in two pools: the rollouts' and the reserved outside ones."""

    def __init__(self, num_replicas: int, keyed: int, outside: int, share: bool) -> None:
        self.keyed_slots = keyed
        self.share = share or outside == 0
        """Unkeyed requests may take a free rollout slot (after the keyed requests waiting)."""
        self.outside_capacity = num_replicas * (outside + (keyed if self.share else 0))
        """Slots an unkeyed request may take, over every replica: the reserved ones (and the
        rollouts', where shared)."""
        self._keyed = [list(range(keyed)) for _ in range(num_replicas)]
        self._outside = [list(range(keyed, keyed + outside)) for _ in range(num_replicas)]

    def is_outside(self, slot: int) -> bool:
        """Whether ``slot`` is one of the reserved outside slots."""
        return slot >= self.keyed_slots

    def take_keyed(self) -> tuple[int, int] | None:
        """(replica, slot) for a keyed request: the replica with the most free rollout slots (the
        first of those), its lowest free slot; None when every rollout slot is taken."""
        return _take(self._keyed)

    def take_outside(self, reserved_only: bool = False) -> tuple[int, int] | None:
        """(replica, slot) for an unkeyed request: a reserved slot, else (``share``, and not
        ``reserved_only``) a free rollout slot; None when there is none."""
        found = _take(self._outside)
        if found is None and self.share and not reserved_only:
            found = _take(self._keyed)
        return found

    def give_back(self, replica: int, slot: int) -> None:
        """Slot ``slot`` of ``replica`` is free again."""
        pool = self._outside if self.is_outside(slot) else self._keyed
        pool[replica].append(slot)
        pool[replica].sort()

    def claim(self, replica: int, slot: int) -> None:
        """Take this exact slot (a restored request's)."""
        (self._outside if self.is_outside(slot) else self._keyed)[replica].remove(slot)


class Admission:
    """Admission into the slots of a ``ContinuousBatchingScheduler`` (a base of it): its methods
    use the scheduler's ``_waiting`` (keyed, a heap by key), ``_outside`` (unkeyed, by arrival),
    ``_active`` and ``_slots``, on the engine's event loop."""

    def _step_outside_only(self) -> bool:
        """At the barrier: admit unkeyed requests into reserved slots and step those (the keyed
        work waits, untouched); whether a step ran."""
        self._admit_outside(reserved_only=True)
        rows: list[list[RowWork]] = [[] for _ in range(self.steps.num_replicas)]
        for (replica, slot), req in sorted(self._active.items(), key=lambda kv: kv[1].order):
            if req.key is None and self._slots.is_outside(slot):
                rows[replica].append(req.next_row())
        if not any(rows):
            return False
        self._step(rows)
        return True

    def _admit(self) -> None:
        """Keyed requests in key order into rollout slots, then unkeyed ones."""
        while self._waiting:
            if self._waiting[0].future.done():  # cancelled while waiting
                heapq.heappop(self._waiting)
                continue
            place = self._slots.take_keyed()
            if place is None:
                break
            self._place(heapq.heappop(self._waiting), place)
        self._admit_outside(reserved_only=bool(self._waiting))

    def _admit_outside(self, reserved_only: bool) -> None:
        """Unkeyed requests, first come first served, into reserved slots (and, where the pools
        are shared and not ``reserved_only``, free rollout slots)."""
        while self._outside:
            if self._outside[0].future.done():
                self._outside.popleft()
                continue
            place = self._slots.take_outside(reserved_only)
            if place is None:
                return
            self._place(self._outside.popleft(), place)

    def _place(self, req: Request, place: tuple[int, int]) -> None:
        req.replica, req.slot = place
        self._active[place] = req

    def _release(self, req: Request) -> None:
        del self._active[(req.replica, req.slot)]
        self._slots.give_back(req.replica, req.slot)

    def _release_cancelled(self) -> None:
        for req in [r for r in self._active.values() if r.future.done()]:
            self._release(req)


def _take(pools: list[list[int]]) -> tuple[int, int] | None:
    replica = max(range(len(pools)), key=lambda r: (len(pools[r]), -r))
    if not pools[replica]:
        return None
    return replica, pools[replica].pop(0)
