"""The scheduler's side of a group's life: the generator's hints (``expect_group``,
``group_done``, ``end_rollout``) and the engine's report of groups whose generation has ended
(``watch_generation``).

The streaming generator (``megatron/rl/rollout/group_stream.py``) releases a gate unit when the
trainer consumes a group; under the deterministic schedule it does so at the engine's report that
the group finished generating, so each release, and the engine step at which the next group's
requests join, is a function of the schedule alone.

A group has finished generating when it owes nothing: no announced request still to arrive, no
next turn awaited, no keyed request waiting or running. The scheduler checks this where a group
can stop owing work: the step that finishes a keyed request that announces no next turn,
``end_rollout`` and ``group_done``. Under the barrier no engine step happens between that point
and the report.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron.rl.inference.protocol import Key


class GroupHints:
    """The scheduler's group hints and generation reports (a mixin of
    ``ContinuousBatchingScheduler``, which provides the barrier's state: ``_expected``,
    ``_continuations``, ``_turns``, ``_done_turns``, ``_replay``, ``_wakeup`` and ``_queued``)."""

    def __init__(self) -> None:
        self._on_generated: Callable[[int, int], None] | None = None
        self._generated: set[tuple[int, int]] = set()  # groups reported, until group_done

    def expect_group(self, batch_id: int, index_in_batch: int, num_requests: int) -> None:
        """Group (batch, index) is about to send ``num_requests`` keyed requests."""
        if num_requests > 0:
            self._expected[(batch_id, index_in_batch)] = num_requests

    def group_done(self, batch_id: int, index_in_batch: int) -> None:
        """Group (batch, index) will send nothing more that it announced (later turns included)."""
        owed = {k for k in self._continuations if k[:2] == (batch_id, index_in_batch)}
        self._continuations -= owed
        self._done_turns.pop((batch_id, index_in_batch), None)
        for key in [k for k in self._turns if k[:2] == (batch_id, index_in_batch)]:
            del self._turns[key]
        if self._replay is not None:
            self._drop_restored(self._replay.abandon(batch_id, index_in_batch))
        if self._expected.pop((batch_id, index_in_batch), None) is not None or owed:
            self._wakeup.set()
        self._group_withdrawn((batch_id, index_in_batch))

    def end_rollout(self, key: Key) -> bool:
        """Rollout ``key`` sends no further turn; True if the engine was waiting for one."""
        if key not in self._continuations:
            return False
        self._continuations.discard(key)
        self._wakeup.set()
        self._report_if_generated(key[:2])
        return True

    def watch_generation(self, callback: Callable[[int, int], None] | None) -> None:
        """Call ``callback(batch, index)`` once per group, when its generation has ended: the
        engine step that finished its last keyed request, or the ``end_rollout`` or
        ``group_done`` that withdrew the last work it owed. Under the barrier no engine step
        happens between that point and the call, so the call sits at a fixed place in the
        schedule (the streaming generator releases gate units there)."""
        self._on_generated = callback

    def _group_withdrawn(self, group: tuple[int, int]) -> None:
        """``group_done``: the group owes nothing more; report it if that was not seen yet."""
        if group not in self._generated and self._on_generated is not None:
            self._on_generated(*group)
        self._generated.discard(group)

    def _report_if_generated(self, group: tuple[int, int]) -> None:
        if self._on_generated is None or group in self._generated:
            return
        if group in self._expected or any(k[:2] == group for k in self._continuations):
            return
        if any(r.key is not None and r.key[:2] == group for r in self._queued()):
            return
        self._generated.add(group)
        self._on_generated(*group)
