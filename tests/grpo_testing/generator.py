"""Fakes of the forced-lag generator's tests: an agent whose groups finish after random delays
(so later groups and batches often finish first), one that fails a chosen group, and the trainer
side as a loop that bumps the policy version after each consumed batch."""

from __future__ import annotations

import asyncio
import random

from megatron.rl.agent.api import Agent
from megatron.rl.inference.protocol import EngineError
from megatron.rl.rollout.generator import GroupedRolloutGenerator, RolloutConfig
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup, TokenRollout

GROUPS, GROUP_SIZE = 4, 3


def make_group(request: GroupedRolloutRequest, salt: int = 0) -> RolloutGroup:
    """A group whose content is a deterministic function of the request."""
    rollouts = [
        TokenRollout(
            env_id="fake",
            problem_id=f"{request.batch_id}/{request.index_in_batch}",
            prompt="p",
            completion="c",
            reward=float((request.batch_id * 7 + request.index_in_batch * 3 + k + salt) % 5),
            tokens=[2, 3 + k],
            generation_mask=[False, True],
            logprobs=[-0.5],
            policy_versions=[request.submission_policy_version],
            submission_policy_version=request.submission_policy_version,
        )
        for k in range(request.group_size)
    ]
    return RolloutGroup(
        batch_id=request.batch_id, index_in_batch=request.index_in_batch, rollouts=rollouts
    )


class RandomDelayAgent(Agent):
    """Finishes each group after a random delay; records requests and completion order."""

    def __init__(self, seed: int = 0, max_delay: float = 0.01) -> None:
        super().__init__("fake")
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.requests: list[GroupedRolloutRequest] = []
        self.finished: list[tuple[int, int]] = []
        self.cancelled = 0

    async def group_rollout(self, request, inference):
        self.requests.append(request)
        try:
            await asyncio.sleep(self.rng.uniform(0, self.max_delay))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished.append((request.batch_id, request.index_in_batch))
        return make_group(request)


def make_generator(agent: Agent, lag: int, version: list[int], **kwargs) -> GroupedRolloutGenerator:
    config = RolloutConfig(forced_lag=lag, groups_per_batch=GROUPS, group_size=GROUP_SIZE, seed=1)
    return GroupedRolloutGenerator(agent, None, config, lambda: version[0], **kwargs)


async def train_loop(gen: GroupedRolloutGenerator, version: list[int], steps: int) -> list:
    """What the trainer does: take batch s, train (bump the version), repeat."""
    batches = []
    gen.start()
    try:
        for step in range(steps):
            batches.append(await gen.next_batch())
            await asyncio.sleep(0.002)  # the "training step": generation keeps running
            version[0] = step + 1
    finally:
        await gen.aclose()
    return batches


class FailingAgent(RandomDelayAgent):
    """Fails group ``fail_at``: its inference fails (``EngineError``, which ends the run) or, with
    ``environment_bug``, its own code raises (which masks the group)."""

    def __init__(
        self,
        fail_at: tuple[int, int],
        hang_before: int | None = None,
        environment_bug: bool = False,
    ) -> None:
        super().__init__(max_delay=0.002)
        self.fail_at = fail_at
        self.hang_before = hang_before
        self.environment_bug = environment_bug

    async def group_rollout(self, request, inference):
        if (request.batch_id, request.index_in_batch) == self.fail_at:
            await asyncio.sleep(0.01)
            raise_environment_bug() if self.environment_bug else raise_engine_failure()
        if self.hang_before is not None and request.batch_id < self.hang_before:
            await asyncio.Event().wait()  # never finishes
        return await super().group_rollout(request, inference)


def raise_environment_bug():
    raise ZeroDivisionError("bug in the agent")


def raise_engine_failure():
    raise EngineError("the engine failed")
