"""Collective engine steps: global rank 0 schedules, every rank executes its replica's rows.

Protocol (all messages are broadcast from global rank 0 over the world group):

* ``("step", plan)``: every rank runs ``plan.rows[its data-parallel replica]`` on its
  ``RowRunner`` (collective inside the replica's tensor-parallel group); each replica leader
  (TP rank 0) sends its results back with ``gather_object``.
* ``("score", jobs)``: every rank scores the same jobs (plain forwards; collective inside each
  replica, and every replica runs them, so expert-parallel replicas stay in lockstep); rank 0
  keeps its own results.
* ``("stop", idle)``: the generation window is over; followers return from ``follow()``
  (``idle``: the engine holds no request, so no KV-cache slot needs its contents).
* ``("abort", reason)``: rank 0 failed; followers raise instead of waiting forever.

When a window ends (stop or abort) every rank calls its runner's ``end_window`` (megatron-core's
engine releases its KV memory there; the CPU runner too when the window ends idle). With one process there is no communication at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron.rl.inference.protocol import RowResult, RowRunner, RowWork, ScoreOutput, ScoreWork


@dataclass(frozen=True)
class StepPlan:
    """One engine step: the rows each data-parallel replica runs."""

    rows: tuple[tuple[RowWork, ...], ...]


class GenerationAborted(RuntimeError):
    """Raised on follower ranks when rank 0 aborts generation."""


class StepGroup:
    """The ranks that execute engine steps together.

    Rank 0 calls ``step``; every other rank calls ``follow`` whenever rank 0 is in a generation
    window and returns when rank 0 calls ``stop_followers`` (or raises on ``abort_followers``).
    """

    def __init__(
        self,
        runner: RowRunner,
        dp_rank: int = 0,
        dp_size: int = 1,
        is_replica_leader: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.runner = runner
        self.dp_rank = dp_rank
        self.num_replicas = dp_size
        self.is_replica_leader = is_replica_leader
        self.group = group
        self.distributed = dist.is_initialized() and dist.get_world_size(group) > 1
        self.rank = dist.get_rank(group) if self.distributed else 0

    def step(self, plan: StepPlan) -> list[list[RowResult]]:
        """Run ``plan`` on all replicas (rank 0 only); results indexed by replica."""
        if len(plan.rows) != self.num_replicas:
            raise ValueError(f"plan has {len(plan.rows)} replicas, group has {self.num_replicas}")
        if not self.distributed:
            return [self.runner.run(list(plan.rows[0]))]
        self._broadcast(("step", plan))
        return self._run_and_gather(plan)

    def score(self, jobs: list[ScoreWork]) -> list[ScoreOutput]:
        """Score ``jobs`` on every rank (rank 0 only); rank 0's results, in job order."""
        if self.distributed:
            self._broadcast(("score", jobs))
        return self.runner.score(jobs)

    def follow(self) -> None:
        """Execute rank 0's plans until it stops the window, then end it here (other ranks)."""
        idle = False
        try:
            while True:
                kind, payload = self._broadcast(None)
                if kind == "stop":
                    idle = bool(payload)
                    return
                if kind == "abort":
                    raise GenerationAborted(f"rank 0 aborted generation: {payload}")
                if kind == "score":
                    self.runner.score(payload)
                    continue
                self._run_and_gather(payload)
        finally:
            self.runner.end_window(idle)

    def stop_followers(self, idle: bool = False) -> None:
        """End the generation window on every rank (rank 0 only); ``idle``: the engine holds no
        request (runners may release their KV memory)."""
        if self.distributed:
            self._broadcast(("stop", idle))
        self.runner.end_window(idle)

    def abort_followers(self, reason: str) -> None:
        """Make followers raise ``GenerationAborted`` and end the window here (rank 0, on
        failure)."""
        if self.distributed:
            self._broadcast(("abort", reason))
        self.runner.end_window()

    def _run_and_gather(self, plan: StepPlan) -> list[list[RowResult]]:
        mine = self.runner.run(list(plan.rows[self.dp_rank]))
        sent = (self.dp_rank, mine) if self.is_replica_leader else None
        gathered: list | None = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object(sent, gathered, dst=0, group=self.group)
        results: list[list[RowResult]] = [[] for _ in range(self.num_replicas)]
        for item in gathered or []:
            if item is not None:
                results[item[0]] = item[1]
        return results

    def _broadcast(self, message):
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
