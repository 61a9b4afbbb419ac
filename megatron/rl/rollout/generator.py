"""Grouped rollout generator with forced lag: the submission gate and ordered reassembly.

The contract (batch s is what training step s consumes; the policy version is the number of
optimizer updates applied so far):

1. The gate holds L+1 permits. Batches 0..L are submitted at start. The permit of batch s is
   released when the trainer asks for batch s+1, and that release submits batch s+L+1, at the
   policy version of that moment. So batch s is submitted at version max(0, s - L) and every
   rollout trained at step s >= L has submission staleness exactly L; L = 0 is synchronous
   on-policy GRPO.
2. Batches come out strictly in ``batch_id`` order and groups inside a batch in
   ``index_in_batch`` order, whatever order the agents finish in.
3. A failure in any worker fails the pending ``next_batch`` with the original exception; nothing
   waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from megatron.rl.agent.api import Agent
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup, SamplingParams


@dataclass(frozen=True)
class RolloutConfig:
    """What the generator submits and how far ahead."""

    forced_lag: int = 0
    """L: batch s+L+1 is submitted when batch s has been consumed (0 = on-policy)."""
    groups_per_batch: int = 8
    """GRPO groups (prompts) per batch."""
    group_size: int = 8
    """Rollouts per group."""
    seed: int = 1234
    """Run seed passed to agents in every request."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Default sampling parameters of every request (agents may override max_tokens)."""

    def __post_init__(self) -> None:
        if self.forced_lag < 0:
            raise ValueError(f"forced_lag must be >= 0, got {self.forced_lag}")
        if self.groups_per_batch < 1 or self.group_size < 1:
            raise ValueError("groups_per_batch and group_size must be >= 1")


class BatchScheduler(Protocol):
    """Schedule hints the generator gives the inference engine (see ``LocalInferenceEngine``)."""

    def expect_group(self, batch_id: int, index_in_batch: int, num_requests: int) -> None:
        """A group is about to send ``num_requests`` keyed requests."""

    def group_done(self, batch_id: int, index_in_batch: int) -> None:
        """A group has finished; withdraw whatever it announced and did not send."""

    def await_batch(self, batch_id: int) -> None:
        """The trainer now waits for ``batch_id``."""


@dataclass(frozen=True)
class RolloutBatch:
    """One training step's groups, in order, with the pipeline state at hand-over."""

    batch_id: int
    groups: list[RolloutGroup]
    in_flight: int
    """Batches submitted and not yet handed over, this one included (at most L+1)."""
    queue_depth: int
    """Finished groups of later batches waiting in the reassembly buffer."""


class OrderedReassembly:
    """Collects finished groups in any order and hands out whole batches in ``batch_id`` order.

    ``put`` is called by group workers; ``pop(batch_id)`` by the consumer, which waits until all
    groups of that batch are in. ``fail`` makes current and later ``pop`` calls raise.
    """

    def __init__(self, groups_per_batch: int) -> None:
        self.groups_per_batch = groups_per_batch
        self._groups: dict[int, dict[int, RolloutGroup]] = {}
        self._waiters: dict[int, asyncio.Future] = {}
        self._error: BaseException | None = None

    @property
    def depth(self) -> int:
        """Finished groups buffered, over all batches."""
        return sum(len(g) for g in self._groups.values())

    def put(self, group: RolloutGroup) -> None:
        """Add a finished group; wakes the consumer when its batch is complete."""
        if not 0 <= group.index_in_batch < self.groups_per_batch:
            raise ValueError(f"group index {group.index_in_batch} outside its batch")
        batch = self._groups.setdefault(group.batch_id, {})
        if group.index_in_batch in batch:
            raise ValueError(f"group {group.batch_id}/{group.index_in_batch} delivered twice")
        batch[group.index_in_batch] = group
        waiter = self._waiters.get(group.batch_id)
        if len(batch) == self.groups_per_batch and waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def pop(self, batch_id: int) -> list[RolloutGroup]:
        """All groups of ``batch_id`` in ``index_in_batch`` order, once they are all in."""
        if self._error is None and len(self._groups.get(batch_id, ())) < self.groups_per_batch:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[batch_id] = waiter
            try:
                await waiter
            finally:
                self._waiters.pop(batch_id, None)
        if self._error is not None:
            raise self._error
        batch = self._groups.pop(batch_id)
        return [batch[i] for i in range(self.groups_per_batch)]

    def fail(self, error: BaseException) -> None:
        """Make every current and future ``pop`` raise ``error`` (first failure wins)."""
        if self._error is None:
            self._error = error
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_result(None)


class GroupedRolloutGenerator:
    """Submits grouped rollout requests through the gate and yields ordered batches.

    Tasks: one submitter task waits for a gate permit (consumes permits, produces a batch's
    group requests); one worker task per group awaits the agent (consumes a request, produces a
    ``RolloutGroup`` into the reassembly). The consumer (``next_batch``) releases the permit of
    the batch it consumed last and waits for the next batch in order; it is the only thing that
    unblocks the submitter. This object owns all these tasks: ``aclose`` cancels and awaits
    them, and a worker's exception is re-raised by the pending or next ``next_batch``.
    """

    def __init__(
        self,
        agent: Agent,
        inference: InferenceInterface,
        config: RolloutConfig,
        policy_version: Callable[[], int],
        first_batch_id: int = 0,
        scheduler: BatchScheduler | None = None,
    ) -> None:
        self.agent = agent
        self.inference = inference
        self.config = config
        self.policy_version = policy_version
        self.scheduler = scheduler
        self._gate = asyncio.Semaphore(config.forced_lag + 1)
        self._reassembly = OrderedReassembly(config.groups_per_batch)
        self._next_batch_id = first_batch_id
        self._first_batch_id = first_batch_id
        self._submitted = first_batch_id  # batches submitted so far (next id to submit)
        self._tasks: set[asyncio.Task] = set()
        self._submitter: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        """Batches submitted and not yet handed to the trainer."""
        return self._submitted - self._next_batch_id

    def start(self) -> None:
        """Start the submitter: batches first..first+L go out at once."""
        if self._submitter is None:
            self._submitter = self._spawn(self._submit_loop(), "rollout-submitter")

    async def next_batch(self) -> RolloutBatch:
        """Release the previous batch's permit and return the next batch, in order."""
        if self._submitter is None:
            raise RuntimeError("call start() before next_batch()")
        if self._next_batch_id > self._first_batch_id:
            self._gate.release()
        if self.scheduler is not None:
            self.scheduler.await_batch(self._next_batch_id)
        groups = await self._reassembly.pop(self._next_batch_id)
        batch = RolloutBatch(self._next_batch_id, groups, self.in_flight, self._reassembly.depth)
        self._next_batch_id += 1
        return batch

    async def aclose(self) -> None:
        """Cancel the submitter and every group worker and wait for them to finish."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reassembly.fail(RuntimeError("the rollout generator was closed"))

    async def _submit_loop(self) -> None:
        for batch_id in itertools.count(self._first_batch_id):
            await self._gate.acquire()
            version = self.policy_version()
            for index in range(self.config.groups_per_batch):
                request = GroupedRolloutRequest(
                    batch_id=batch_id,
                    index_in_batch=index,
                    groups_in_batch=self.config.groups_per_batch,
                    group_size=self.config.group_size,
                    seed=self.config.seed,
                    submission_policy_version=version,
                    sampling=self.config.sampling,
                )
                expected = self.agent.expected_requests(request)
                if self.scheduler is not None and expected:
                    self.scheduler.expect_group(batch_id, index, expected)
                self._spawn(self._run_group(request), f"rollout-group-{batch_id}-{index}")
            self._submitted = batch_id + 1

    async def _run_group(self, request: GroupedRolloutRequest) -> None:
        try:
            group = await self.agent.group_rollout(request, self.inference)
        finally:
            if self.scheduler is not None:
                self.scheduler.group_done(request.batch_id, request.index_in_batch)
        if (group.batch_id, group.index_in_batch) != (request.batch_id, request.index_in_batch):
            raise ValueError(
                f"agent {self.agent.env_id!r} answered request "
                f"{request.batch_id}/{request.index_in_batch} with group "
                f"{group.batch_id}/{group.index_in_batch}"
            )
        if len(group.rollouts) != request.group_size:
            raise ValueError(
                f"agent {self.agent.env_id!r} returned {len(group.rollouts)} rollouts for a group "
                f"of {request.group_size}"
            )
        self._reassembly.put(group)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._on_task_done)
        return task

    def _on_task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._reassembly.fail(task.exception())
