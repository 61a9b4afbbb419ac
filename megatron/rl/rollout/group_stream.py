"""The streaming generator: rollouts submitted one group at a time through a gate of ``C`` groups
(``--rl-submission-granularity G``), consumed a group (G) or a batch (B) at a time.

The contract (``granularity.py`` has the arithmetic; group ``u`` is group ``u % P`` of batch
``u // P``, P groups per batch):

1. At most ``C`` groups are submitted and not yet consumed. ``start`` submits groups ``0..C-1``;
   each consumed group's unit submits the next group of the stream at the policy version of that
   moment.
2. A group is consumed when the trainer, collecting its batch, takes it: G consumption takes
   groups one by one in stream order, each as soon as it and every group before it have finished
   generating; B consumption takes a batch once all its groups have. Under the deterministic
   schedule "finished generating" is the engine's ``watch_generation`` report, which sits at a
   fixed place in the schedule; so is every release, and with it the engine step at which each
   new group's requests join (the barrier holds the next step until they arrive). Without a
   scheduler a unit is released when the trainer receives the group (the reward's timing).
3. So group ``u >= C`` is submitted at version ``(u - C) // P`` (the step being collected when
   group ``u - C`` is consumed) and trained ``group_staleness(u, C, P)`` versions after it; the
   batches the trainer gets are those of submission order, whatever order groups finish in.
4. ``drain`` and ``snapshot`` hold the same as for whole batches (``generator.py``, point 4),
   with the group cursor, the released units and the groups that finished generating before
   their step in the state; a generator built from it re-runs the unfinished groups at their
   saved versions.

Tasks: one worker per group (``_run_group``); releases and submissions run synchronously in the
consumer (``next_batch``) or in the engine's generation report, so no submitter task exists.
This object owns the workers: ``aclose`` cancels and awaits them, and a worker's exception is
re-raised by the pending or next ``next_batch``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from megatron.rl.agent.api import Agent
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import BatchScheduler
from megatron.rl.rollout.faults import FaultLog
from megatron.rl.rollout.generator import (
    GroupedRolloutGenerator,
    PipelineState,
    RolloutBatch,
    RolloutConfig,
)
from megatron.rl.rollout.reassembly import OrderedReassembly


class GroupStreamingGenerator(GroupedRolloutGenerator):
    """``GroupedRolloutGenerator``'s interface over a gate of ``config.capacity`` groups."""

    def __init__(
        self,
        agent: Agent,
        inference: InferenceInterface,
        config: RolloutConfig,
        policy_version: Callable[[], int],
        first_batch_id: int = 0,
        scheduler: BatchScheduler | None = None,
        resume_from: PipelineState | None = None,
        faults: FaultLog | None = None,
    ) -> None:
        if config.submission != "G" or config.capacity is None:
            raise ValueError("GroupStreamingGenerator streams groups: submission G, a capacity")
        self.agent, self.inference, self.config = agent, inference, config
        self.faults = faults if faults is not None else FaultLog()
        self.policy_version = policy_version
        self.scheduler = scheduler
        self._reassembly = OrderedReassembly(config.groups_per_batch)
        self._tasks: set[asyncio.Task] = set()
        self._progress = asyncio.Event()  # set by ``_on_task_done`` (shared with the batch gate)
        self._started = False
        self._next_batch_id = first_batch_id
        P = config.groups_per_batch
        self._submitted_groups = first_batch_id * P  # groups submitted so far
        self._released = first_batch_id * P  # groups whose unit was released (consumed)
        self._finished: set[int] = set()  # groups >= _released that finished generating
        self._group_versions: dict[int, int] = {}  # submission version of unconsumed groups
        self._collecting: int | None = None  # the batch the trainer collects now
        self._resumed_groups: list[int] = []
        self._resumed_engine = None
        if resume_from is not None:
            self._restore(resume_from)

    # --------------------------------------------------------------- state

    def _restore(self, state: PipelineState) -> None:
        cfg = self.config
        saved = (state.submission, state.consumption, state.capacity, state.groups_per_batch)
        ours = (cfg.submission, cfg.consumption, cfg.capacity, cfg.groups_per_batch)
        if saved != ours or state.group_size != cfg.group_size:
            raise ValueError(
                f"the saved rollout pipeline has (submission, consumption, capacity, groups per "
                f"batch) = {saved} and group size {state.group_size}; this run has {ours} and "
                f"{cfg.group_size}"
            )
        if state.submitted_groups is None or state.released_groups is None:
            raise ValueError("the saved rollout pipeline has no group cursor")
        P = cfg.groups_per_batch
        for group in state.groups:
            self._reassembly.put(group)
        self._next_batch_id = state.next_batch_id
        self._submitted_groups = state.submitted_groups
        self._released = state.released_groups
        self._finished = set(state.finished_groups)
        self._group_versions = dict(state.group_versions)
        buffered = {g.batch_id * P + g.index_in_batch for g in state.groups}
        first = state.next_batch_id * P
        if not first <= self._released <= self._submitted_groups or not buffered <= set(
            range(first, self._submitted_groups)
        ):
            raise ValueError("the saved rollout pipeline does not fit its own group cursor")
        if state.engine is None and buffered != set(range(first, self._submitted_groups)):
            raise ValueError("the saved rollout pipeline is not a drained one")
        self._resumed_groups = [
            u for u in range(first, self._submitted_groups) if u not in buffered
        ]
        self._resumed_engine = state.engine

    def _state(self, engine) -> PipelineState:
        P = self.config.groups_per_batch
        return PipelineState(
            next_batch_id=self._next_batch_id,
            submitted=-(-self._submitted_groups // P),
            forced_lag=0,
            groups_per_batch=P,
            group_size=self.config.group_size,
            groups=self._reassembly.buffered(),
            engine=engine,
            submission=self.config.submission,
            consumption=self.config.consumption,
            capacity=self.config.capacity,
            submitted_groups=self._submitted_groups,
            released_groups=self._released,
            finished_groups=sorted(self._finished),
            group_versions=dict(self._group_versions),
        )

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet consumed (what the gate holds)."""
        return self._submitted_groups - self._released

    # --------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Submit the first ``capacity`` groups (a resumed generator: restore the engine's work,
        re-run the unfinished groups, then fill what the gate owes)."""
        if self._started:
            return
        self._started = True
        P = self.config.groups_per_batch
        if self.scheduler is not None:
            watch = getattr(self.scheduler, "watch_generation", None)
            if watch is not None:
                watch(self._on_generated)
            if self._resumed_engine is not None:
                self.scheduler.restore(self._resumed_engine)
        for u in self._resumed_groups:
            b, i = divmod(u, P)
            self._submit_groups(b, range(i, i + 1), self._group_versions[u])
        self._resumed_engine, self._resumed_groups = None, []
        self._fill()

    async def next_batch(self) -> RolloutBatch:
        """Consume batch ``next_batch_id``'s groups in order, releasing each one's unit as it is
        consumed (contract point 2), and return them."""
        if not self._started:
            raise RuntimeError("call start() before next_batch()")
        s, P = self._next_batch_id, self.config.groups_per_batch
        self._collecting = s
        self._release_consumed()  # groups of batch s that finished before its window
        if self.scheduler is not None:
            self.scheduler.await_batch(s)
        if self.config.consumption == "G":
            groups = []
            for i in range(P):
                groups += await self._reassembly.pop(s, range(i, i + 1))
                self._finished_generating(s * P + i)
        else:
            groups = await self._reassembly.pop(s)
            for i in range(P):
                self._finished_generating(s * P + i)
        if self.scheduler is not None:
            await self.scheduler.window_spent(s)
        for u in range(s * P, (s + 1) * P):
            self._group_versions.pop(u, None)
        batch = RolloutBatch(
            s,
            groups,
            -(-self.in_flight // P),
            self._reassembly.depth,
            gate_capacity=self.config.capacity,
            gate_held=self.in_flight,
        )
        self._next_batch_id += 1
        return batch

    async def drain(self) -> PipelineState:
        """Wait until every submitted group is finished (no unit is released meanwhile: only the
        groups of the batch being collected release theirs); return the pipeline state."""
        if not self._started:
            raise RuntimeError("call start() before drain()")
        self._collecting = None
        if self.scheduler is not None:
            self.scheduler.await_batch(None)
        while workers := list(self._tasks):
            await asyncio.wait(workers)
        self._reassembly.raise_if_failed()
        return self._state(engine=None)

    async def snapshot(self) -> PipelineState:
        """The pipeline between two steps, nothing generated for it (the engine suspended)."""
        if not self._started:
            raise RuntimeError("call start() before snapshot()")
        if self.scheduler is None:
            raise RuntimeError("snapshot needs the engine (the scheduler) to save its work")
        self._collecting = None
        await asyncio.sleep(0)  # let workers that just finished deliver their groups
        self._reassembly.raise_if_failed()
        return self._state(engine=self.scheduler.snapshot())

    # --------------------------------------------------------------- the gate

    def _on_generated(self, batch_id: int, index: int) -> None:
        """The engine's report (``watch_generation``): group (batch, index) finished generating."""
        self._finished_generating(batch_id * self.config.groups_per_batch + index)

    def _finished_generating(self, u: int) -> None:
        if u >= self._released:
            self._finished.add(u)
            self._release_consumed()

    def _release_consumed(self) -> None:
        """Release the units of the groups the trainer now consumes (in stream order, those of the
        batch being collected; B: whole batches), then submit what the gate lets through."""
        if self._collecting is None:
            return
        P, end = self.config.groups_per_batch, (self._collecting + 1) * self.config.groups_per_batch
        if self.config.consumption == "G":
            while self._released < end and self._released in self._finished:
                self._finished.discard(self._released)
                self._released += 1
        else:
            while self._released < end and all(
                u in self._finished for u in range(self._released, self._released + P)
            ):
                self._finished -= set(range(self._released, self._released + P))
                self._released += P
        self._fill()

    def _fill(self) -> None:
        """Submit groups while the gate has room (``capacity`` groups beyond those released)."""
        P = self.config.groups_per_batch
        while self._submitted_groups < self._released + self.config.capacity:
            u = self._submitted_groups
            version = self.policy_version()
            self._group_versions[u] = version
            self._submitted_groups += 1
            b, i = divmod(u, P)
            self._submit_groups(b, range(i, i + 1), version)


def rollout_generator(
    agent: Agent,
    inference: InferenceInterface,
    config: RolloutConfig,
    policy_version: Callable[[], int],
    **kwargs,
) -> GroupedRolloutGenerator:
    """The generator of ``config``'s streaming mode: whole batches (B/B) or groups (G/B, G/G)."""
    cls = GroupStreamingGenerator if config.submission == "G" else GroupedRolloutGenerator
    return cls(agent, inference, config, policy_version, **kwargs)
