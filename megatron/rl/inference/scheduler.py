"""The continuous-batching scheduler: the inference engine of both tiers.

Requests arrive through ``await engine.generate(...)`` from any number of agent tasks. One loop
task owns all scheduling state: it admits waiting requests into free slots (spread over
data-parallel replicas), feeds each active request its prompt once and then one token per step,
and resolves a request's future when it samples EOS or reaches its token budget. The steps run on
a ``StepGroup`` of row runners (``protocol.RowRunner``): ``KVCacheRowRunner`` on the CPU tier,
``DynamicEngineRowRunner`` (megatron-core's ``DynamicInferenceEngine``) on the CUDA tier. Every
step runs the same model object the trainer updates, so each token records the policy version
that produced it.

Deterministic schedule. Requests that carry a ``RolloutKey`` are scheduled by key, not by arrival
time, which makes the sequence of engine steps (and so which policy version generates each token)
independent of network or task timing:

* ``expect_group(batch, index, n)`` announces that group (batch, index) is about to send ``n``
  keyed requests. While any announced request has not arrived, the engine does not step (the
  barrier); ``group_done`` withdraws what a group will no longer send.
* Waiting requests are admitted in key order (batch, index, sample); unkeyed requests, first
  come first served, into the slots reserved for them (``SchedulerConfig.outside_slots``,
  ``slots.py``), else (none reserved) into rollout slots no keyed request waits for.
* Multi-turn rollouts: a keyed request sent with ``continued=True`` announces, when it finishes,
  the next turn under the same key (the environment answers in between). The barrier holds until
  that request arrives or ``end_rollout(key)`` says the rollout is over; ``group_done`` withdraws
  the turns its group still owed. So a later turn joins the batch at a fixed step too.
* ``await_batch(b)`` sets the window target: keyed requests step while batch ``b`` is unfinished
  and then for the reward-wait budget of K steps (``SchedulerConfig.reward_wait_steps``), which
  ``window_spent(b)`` waits for; unkeyed requests always step (``window_budget.py`` decides
  this). ``SchedulerConfig.window_target=False`` turns the target and the barrier off.
* Unkeyed requests in reserved slots also step at the barrier, and under the window target
  their rows run in a forward of their own after the keyed rows': so a keyed row's batch, and
  its tokens, are those of the run without outside requests, and an outside request is answered
  within its token budget of steps (plus one to admit it) while the engine is resumed.

A barrier that waits longer than ``barrier_timeout_s`` is lifted with a warning (an agent that
announced requests it never sent): the run goes on, without the determinism guarantee.

Checkpoints: ``snapshot`` returns the keyed work in flight between two windows and ``restore``
continues it in a new process, whose re-run agents are answered by key (``engine_snapshot.py``).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import time
from collections.abc import Callable

from megatron.rl.inference.engine_snapshot import Replay, SavedTurn
from megatron.rl.inference.group_hints import GroupHints
from megatron.rl.inference.protocol import (
    EngineCounters,
    EngineError,
    GenerationOutput,
    Key,
    RowResult,
    RowWork,
    ScoreWork,
    TokenWatch,
)
from megatron.rl.inference.requests import Request, SchedulerConfig, check_request
from megatron.rl.inference.scheduler_checkpoint import CheckpointedScheduling
from megatron.rl.inference.scoring_queue import ScoreQueue
from megatron.rl.inference.slots import Admission, SlotPools
from megatron.rl.inference.step_group import StepGroup, StepPlan
from megatron.rl.inference.window_budget import WindowBudget
from megatron.rl.wire import SamplingParams

logger = logging.getLogger(__name__)


class ContinuousBatchingScheduler(CheckpointedScheduling, Admission, ScoreQueue, GroupHints):
    """Continuous batching over a ``StepGroup`` (``protocol.InferenceEngine``); suspended outside
    generation windows.

    The loop task (``start``/``aclose``) consumes queued requests and produces tokens. It waits
    while suspended (``suspend``/``resume``, driven by the owner of the training loop), while no
    request can step (``generate``, ``group_done`` and ``await_batch`` wake it), or at the
    barrier. If a step raises, the loop fails every pending request with ``EngineError`` and later
    ``generate`` calls raise at once.
    """

    def __init__(
        self, steps: StepGroup, config: SchedulerConfig, policy_version: Callable[[], int]
    ) -> None:
        self.steps = steps
        self.config = config
        self.policy_version = policy_version
        self._waiting: list[Request] = []  # keyed, heap by order
        self._outside: collections.deque[Request] = collections.deque()  # unkeyed, by arrival
        self._active: dict[tuple[int, int], Request] = {}
        self._slots = SlotPools(
            steps.num_replicas, config.max_requests, config.outside_slots, not config.window_target
        )
        self._arrivals = 0  # the tie-break of the admission order
        self._turns: dict[Key, int] = {}  # keyed requests per key so far, while its group runs
        self._done_turns: dict[tuple[int, int], list[Request | SavedTurn]] = {}  # for snapshots
        self._replay: Replay | None = None  # after ``restore``: the saved turns not yet claimed
        self._adopted: dict[tuple[Key, int], Request] = {}  # restored requests by (key, turn)
        self._expected: dict[tuple[int, int], int] = {}
        self._continuations: set[Key] = set()  # finished turns whose next turn is awaited
        self._window = WindowBudget(config.reward_wait_steps, config.window_target)
        self._resumed = asyncio.Event()
        self._wakeup = asyncio.Event()
        self._scoring: list[tuple[ScoreWork, asyncio.Future]] = []  # ``ScoreQueue``'s
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        GroupHints.__init__(self)
        self.counters = EngineCounters()
        """Tokens, steps, rows and step time since start (for the step metrics)."""

    @property
    def outside_capacity(self) -> int:
        """KV-cache slots unkeyed requests may take at once, over every replica (the servers'
        queue admits that many engine requests; ``slots.py``)."""
        return self._slots.outside_capacity

    # ----------------------------------------------------------------- requests

    async def generate(
        self,
        prompt_tokens: list[int],
        sampling: SamplingParams,
        seed: int,
        key: Key | None = None,
        continued: bool = False,
        adapter: str | None = None,
        watch: TokenWatch | None = None,
    ) -> GenerationOutput:
        """Generate a completion of ``prompt_tokens``; resolves when it stops.

        ``continued`` (keyed requests only): the rollout may send its next turn under ``key``
        once this one finished; the engine waits for it (see the module docstring).
        ``adapter``: the named LoRA adapter set (unkeyed requests of a multi-adapter server).
        ``watch``: sees every token recorded and may end the request (``protocol.TokenWatch``;
        a keyed turn replayed from a snapshot is answered whole, unwatched).
        """
        if key is not None and key in self._continuations:  # the awaited turn, valid or not
            self._continuations.discard(key)
            self._wakeup.set()
        self._raise_if_failed()
        if self._task is None:
            raise RuntimeError("the inference engine is not running: call start() first")
        turn = 0
        if key is not None:
            turn = self._turns.get(key, 0)
            self._turns[key] = turn + 1
            if self._replay is not None:
                saved = self._replay.claim(key, turn, list(prompt_tokens), sampling, seed)
                self._drop_mismatched()
                if saved is not None:
                    return await self._replayed(saved)
        check_request(prompt_tokens, sampling, key, adapter, self.config.max_seq_len)
        arrival, self._arrivals = self._arrivals, self._arrivals + 1
        order = (0, *key, arrival) if key is not None else (1, arrival)
        future = asyncio.get_running_loop().create_future()
        request = Request(
            order,
            list(prompt_tokens),
            sampling,
            seed,
            key,
            future,
            turn=turn,
            adapter=adapter,
            watch=watch,
        )
        request.continued = continued and key is not None
        if key is not None:
            heapq.heappush(self._waiting, request)
            self._arrived(key[:2])
        else:
            self._outside.append(request)
        self._wakeup.set()
        return await future

    # ----------------------------------------------------------------- schedule hints

    def await_batch(self, batch_id: int | None) -> None:
        """The trainer now waits for ``batch_id``: keyed work steps only while it is unfinished.

        ``None`` lets every keyed request step (a drain before a checkpoint).
        """
        self._window.await_batch(batch_id)
        self._wakeup.set()

    async def window_spent(self, batch_id: int) -> None:
        """Wait until the window of ``batch_id`` has taken every engine step the schedule gives
        it (``WindowBudget.wait_spent``); at once without a budget (``reward_wait_steps=0`` or no
        ``window_target``). Raises ``EngineError`` if the engine fails."""
        if self._window.enabled:
            await self._window.wait_spent(batch_id, failed=lambda: self._error is not None)
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise EngineError(
                f"the inference engine is unavailable: {self._error}"
            ) from self._error

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the loop task (suspended until ``resume``)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    async def aclose(self) -> None:
        """Cancel the loop task; pending and later requests fail with ``EngineError``."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._error is None:
            self._error = EngineError("the inference engine was shut down")
        self._fail_pending("the inference engine was shut down")

    def suspend(self) -> None:
        """Stop stepping after the current step (the trainer is about to update the weights)."""
        self._resumed.clear()

    def holds_requests(self) -> bool:
        """Whether a request waits for a slot or holds one."""
        return bool(self._waiting or self._outside or self._active)

    def resume(self) -> None:
        """Let the loop step again."""
        self._resumed.set()
        self._wakeup.set()

    # ----------------------------------------------------------------- the loop

    async def _loop(self) -> None:
        try:
            barrier_since: float | None = None
            while True:
                await self._resumed.wait()
                if self._scoring:
                    self._score_waiting()
                self._release_cancelled()
                replaying = self._replay is not None and bool(self._replay.unclaimed)
                if self.config.window_target and (
                    self._expected or self._continuations or replaying
                ):
                    barrier_since = barrier_since or time.monotonic()
                    waited = time.monotonic() - barrier_since
                    if waited < self.config.barrier_timeout_s:
                        if self._step_outside_only():  # outside requests step at the barrier
                            await asyncio.sleep(0)
                        else:
                            await self._sleep_until_woken(self.config.barrier_timeout_s - waited)
                        continue
                    logger.warning(
                        "inference engine: announced requests of groups %s (next turns of %s) did "
                        "not arrive within %.0f s; stepping without them (the schedule is no "
                        "longer deterministic)",
                        sorted(self._expected),
                        sorted(self._continuations),
                        self.config.barrier_timeout_s,
                    )
                    self._expected.clear()
                    self._continuations.clear()
                    if self._replay is not None:
                        self._drop_restored(self._replay.abandon_all())
                barrier_since = None
                self._admit()
                budget = self._window.counts_next_step(
                    self._awaited_unfinished, lambda: any(r.key is not None for r in self._queued())
                )
                rows = self._plan()
                if not any(rows):
                    await self._sleep_until_woken()
                    continue
                keyed = self._step(rows)
                if budget and keyed:
                    self._window.count_step()
                await asyncio.sleep(0)  # let agents queue new requests between steps
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._error = exc
            self._fail_pending(f"inference engine step failed: {exc!r}", cause=exc)
            raise

    async def _sleep_until_woken(self, timeout: float | None = None) -> None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
        # arrives as the event is set, and aclose() would then wait for this loop forever.
        self._wakeup.clear()
        try:
            async with asyncio.timeout(timeout):
                await self._wakeup.wait()
        except TimeoutError:
            pass

    def _queued(self) -> itertools.chain[Request]:
        return itertools.chain(self._waiting, self._outside, self._active.values())

    def _awaited_unfinished(self, b: int) -> bool:
        return any(k[0] == b for k in itertools.chain(self._expected, self._continuations)) or any(
            r.key is not None and r.key[0] == b for r in self._queued()
        )

    def _plan(self) -> list[list[RowWork]]:
        keyed = self._window.keyed_work_allowed(self._awaited_unfinished)
        rows: list[list[RowWork]] = [[] for _ in range(self.steps.num_replicas)]
        for (replica, _), req in sorted(self._active.items(), key=lambda kv: kv[1].order):
            if keyed or req.key is None:
                rows[replica].append(req.next_row())
        return rows

    def _step(self, rows: list[list[RowWork]]) -> bool:
        """Run one engine step; True if it carried keyed rows. Under the window target, keyed
        and unkeyed rows run as two forwards (keyed first), so that no keyed row's batch depends
        on outside traffic; the counters count them as one step."""

        def keyed_row(replica: int, w: RowWork) -> bool:
            return self._active[(replica, w.slot)].key is not None

        parts = [rows]
        if self.config.window_target:
            parts = [
                [[w for w in r if keyed_row(rep, w) == want] for rep, r in enumerate(rows)]
                for want in (True, False)
            ]
        keyed = any(keyed_row(rep, w) for rep, r in enumerate(rows) for w in r)
        start = time.perf_counter()
        results = [self.steps.step(StepPlan(tuple(map(tuple, p)))) for p in parts if any(p)]
        self.counters.count_step(sum(len(r) for r in rows), time.perf_counter() - start)
        version = self.policy_version()
        for part_results in results:
            for replica, replica_results in enumerate(part_results):
                for res in replica_results:
                    self._record(self._active[(replica, res.slot)], res, version)
        return keyed

    def _record(self, req: Request, res: RowResult, version: int) -> None:
        req.record(res, version)
        self.counters.generated_tokens += 1
        try:
            watched_stop = req.watched(res, version)
        except Exception as exc:  # the watcher's fault fails its own request only
            self._release(req)
            if not req.future.done():
                req.future.set_exception(exc)
            return
        stop = res.token == self.config.eos_id or res.token in self.config.extra_stop_ids
        if (stop and not req.sampling.ignore_eos) or watched_stop:
            self._finish(req, "stop")
        elif len(req.tokens) >= req.sampling.max_tokens:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        if not req.future.done():
            if req.key is not None and req.key in self._turns:  # its group runs: a snapshot
                self._done_turns.setdefault(req.key[:2], []).append(req)  # replays this turn
            if req.continued:  # before any further step: the barrier now awaits the next turn
                self._continuations.add(req.key)
            req.future.set_result(req.output(reason))
            if req.key is not None and not req.continued:
                self._report_if_generated(req.key[:2])

    def _arrived(self, group: tuple[int, int]) -> None:
        left = self._expected.pop(group, None)
        if left is not None and left > 1:
            self._expected[group] = left - 1

    def _fail_pending(self, message: str, cause: BaseException | None = None) -> None:
        """Fail every queued and active request with an ``EngineError`` of its own.

        One instance per future: an exception object shared by several tasks would collect every
        task's frames in its traceback as each of them re-raises it.
        """
        self._window.wake_waiters()  # window_spent raises the error
        self._fail_scoring(message)
        for req in [*self._waiting, *self._outside, *self._active.values()]:
            if not req.future.done():
                error = EngineError(message)
                error.__cause__ = cause
                req.future.set_exception(error)
        self._waiting.clear()
        self._outside.clear()
        self._active.clear()
