"""Multi-turn scheduling of ``ContinuousBatchingScheduler``: a request sent with ``continued``
makes the engine wait for the rollout's next turn (or its end), so later turns join at fixed steps.

Same fake executor as ``test_scheduler.py``: token = 2 + (seed + position) % 7.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.wire import SamplingParams


def sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def make_engine(steps: FakeSteps, **kw) -> ContinuousBatchingScheduler:
    engine = ContinuousBatchingScheduler(
        steps, SchedulerConfig(max_requests=4, max_seq_len=32, **kw), lambda: 0
    )
    engine.start()
    engine.resume()
    return engine


def two_rollouts(delay_s: float) -> list:
    """Rollout 0 takes two turns (the environment answers after ``delay_s``); rollout 1 decodes
    5 tokens meanwhile. Returns the engine's step plans as (seed, start, tokens) rows."""
    steps = FakeSteps()

    async def rollout0(engine):
        first = await engine.generate([2, 3], sampling(1), seed=10, key=(0, 0, 0), continued=True)
        await asyncio.sleep(delay_s)  # the environment computes its answer
        history = [2, 3, *first.tokens, 4]
        return await engine.generate(history, sampling(2), seed=11, key=(0, 0, 0))

    async def run():
        engine = make_engine(steps)
        engine.expect_group(0, 0, 2)
        try:
            await asyncio.gather(
                rollout0(engine), engine.generate([2], sampling(5), seed=20, key=(0, 0, 1))
            )
        finally:
            await engine.aclose()

    asyncio.run(run())
    return [[(r.seed, r.start, r.tokens) for r in plan.rows[0]] for plan in steps.plans]


def test_the_next_turn_joins_at_the_same_step_however_long_the_environment_takes():
    plans = two_rollouts(0.0)
    assert plans == two_rollouts(0.05)
    # Step 0: both prompts. Step 1: rollout 1 decodes and the second turn (seed 11) joins with
    # its whole history, however late it arrived: the engine did not step without it.
    assert [seed for seed, _, _ in plans[0]] == [10, 20]
    assert sorted(seed for seed, _, _ in plans[1]) == [11, 20]
    second_turn = next(row for row in plans[1] if row[0] == 11)
    assert second_turn[1:] == (0, (2, 3, 2 + (10 + 2) % 7, 4))


def test_end_rollout_releases_the_wait():
    steps = FakeSteps()

    async def run():
        engine = make_engine(steps)
        other = asyncio.ensure_future(engine.generate([2], sampling(4), seed=2, key=(0, 0, 1)))
        await engine.generate([2], sampling(1), seed=1, key=(0, 0, 0), continued=True)
        stepped = len(steps.plans)
        await asyncio.sleep(0.05)
        assert len(steps.plans) == stepped and not other.done()  # waiting for the next turn
        assert engine.end_rollout((0, 0, 0)) is True
        assert engine.end_rollout((0, 0, 0)) is False  # nothing awaited any more
        await asyncio.wait_for(other, 1)
        await engine.aclose()

    asyncio.run(run())


def test_group_done_withdraws_the_turns_its_group_still_owed():
    steps = FakeSteps()

    async def run():
        engine = make_engine(steps)
        engine.expect_group(3, 1, 2)
        await asyncio.gather(
            engine.generate([2], sampling(1), seed=1, key=(3, 1, 0), continued=True),
            engine.generate([2], sampling(1), seed=2, key=(3, 1, 1), continued=True),
        )
        other = asyncio.ensure_future(engine.generate([2], sampling(2), seed=3, key=(3, 2, 0)))
        await asyncio.sleep(0.05)
        assert not other.done()
        engine.group_done(3, 1)  # e.g. the agent failed between turns
        await asyncio.wait_for(other, 1)
        await engine.aclose()

    asyncio.run(run())


def test_an_unusable_next_turn_still_releases_the_wait():
    async def run():
        engine = make_engine(FakeSteps())
        await engine.generate([2], sampling(1), seed=1, key=(0, 0, 0), continued=True)
        with pytest.raises(InvalidInferenceRequest):
            await engine.generate([2] * 40, sampling(1), seed=2, key=(0, 0, 0))
        out = await asyncio.wait_for(engine.generate([2], sampling(1), seed=3, key=(0, 1, 0)), 1)
        await engine.aclose()
        return out

    assert len(asyncio.run(run()).tokens) == 1


def test_unkeyed_requests_cannot_announce_a_next_turn():
    steps = FakeSteps()

    async def run():
        engine = make_engine(steps)
        await engine.generate([2], sampling(1), seed=1, continued=True)
        out = await asyncio.wait_for(engine.generate([2], sampling(2), seed=2, key=(0, 0, 0)), 1)
        await engine.aclose()
        return out

    assert len(asyncio.run(run()).tokens) == 2


def test_an_awaited_turn_keeps_its_batch_unfinished_for_the_window_target():
    steps = FakeSteps()

    async def run():
        engine = make_engine(steps)
        engine.await_batch(0)
        await engine.generate([2], sampling(1), seed=1, key=(0, 0, 0), continued=True)
        engine.expect_group(1, 0, 1)
        later = asyncio.ensure_future(engine.generate([2], sampling(1), seed=5, key=(1, 0, 0)))
        await asyncio.sleep(0.05)
        assert not later.done()  # batch 0 still owes a turn: batch 1 waits with it
        # Batch 0's next turn arrives: batch 1 may step alongside it.
        await engine.generate([2, 3, 4], sampling(1), seed=2, key=(0, 0, 0))
        await asyncio.wait_for(later, 1)
        await engine.aclose()

    asyncio.run(run())
    assert [sorted(r.seed for r in p.rows[0]) for p in steps.plans] == [[1], [2, 5]]


def test_a_next_turn_that_never_comes_times_out_with_a_warning(caplog):
    async def run():
        engine = make_engine(FakeSteps(), barrier_timeout_s=0.1)
        await engine.generate([2], sampling(1), seed=1, key=(0, 0, 0), continued=True)
        out = await asyncio.wait_for(engine.generate([2], sampling(1), seed=2, key=(0, 1, 0)), 2)
        await engine.aclose()
        return out

    with caplog.at_level(logging.WARNING):
        assert len(asyncio.run(run()).tokens) == 1
    assert "did not arrive" in caplog.text and "(0, 0, 0)" in caplog.text
