"""The reward-wait budget (``WindowBudget``), on its own and inside ``ContinuousBatchingScheduler``.

Same fake executor as ``test_scheduler.py``: token = 2 + (seed + position) % 7, so each step's
rows, written as (seed, start), can be computed by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.inference.protocol import EngineError
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.inference.window_budget import WindowBudget
from megatron.rl.wire import SamplingParams


@pytest.fixture
def steps() -> FakeSteps:
    return FakeSteps()


@contextlib.asynccontextmanager
async def budget_engine(
    steps: FakeSteps, reward_wait_steps: int, max_requests: int = 4
) -> AsyncIterator[ContinuousBatchingScheduler]:
    """A started, resumed scheduler over ``steps`` with a reward-wait budget; closed on exit."""
    config = SchedulerConfig(
        max_requests=max_requests, max_seq_len=32, reward_wait_steps=reward_wait_steps
    )
    engine = ContinuousBatchingScheduler(steps, config, lambda: 0)
    engine.start()
    engine.resume()
    try:
        yield engine
    finally:
        await engine.aclose()


def keyed_plans(steps: FakeSteps) -> list[list[tuple[int, int]]]:
    """Each step's rows as (seed, start)."""
    return [[(r.seed, r.start) for r in p.rows[0]] for p in steps.plans]


async def queued(engine: ContinuousBatchingScheduler, *requests) -> list[asyncio.Future]:
    """Announce and send (max_tokens, seed, key) requests, one per group, as agents do."""
    for _, _, key in requests:
        engine.expect_group(key[0], key[1], 1)
    futures = [
        asyncio.ensure_future(
            engine.generate([2], SamplingParams(max_tokens=n), seed=seed, key=key)
        )
        for n, seed, key in requests
    ]
    await asyncio.sleep(0)
    return futures


# ----------------------------------------------------------------- WindowBudget on its own


def test_keyed_work_steps_while_the_awaited_batch_generates_then_for_the_budget():
    budget = WindowBudget(reward_wait_steps=2)
    unfinished = {0}
    budget.await_batch(0)
    assert budget.keyed_work_allowed(unfinished.__contains__)
    assert not budget.counts_next_step(unfinished.__contains__, lambda: True)
    unfinished.clear()  # batch 0 has finished generating: the budget starts counting
    for _ in range(2):
        assert budget.keyed_work_allowed(unfinished.__contains__)
        assert budget.counts_next_step(unfinished.__contains__, lambda: True)
        budget.count_step()
    assert budget.spent
    assert not budget.keyed_work_allowed(unfinished.__contains__)
    assert not budget.counts_next_step(unfinished.__contains__, lambda: True)


def test_the_budget_is_spent_at_once_when_no_keyed_work_is_left():
    budget = WindowBudget(reward_wait_steps=5)
    budget.await_batch(0)
    assert not budget.counts_next_step(lambda b: False, lambda: False)
    assert budget.spent and not budget.keyed_work_allowed(lambda b: False)


def test_without_a_window_target_keyed_work_always_steps_and_nothing_is_counted():
    budget = WindowBudget(reward_wait_steps=3, window_target=False)
    budget.await_batch(0)
    assert not budget.enabled
    assert budget.keyed_work_allowed(lambda b: False)
    assert not budget.counts_next_step(lambda b: False, lambda: True)


def test_awaiting_another_batch_wakes_the_waiters_of_the_previous_window():
    async def run():
        budget = WindowBudget(reward_wait_steps=3)
        budget.await_batch(0)
        waiter = asyncio.ensure_future(budget.wait_spent(0, failed=lambda: False))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        budget.await_batch(None)  # a drain before a checkpoint: nobody waits for batch 0 now
        await asyncio.wait_for(waiter, 1)
        assert not budget.spent  # the new window has its own, full budget

    asyncio.run(run())


# ----------------------------------------------------------------- inside the scheduler


def test_reward_wait_budget_steps_later_batches_while_rewards_are_pending(steps):
    async def run():
        async with budget_engine(steps, reward_wait_steps=3) as engine:
            engine.await_batch(0)
            awaited, later = await queued(engine, (1, 0, (0, 0, 0)), (10, 1, (1, 0, 0)))
            await awaited
            await asyncio.sleep(0.05)  # batch 0's rewards are computed: the budget is taken
            plans = keyed_plans(steps)
            await asyncio.wait_for(engine.window_spent(0), 1)
            assert not later.done()
            engine.await_batch(1)
            await asyncio.wait_for(later, 1)
            return plans

    # One step with batch 0 (which finishes), then exactly 3 steps of batch 1, then nothing.
    assert asyncio.run(run()) == [[(0, 0), (1, 0)], [(1, 1)], [(1, 2)], [(1, 3)]]
    assert len(steps.plans) == 10  # batch 1's other 6 tokens, once it is awaited


def test_window_spent_waits_for_the_budget_when_rewards_are_instant(steps):
    original = steps.step

    def slow_step(plan):
        time.sleep(0.01)
        return original(plan)

    steps.step = slow_step

    async def run():
        async with budget_engine(steps, reward_wait_steps=4) as engine:
            engine.await_batch(0)
            awaited, later = await queued(engine, (1, 0, (0, 0, 0)), (10, 1, (1, 0, 0)))
            await awaited  # the rewards are instant: the trainer asks at once
            await asyncio.wait_for(engine.window_spent(0), 1)
            spent_at = len(steps.plans)
            await asyncio.sleep(0.05)
            assert len(steps.plans) == spent_at and not later.done()
            later.cancel()

    asyncio.run(run())
    assert keyed_plans(steps) == [[(0, 0), (1, 0)], [(1, 1)], [(1, 2)], [(1, 3)], [(1, 4)]]


def test_the_budget_ends_when_later_batches_have_nothing_left_to_step(steps):
    async def run():
        async with budget_engine(steps, reward_wait_steps=10) as engine:
            engine.await_batch(0)
            awaited, later = await queued(engine, (1, 0, (0, 0, 0)), (2, 1, (1, 0, 0)))
            await asyncio.wait_for(engine.window_spent(0), 1)
            assert awaited.done() and later.done()
            # The budget is over: a request of batch 2 sent afterwards does not step in this
            # window.
            (late,) = await queued(engine, (2, 2, (2, 0, 0)))
            await asyncio.sleep(0.05)
            assert not late.done()
            engine.await_batch(2)
            await asyncio.wait_for(late, 1)

    asyncio.run(run())
    assert keyed_plans(steps) == [[(0, 0), (1, 0)], [(1, 1)], [(2, 0)], [(2, 1)]]


@pytest.mark.parametrize("env_s", [0.0, 0.05], ids=["instant-env", "slow-env"])
def test_a_later_turn_of_a_later_batch_takes_the_same_budget_steps_however_late(steps, env_s):
    """The budget waits at the barrier for a later batch's next turn: the environment's timing
    moves no step."""

    async def later_rollout(engine):
        first = await engine.generate(
            [2], SamplingParams(max_tokens=2), seed=1, key=(1, 0, 0), continued=True
        )
        await asyncio.sleep(env_s)
        history = [2, *first.tokens, 4]
        return await engine.generate(history, SamplingParams(max_tokens=5), seed=11, key=(1, 0, 0))

    async def run():
        async with budget_engine(steps, reward_wait_steps=4) as engine:
            engine.expect_group(0, 0, 1)
            engine.expect_group(1, 0, 1)
            engine.await_batch(0)
            later = asyncio.ensure_future(later_rollout(engine))
            await asyncio.sleep(0)
            await engine.generate([2], SamplingParams(max_tokens=1), seed=0, key=(0, 0, 0))
            await asyncio.wait_for(engine.window_spent(0), 1)
            assert not later.done()
            later.cancel()

    asyncio.run(run())
    assert keyed_plans(steps) == [[(0, 0), (1, 0)], [(1, 1)], [(11, 0)], [(11, 4)], [(11, 5)]]


def test_steps_without_keyed_rows_do_not_spend_the_budget(steps):
    async def run():
        async with budget_engine(steps, reward_wait_steps=2, max_requests=1) as engine:
            unkeyed = asyncio.ensure_future(
                engine.generate([2], SamplingParams(max_tokens=6), seed=5)
            )
            while not steps.plans:
                await asyncio.sleep(0)
            (later,) = await queued(engine, (5, 1, (1, 0, 0)))  # waits for the unkeyed slot
            engine.await_batch(0)  # batch 0 finished generating in an earlier window
            await asyncio.wait_for(engine.window_spent(0), 1)
            assert unkeyed.done() and not later.done()
            later.cancel()

    asyncio.run(run())
    # The unkeyed request's 6 steps, then the budget: 2 steps of batch 1.
    assert keyed_plans(steps) == [[(5, s)] for s in range(6)] + [[(1, 0)], [(1, 1)]]


def test_window_spent_raises_when_the_engine_fails_instead_of_hanging(steps):
    steps.fail_on_step = 2

    async def run():
        async with budget_engine(steps, reward_wait_steps=5) as engine:
            engine.await_batch(0)
            awaited, later = await queued(engine, (1, 0, (0, 0, 0)), (9, 1, (1, 0, 0)))
            try:
                await asyncio.wait_for(engine.window_spent(0), 1)
            finally:
                await asyncio.gather(awaited, later, return_exceptions=True)

    with pytest.raises(EngineError, match="boom in forward"):
        asyncio.run(run())


def test_without_a_budget_window_spent_returns_at_once(steps):
    async def run():
        engine = ContinuousBatchingScheduler(steps, SchedulerConfig(), lambda: 0)
        engine.await_batch(0)  # not even started: nothing to wait for
        await asyncio.wait_for(engine.window_spent(0), 0.01)

    asyncio.run(run())


def test_a_negative_budget_is_rejected():
    with pytest.raises(ValueError, match="reward_wait_steps"):
        SchedulerConfig(reward_wait_steps=-1)
    with pytest.raises(ValueError, match="reward_wait_steps"):
        WindowBudget(reward_wait_steps=-1)
