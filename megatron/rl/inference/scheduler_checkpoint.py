"""Checkpoints of the continuous-batching scheduler: ``snapshot`` of its keyed work between two
windows, ``restore`` in a new process, and the replay that answers re-run agents by key
(``engine_snapshot.py`` says what is saved and why).

``CheckpointedScheduling`` is a base of ``ContinuousBatchingScheduler``: its methods use that
class's scheduling state (``_waiting``, ``_active``, ``_slots``, ``_window``, ``_turns``,
``_done_turns``, ``_replay``, ``_adopted``, ...), which only the scheduler's loop and these methods
change, all on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import heapq

from megatron.rl.inference.engine_snapshot import EngineSnapshot, Replay, SavedTurn
from megatron.rl.inference.protocol import GenerationOutput
from megatron.rl.inference.requests import restored_request, saved_turn


class CheckpointedScheduling:
    """``snapshot``/``restore`` and the replay of a ``ContinuousBatchingScheduler``."""

    def snapshot(self) -> EngineSnapshot:
        """The keyed work in flight (between windows): what ``restore`` continues exactly. The
        KV cache of the slots it names is saved by the runners (``cached_positions``)."""
        in_flight = sorted(r for r in self._queued() if r.key is not None and not r.future.done())
        finished = [t for turns in self._done_turns.values() for t in turns]
        if self._replay is not None:  # saved turns the re-run agents have not reached yet
            finished += self._replay.finished_unclaimed()
        awaited, left, spent = self._window.state()
        return EngineSnapshot(
            num_replicas=self.steps.num_replicas,
            max_requests=self.config.max_requests,
            in_flight=[saved_turn(r) for r in in_flight],
            finished=sorted((saved_turn(t) for t in finished), key=lambda t: (t.key, t.turn)),
            arrivals=self._arrivals,
            awaited_batch=awaited,
            window_left=left,
            window_spent=spent,
        )

    def restore(self, snapshot: EngineSnapshot) -> None:
        """Continue ``snapshot`` (a started engine, before any request; the runners already hold
        the saved slots' KV cache): its in-flight requests take their slots again and wait for
        their agents, re-run, to claim them by key (``Replay``)."""
        shape = (self.steps.num_replicas, self.config.max_requests)
        if (snapshot.num_replicas, snapshot.max_requests) != shape:
            raise ValueError(
                f"the saved engine had {snapshot.num_replicas} data-parallel replicas of "
                f"{snapshot.max_requests} slots; this one has {shape[0]} of {shape[1]}"
            )
        if self._task is None or self.holds_requests():
            raise RuntimeError("restore needs a started engine that holds no request")
        loop = asyncio.get_running_loop()
        for s in snapshot.in_flight:
            req = restored_request(s, loop.create_future())
            if s.slot >= 0:
                self._active[(s.replica, s.slot)] = req
                self._slots.claim(s.replica, s.slot)
            else:
                heapq.heappush(self._waiting, req)
            self._adopted[(s.key, s.turn)] = req
        self._arrivals = snapshot.arrivals
        self._window.restore(snapshot.awaited_batch, snapshot.window_left, snapshot.window_spent)
        self._replay = Replay(snapshot)

    async def _replayed(self, saved: SavedTurn) -> GenerationOutput:
        """Answer a re-run agent's request from its saved turn (``generate`` after ``restore``)."""
        key = saved.key
        self._arrived(key[:2])
        self._wakeup.set()
        if self._replay is not None and self._replay.done:
            self._replay = None
        if saved.finish_reason is None:  # in flight at the save: continue it
            return await self._adopted.pop((key, saved.turn)).future
        self._done_turns.setdefault(key[:2], []).append(saved)
        if saved.continued:  # as when it finished: the barrier awaits the next turn
            self._continuations.add(key)
        return GenerationOutput(
            list(saved.tokens),
            list(saved.logprobs),
            list(saved.versions),
            saved.finish_reason,
            saved.routed_experts,
        )

    def _drop_mismatched(self) -> None:
        """Free the saved requests that came back different (``Replay.dropped``)."""
        if self._replay is not None and self._replay.dropped:
            dropped, self._replay.dropped = self._replay.dropped, []
            self._drop_restored([s for s in dropped if s.finish_reason is None])

    def _drop_restored(self, turns: list[SavedTurn]) -> None:
        """Forget restored requests no agent will claim: their slots are freed."""
        for s in turns:
            req = self._adopted.pop((s.key, s.turn), None)
            if req is None:
                continue
            req.future.cancel()
            if (req.replica, req.slot) in self._active:
                self._release(req)
            else:
                self._waiting.remove(req)
                heapq.heapify(self._waiting)
        self._wakeup.set()
