"""The reward-wait budget end to end: ``GroupedRolloutGenerator`` over a
``ContinuousBatchingScheduler`` (fake steps) at forced lag 2, with adversarial timing.

Every rollout is one keyed request with a long-tailed token budget followed by a reward that
takes a random time; engine steps and training steps take random times too. Whatever the timing,
each token must come from the same policy version and the engine must take the same steps; and
the budget must actually move generation of later batches into the reward waits.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.agent.api import Agent
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.rollout.generator import GroupedRolloutGenerator, RolloutConfig
from megatron.rl.wire import RolloutGroup, SamplingParams, TokenRollout

LAG, GROUPS, GROUP_SIZE, STEPS = 2, 2, 3, 8
BUDGETS = (1, 1, 2, 3, 9)  # token budgets of the rollouts, cycled: a long tail


class EngineAgent(Agent):
    """One keyed request per rollout, then a reward that takes ``delay()`` seconds."""

    def __init__(self, engine: ContinuousBatchingScheduler, delay) -> None:
        super().__init__("fake")
        self.engine = engine
        self.delay = delay

    def expected_requests(self, request):
        return request.group_size

    async def group_rollout(self, request, inference):
        async def rollout(k: int) -> TokenRollout:
            b, i = request.batch_id, request.index_in_batch
            key, seed = (b, i, k), 100 * b + 10 * i + k
            budget = BUDGETS[(b + 2 * i + k) % len(BUDGETS)]
            out = await self.engine.generate([2], SamplingParams(max_tokens=budget), seed, key)
            await asyncio.sleep(self.delay())  # the reward
            return TokenRollout(
                env_id="fake",
                problem_id=f"{b}/{i}",
                prompt="p",
                completion="c",
                reward=float(k),
                tokens=[2, *out.tokens],
                generation_mask=[False] + [True] * len(out.tokens),
                logprobs=out.logprobs,
                policy_versions=out.policy_versions,
                submission_policy_version=request.submission_policy_version,
            )

        rollouts = await asyncio.gather(*(rollout(k) for k in range(request.group_size)))
        return RolloutGroup(
            batch_id=request.batch_id, index_in_batch=request.index_in_batch, rollouts=rollouts
        )


def run_training(budget: int, timing_seed: int | None, lag: int = LAG) -> tuple[list, list]:
    """Train ``STEPS`` steps; returns every rollout's (key, tokens, versions) per step and the
    engine's steps as (seed, start) rows. ``timing_seed=None``: everything is instant."""
    rng = random.Random(timing_seed)

    def delay(most: float) -> float:
        return 0.0 if timing_seed is None else rng.choice([0.0, rng.uniform(0, most)])

    steps = FakeSteps()
    original = steps.step

    def timed_step(plan):
        time.sleep(delay(0.002))
        return original(plan)

    steps.step = timed_step
    version = [0]
    config = SchedulerConfig(max_requests=32, max_seq_len=32, reward_wait_steps=budget)
    engine = ContinuousBatchingScheduler(steps, config, lambda: version[0])
    rollout_config = RolloutConfig(
        forced_lag=lag, groups_per_batch=GROUPS, group_size=GROUP_SIZE, seed=1
    )

    async def train():
        engine.start()
        agent = EngineAgent(engine, lambda: delay(0.01))
        gen = GroupedRolloutGenerator(
            agent, None, rollout_config, lambda: version[0], scheduler=engine
        )
        gen.start()
        trained = []
        try:
            for step in range(STEPS):
                engine.resume()  # the generation window
                batch = await gen.next_batch()
                engine.suspend()
                assert batch.batch_id == step
                trained.append(
                    [
                        (g.index_in_batch, k, r.tokens, r.policy_versions)
                        for g in batch.groups
                        for k, r in enumerate(g.rollouts)
                    ]
                )
                await asyncio.sleep(delay(0.005))  # the training step
                version[0] += 1
        finally:
            await gen.aclose()
            await engine.aclose()
        return trained

    trained = asyncio.run(train())
    return trained, [[(r.seed, r.start) for r in p.rows[0]] for p in steps.plans]


@pytest.mark.parametrize("budget", [0, 4], ids=["no-budget", "budget-4"])
def test_every_token_has_the_same_version_whatever_the_timing(budget):
    reference = run_training(budget, timing_seed=None)
    for timing_seed in (1, 2, 3):
        assert run_training(budget, timing_seed) == reference, f"timing seed {timing_seed}"


def test_the_budget_generates_later_batches_during_reward_waits():
    without, _ = run_training(0, timing_seed=None)
    with_budget, _ = run_training(4, timing_seed=None)

    def versions(trained):
        return [v for step in trained for *_, vs in step for v in vs]

    # Same tokens (each request samples with its own seed), earlier policy versions: later
    # batches generated part of their tokens in earlier windows, during the reward waits.
    assert [[r[:3] for r in s] for s in with_budget] == [[r[:3] for r in s] for s in without]
    assert sum(versions(with_budget)) < sum(versions(without))
    for step, rollouts in enumerate(with_budget):  # exact submission staleness holds
        submitted = max(0, step - LAG)
        assert all(min(vs) >= submitted and max(vs) <= step for *_, vs in rollouts)


def test_at_lag_0_the_budget_changes_nothing():
    """One batch in flight: no later batch to step, so the window closes as without a budget."""
    assert run_training(4, timing_seed=1, lag=0) == run_training(0, timing_seed=None, lag=0)
