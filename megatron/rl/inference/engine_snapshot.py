"""The engine's keyed work in flight, as a checkpoint holds it, and its replay after a resume.

A checkpoint taken between two training steps must not change what the run generates (a save
that first generated every submitted batch to completion would give the rest of those batches
the current policy version instead of the later ones the uninterrupted run uses). So the engine
is saved as it is (``EngineSnapshot``):

* every keyed request still waiting or holding a slot: its prompt, sampling parameters and seed,
  the tokens, logprobs, policy versions (and recorded expert routes) so far, its slot and its
  place in the admission order; the KV cache of those slots is saved by each rank next to it
  (the runner's ``export_slots``), so the continuation is bitwise the one the uninterrupted run
  computes (the cache holds keys and values of older policy versions, as it does in that run);
* every finished turn of a group whose agent has not returned yet (its agent may still be
  computing rewards or waiting for the environment between turns);
* the free slots, the arrival counter and the generation window of the awaited batch.

Token sampling keeps no state (a token's uniform is a function of the request seed and its
position), so nothing else is needed.

After a resume the agents of the unfinished groups run again from the start with the same
requests (``Replay``): the n-th request of rollout key k is answered from the n-th saved turn of k
if that turn had finished, or adopts the saved request (its slot, tokens and cache) if it was in
flight; only later requests are new. The engine does not step while a saved request waits to be
adopted (a barrier, like the one for announced requests), so the first step after the resume
carries the rows the uninterrupted run's next step carried. An agent that sends a different
prompt than the saved one (not deterministic) gets a fresh generation and a warning: the run goes
on, no longer exact.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict

from megatron.rl.inference.keys import Key
from megatron.rl.wire import SamplingParams

logger = logging.getLogger(__name__)


class SavedTurn(BaseModel):
    """One request of a rollout key: finished (``finish_reason`` set) or in flight."""

    model_config = ConfigDict(extra="forbid")

    key: Key
    """(batch_id, index_in_batch, sample_index)."""
    turn: int
    """How many requests of this key came before it (multi-turn rollouts send several)."""
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    continued: bool
    """The rollout may send a next turn under the same key."""
    order: tuple[int, ...]
    """Its place in the admission order (the scheduler's heap key)."""
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    """Policy version of each generated token."""
    finish_reason: Literal["stop", "length"] | None = None
    """None: still waiting (``slot`` -1) or holding ``slot`` of ``replica``."""
    replica: int = -1
    slot: int = -1
    routed_experts: list[list[int]] | None = None
    """Routing replay: the routes of the positions fed so far, flat per position (None: not
    recorded, or a snapshot from before routes were saved)."""

    def cached_positions(self) -> int:
        """Positions of its slot's KV cache that hold its keys and values (the prompt and every
        generated token but the last, which the next step feeds); 0 before its first step."""
        return len(self.prompt) + len(self.tokens) - 1 if self.tokens else 0


class EngineSnapshot(BaseModel):
    """The scheduler's keyed work between two generation windows (``scheduler.snapshot``)."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int
    max_requests: int
    in_flight: list[SavedTurn]
    """Keyed requests waiting for a slot or holding one, in admission order."""
    finished: list[SavedTurn]
    """Finished turns of groups whose agents are still running."""
    arrivals: int
    """The scheduler's arrival counter (the tie-break of the admission order)."""
    awaited_batch: int | None
    """The window target: the batch the trainer consumed last."""
    window_left: int
    window_spent: bool

    def cached_positions(self) -> list[dict[int, int]]:
        """For each data-parallel replica: slot -> positions of its KV cache that must be saved."""
        positions: list[dict[int, int]] = [{} for _ in range(self.num_replicas)]
        for saved in self.in_flight:
            if saved.slot >= 0:
                positions[saved.replica][saved.slot] = saved.cached_positions()
        return positions


class Replay:
    """Matches the requests of re-run agents to a snapshot's turns, by rollout key and turn.

    ``claim`` is called for every keyed request after the resume, with the key's turn number:
    it returns the saved turn to answer it from (finished) or to adopt (in flight), or None when
    the request is new or does not match the saved one (then dropped, ``dropped``). ``unclaimed``
    is what the engine's barrier waits for.
    """

    def __init__(self, snapshot: EngineSnapshot) -> None:
        self._turns: dict[tuple[Key, int], SavedTurn] = {
            (s.key, s.turn): s for s in [*snapshot.finished, *snapshot.in_flight]
        }
        self.unclaimed: set[tuple[Key, int]] = {(s.key, s.turn) for s in snapshot.in_flight}
        """In-flight saved requests not yet adopted by their re-run agent."""
        self.dropped: list[SavedTurn] = []
        """Saved turns whose request came back different (the engine frees their slots)."""

    def claim(
        self, key: Key, turn: int, prompt: list[int], sampling: SamplingParams, seed: int
    ) -> SavedTurn | None:
        """The saved turn for this request, or None (a new request, or a different one: then the
        key's later saved turns, which continued the saved one, are dropped too)."""
        saved = self._turns.pop((key, turn), None)
        self.unclaimed.discard((key, turn))
        if saved is not None and (saved.prompt, saved.sampling, saved.seed) == (
            prompt,
            sampling,
            seed,
        ):
            return saved
        later = sorted(t for k, t in self._turns if k == key and t > turn)
        if saved is not None:
            logger.warning(
                "resume: rollout %s turn %d was sent again with a different prompt or sampling "
                "than the saved one; it is generated anew (the agent is not deterministic, the "
                "resumed run is no longer exact)",
                key,
                turn,
            )
            self.dropped.append(saved)
        for t in later:
            self.dropped.append(self._turns.pop((key, t)))
            self.unclaimed.discard((key, t))
        return None

    def finished_unclaimed(self) -> list[SavedTurn]:
        """Saved finished turns no re-run agent has asked for yet."""
        return [s for s in self._turns.values() if s.finish_reason is not None]

    def abandon(self, batch_id: int, index_in_batch: int) -> list[SavedTurn]:
        """Group (batch, index) finished without claiming some saved turns: forget them and
        return the in-flight ones (their slots must be freed)."""
        gone = [k for k in self._turns if k[0][:2] == (batch_id, index_in_batch)]
        left = [self._turns.pop(k) for k in gone]
        self.unclaimed -= set(gone)
        return [s for s in left if s.finish_reason is None]

    def abandon_all(self) -> list[SavedTurn]:
        """Forget every unclaimed turn (the barrier timed out); the in-flight ones are returned."""
        left = [s for s in self._turns.values() if s.finish_reason is None]
        self._turns.clear()
        self.unclaimed.clear()
        return left

    @property
    def done(self) -> bool:
        """Every saved turn was claimed or abandoned."""
        return not self._turns
