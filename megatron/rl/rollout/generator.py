"""Grouped rollout generator with forced lag: the submission gate and the group workers, whose
finished groups ``OrderedReassembly`` (``reassembly.py``) hands out in order.

The contract (batch s is what training step s consumes; the policy version is the number of
optimizer updates applied so far):

1. The gate holds L+1 permits. Batches 0..L are submitted at start. The permit of batch s is
   released when the trainer asks for batch s+1, and that release submits batch s+L+1, at the
   policy version of that moment. So batch s is submitted at version max(0, s - L) and every
   rollout trained at step s >= L has submission staleness exactly L; L = 0 is synchronous
   on-policy GRPO.
2. Batches come out strictly in ``batch_id`` order and groups inside a batch in
   ``index_in_batch`` order, whatever order the agents finish in.
3. An environment whose own code raises gives placeholder rollouts (``faults.run_group``, the
   policy the env server applies too); any other failure in a worker (the engine, an unreachable
   server, a malformed group) fails the pending ``next_batch`` with the original exception;
   nothing waits forever.
4. Checkpoints keep the contract exact. ``snapshot`` captures the pipeline between two steps
   without generating anything: the next batch id (the prompt cursor), how many batches were
   submitted and at which policy versions, the finished groups not yet consumed, and the
   engine's keyed work in flight (``engine_snapshot.py``: partial generations, their KV cache
   slots, finished turns of groups still running). A generator built with ``resume_from=state``
   holds the same permits and buffer and re-runs the agents of the unfinished groups, whose
   requests the restored engine answers by key, so the resumed run generates exactly what the
   run that was never saved generates. Engines that cannot save their cache (the CUDA tier's)
   ``drain`` instead: every submitted batch is completed first, and the state then holds whole
   batches (a resume equals the run that drained at the same step).
5. Generation rounds (dynamic sampling, ``megatron/rl/grpo/filtering.py``): a batch's groups may
   come in R rounds. By default every round is submitted with the batch (exact lag for any L).
   With ``lazy_rounds`` (L = 0 only, NeMo-RL's dynamic sampling) round r + 1 is submitted only
   while the batch's rounds so far hold fewer than a round's worth of groups whose rewards
   differ, from ``next_batch`` and at the batch's own policy version: at L = 0 nothing is trained
   between a batch's submission and its hand-over. The round's requests are those the eager
   rounds would send (same ids, same seeds), and the choice depends only on rewards, so a
   resumed run reproduces it.
6. A batch is handed over only once the scheduler says its window is spent
   (``BatchScheduler.window_spent``): with a reward-wait budget the engine first takes a fixed
   number of steps of later batches after the batch finished generating, so the trainer's
   weight update never lands at a timing-dependent step.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from megatron.rl.agent.api import Agent
from megatron.rl.grpo.filtering import has_reward_variance
from megatron.rl.inference.engine_snapshot import EngineSnapshot
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import BatchScheduler
from megatron.rl.rollout.faults import FaultLog, run_group
from megatron.rl.rollout.reassembly import OrderedReassembly
from megatron.rl.rollout.types import PipelineState, RolloutBatch, RolloutConfig
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup


class GroupedRolloutGenerator:
    """Submits grouped rollout requests through the gate and yields ordered batches.

    Tasks: one submitter task waits for a gate permit (consumes permits, produces a batch's
    group requests); one worker task per group awaits the agent (consumes a request, produces a
    ``RolloutGroup`` into the reassembly). The consumer (``next_batch``) releases the permit of
    the batch it consumed last and waits for the next batch in order; it is the only thing that
    unblocks the submitter. This object owns all these tasks: ``aclose`` cancels and awaits
    them, and a worker's exception is re-raised by the pending or next ``next_batch``.

    ``resume_from`` restores a ``PipelineState`` taken after ``drain`` (``first_batch_id`` is then
    the state's ``next_batch_id``).
    """

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
        self.agent = agent
        self.faults = faults if faults is not None else FaultLog()
        """Environment errors seen so far (each distinct one logged once)."""
        self.inference = inference
        self.config = config
        self.policy_version = policy_version
        self.scheduler = scheduler
        self._reassembly = OrderedReassembly(config.groups_per_batch)
        self._next_batch_id = first_batch_id
        self._submitted = first_batch_id  # batches submitted so far (next id to submit)
        self._release_on_next = False  # the batch consumed last still holds its permit
        self._versions: dict[int, int] = {}  # submission version of each unconsumed batch
        self._resumed_groups: list[tuple[int, int]] = []  # unfinished at the save: re-run
        self._resumed_engine: EngineSnapshot | None = None
        permits = config.forced_lag + 1
        if resume_from is not None:
            self._restore(resume_from)
            permits -= self.in_flight + 1
        self._gate = asyncio.Semaphore(permits)
        self._permitted = self._submitted + permits  # batches the gate has let through so far
        self._progress = asyncio.Event()  # set by the submitter after each batch
        self._tasks: set[asyncio.Task] = set()
        self._submitter: asyncio.Task | None = None

    def _restore(self, state: PipelineState) -> None:
        cfg = self.config
        saved = (state.forced_lag, state.groups_per_batch, state.group_size)
        if (state.submission, state.consumption) != ("B", "B"):
            raise ValueError(
                f"the saved rollout pipeline streams {state.submission}/{state.consumption}; "
                "this run streams whole batches (B/B)"
            )
        if saved != (cfg.forced_lag, cfg.groups_per_batch, cfg.group_size):
            raise ValueError(
                f"the saved rollout pipeline has forced_lag, groups_per_batch, group_size = "
                f"{saved}; this run has {(cfg.forced_lag, cfg.groups_per_batch, cfg.group_size)}"
            )
        in_flight = state.submitted - state.next_batch_id
        expected = [
            (b, i)
            for b in range(state.next_batch_id, state.submitted)
            for i in range(cfg.groups_per_batch)
        ]
        saved = [(g.batch_id, g.index_in_batch) for g in state.groups]
        if not 0 <= in_flight <= cfg.forced_lag or saved != [e for e in expected if e in saved]:
            raise ValueError(
                f"the saved rollout pipeline does not fit its own cursor: its groups must be "
                f"groups of batches {state.next_batch_id}..{state.submitted - 1}, in order"
            )
        if state.engine is None and saved != expected:
            raise ValueError(
                f"the saved rollout pipeline is not a drained one: batches "
                f"{state.next_batch_id}..{state.submitted - 1} must be complete"
            )
        for group in state.groups:
            self._reassembly.put(group)
        self._next_batch_id = state.next_batch_id
        self._submitted = state.submitted
        self._release_on_next = True
        self._resumed_groups = [e for e in expected if e not in set(saved)]
        self._resumed_engine = state.engine
        for b in range(state.next_batch_id, state.submitted):
            self._versions[b] = state.batch_versions.get(b, max(0, b - cfg.forced_lag))

    @property
    def in_flight(self) -> int:
        """Batches submitted and not yet handed to the trainer."""
        return self._submitted - self._next_batch_id

    def start(self) -> None:
        """Start the submitter: batches first..first+L go out at once. A resumed generator first
        restores the engine's saved work and re-runs the groups that were unfinished."""
        if self._submitter is None:
            if self._resumed_engine is not None and self.scheduler is not None:
                self.scheduler.restore(self._resumed_engine)
            for batch_id, index in self._resumed_groups:
                self._submit_groups(batch_id, range(index, index + 1), self._versions[batch_id])
            self._resumed_engine, self._resumed_groups = None, []
            self._submitter = self._spawn(self._submit_loop(), "rollout-submitter")

    async def next_batch(self) -> RolloutBatch:
        """Release the previous batch's permit and return the next batch, in order."""
        if self._submitter is None:
            raise RuntimeError("call start() before next_batch()")
        if self._release_on_next:
            self._gate.release()
            self._permitted += 1
            await self._submission_caught_up()
        self._release_on_next = True
        if self.scheduler is not None:
            self.scheduler.await_batch(self._next_batch_id)
        if self.config.lazy_rounds:
            groups = await self._lazy_rounds(self._next_batch_id)
        else:
            groups = await self._reassembly.pop(self._next_batch_id)
            self._versions.pop(self._next_batch_id, None)
        if self.scheduler is not None:  # the window's reward-wait budget, if any (point 6)
            await self.scheduler.window_spent(self._next_batch_id)
        batch = RolloutBatch(self._next_batch_id, groups, self.in_flight, self._reassembly.depth)
        self._next_batch_id += 1
        return batch

    async def _lazy_rounds(self, batch_id: int) -> list[RolloutGroup]:
        """The batch's first round, then one round more at a time while fewer than a round's
        worth of its groups have rewards that differ (contract point 5)."""
        size = self.config.groups_per_batch // self.config.rounds
        groups = await self._reassembly.pop(batch_id, range(size))
        version = self._versions.pop(batch_id)  # recorded by the submitter (done by now)
        for r in range(1, self.config.rounds):
            if sum(map(has_reward_variance, groups)) >= size:
                break
            if self.policy_version() != version:  # the trainer updated since the submission
                raise RuntimeError(f"a lazy round of batch {batch_id} would be submitted late")
            self._submit_groups(batch_id, range(r * size, (r + 1) * size), version)
            groups += await self._reassembly.pop(batch_id, range(r * size, (r + 1) * size))
        return groups

    async def drain(self) -> PipelineState:
        """Wait until every submitted batch is finished; return the pipeline state.

        The submitter first takes every permit it is owed, so the state is the same whatever the
        task interleaving. The inference engine must be stepping meanwhile (the owner resumes
        it); a worker's failure is raised here.
        """
        if self._submitter is None:
            raise RuntimeError("call start() before drain()")
        await self._submission_caught_up()
        if self.scheduler is not None:
            self.scheduler.await_batch(None)
        while workers := [t for t in self._tasks if t is not self._submitter]:
            await asyncio.wait(workers)
        self._reassembly.raise_if_failed()
        return self._state(engine=None)

    async def snapshot(self) -> PipelineState:
        """The pipeline as it stands between two steps, nothing generated for it (contract point
        4): the groups finished so far and the engine's keyed work in flight. The engine must be
        suspended (outside a generation window); a worker's failure is raised here."""
        if self._submitter is None:
            raise RuntimeError("call start() before snapshot()")
        if self.scheduler is None:
            raise RuntimeError("snapshot needs the engine (the scheduler) to save its work")
        await self._submission_caught_up()
        await asyncio.sleep(0)  # let workers that just finished deliver their groups
        self._reassembly.raise_if_failed()
        return self._state(engine=self.scheduler.snapshot())

    def _state(self, engine: EngineSnapshot | None) -> PipelineState:
        """The pipeline's state now: cursor, submissions and their versions (``_versions`` holds
        the unconsumed batches only), buffered groups, and ``engine``'s work in flight."""
        return PipelineState(
            next_batch_id=self._next_batch_id,
            submitted=self._submitted,
            forced_lag=self.config.forced_lag,
            groups_per_batch=self.config.groups_per_batch,
            group_size=self.config.group_size,
            groups=self._reassembly.buffered(),
            batch_versions=dict(self._versions),
            engine=engine,
        )

    async def aclose(self) -> None:
        """Cancel the submitter and every group worker and wait for them to finish."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reassembly.fail(RuntimeError("the rollout generator was closed"))

    async def _submission_caught_up(self) -> None:
        """Wait until every batch the gate let through is submitted.

        A released permit is taken by the submitter task on its next turn; waiting for it here
        makes the submission's policy version the one current at the release, whatever the
        caller does next, and makes ``drain`` see every batch it must finish.
        """
        while self._submitted < self._permitted:
            if self._submitter.done():
                self._submitter.result()  # raises what stopped it
                raise RuntimeError("the rollout submitter stopped")
            self._progress.clear()
            await self._progress.wait()

    async def _submit_loop(self) -> None:
        cfg = self.config
        for batch_id in itertools.count(self._submitted):
            await self._gate.acquire()
            version = self.policy_version()
            self._versions[batch_id] = version
            first = cfg.groups_per_batch // cfg.rounds if cfg.lazy_rounds else cfg.groups_per_batch
            self._submit_groups(batch_id, range(first), version)
            self._submitted = batch_id + 1
            self._progress.set()

    def _submit_groups(self, batch_id: int, indices: range, version: int) -> None:
        """Announce groups ``indices`` of ``batch_id`` to the scheduler and start their workers."""
        for index in indices:
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

    async def _run_group(self, request: GroupedRolloutRequest) -> None:
        try:
            group = await run_group(self.agent, request, self.inference, self.faults)
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
        self._progress.set()  # a waiter in _submission_caught_up re-checks the submitter
        if not task.cancelled() and task.exception() is not None:
            self._reassembly.fail(task.exception())
