"""Scheduling behaviour of ``ContinuousBatchingScheduler`` over a fake step executor.

The fake executor "samples" token = 2 + (seed + position) % 7, or EOS at a position chosen per
seed, so every expectation below can be computed by hand.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.inference.protocol import EngineError, InvalidInferenceRequest
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.wire import SamplingParams

EOS = 1


def sampling(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


async def running(engine: ContinuousBatchingScheduler):
    engine.start()
    engine.resume()
    return engine


def make_engine(steps=None, max_requests=4, version=lambda: 0, **kw) -> ContinuousBatchingScheduler:
    steps = steps or FakeSteps()
    return ContinuousBatchingScheduler(
        steps, SchedulerConfig(max_requests=max_requests, max_seq_len=32, **kw), version
    )


def test_generates_until_max_tokens_or_eos():
    steps = FakeSteps(eos_at={5: 4})

    async def run():
        engine = await running(make_engine(steps))
        try:
            return await asyncio.gather(
                engine.generate([2, 3], sampling(4), seed=5),  # EOS sampled at position 4
                engine.generate([2, 3], sampling(4), seed=6),
            )
        finally:
            await engine.aclose()

    stopped, full = asyncio.run(run())
    assert stopped.tokens == [2 + (5 + 2) % 7, 2 + (5 + 3) % 7, EOS]
    assert stopped.finish_reason == "stop"
    assert full.tokens == [2 + (6 + p) % 7 for p in (2, 3, 4, 5)]
    assert full.finish_reason == "length"
    assert full.logprobs == pytest.approx([-0.2, -0.3, -0.4, -0.5])


@pytest.mark.parametrize("extra_stop", [False, True], ids=["eos", "extra-stop-id"])
def test_ignore_eos_generates_the_whole_budget_past_stop_tokens(extra_stop):
    steps = FakeSteps(eos_at={5: 4})
    config = dict(eos_id=0, extra_stop_ids=(EOS,)) if extra_stop else {}

    async def run():
        engine = await running(make_engine(steps, **config))
        try:
            return await engine.generate(
                [2, 3], SamplingParams(max_tokens=4, ignore_eos=True), seed=5
            )
        finally:
            await engine.aclose()

    out = asyncio.run(run())
    assert out.tokens == [2 + (5 + 2) % 7, 2 + (5 + 3) % 7, EOS, 2 + (5 + 5) % 7]
    assert out.finish_reason == "length"


def test_counters_add_up_the_steps_rows_and_tokens_of_the_run():
    """Two requests admitted together, one stopping at its third token: steps of 2, 2, 2, 1 rows
    (the trainer logs these per window: engine_steps, engine_rows_per_step, ...)."""
    steps = FakeSteps(eos_at={5: 4})

    async def run():
        engine = await running(make_engine(steps))
        try:
            await asyncio.gather(
                engine.generate([2, 3], sampling(4), seed=5),
                engine.generate([2, 3], sampling(4), seed=6),
            )
            return engine.counters
        finally:
            await engine.aclose()

    counters = asyncio.run(run())
    assert (counters.steps, counters.rows, counters.generated_tokens) == (4, 7, 7)
    assert [len(plan.rows[0]) for plan in steps.plans] == [2, 2, 2, 1]
    assert counters.step_seconds > 0


def test_prompt_is_fed_once_then_one_token_per_step():
    steps = FakeSteps()

    async def run():
        engine = await running(make_engine(steps))
        try:
            await engine.generate([2, 3, 4], sampling(3), seed=9)
        finally:
            await engine.aclose()

    asyncio.run(run())
    rows = [plan.rows[0][0] for plan in steps.plans]
    assert [r.tokens for r in rows] == [(2, 3, 4), (2 + (9 + 3) % 7,), (2 + (9 + 4) % 7,)]
    assert [r.start for r in rows] == [0, 3, 4]
    assert [r.seed for r in rows] == [9, 9, 9]


def test_continuous_batching_admits_new_requests_as_slots_free():
    steps = FakeSteps()

    async def run():
        engine = await running(make_engine(steps, max_requests=2))
        try:
            return await asyncio.gather(
                *(engine.generate([2], sampling(n), seed=s) for s, n in enumerate([1, 3, 2, 2, 1]))
            )
        finally:
            await engine.aclose()

    outs = asyncio.run(run())
    assert [len(o.tokens) for o in outs] == [1, 3, 2, 2, 1]
    widths = [len(plan.rows[0]) for plan in steps.plans]
    assert max(widths) == 2
    # Request 2 joins (its first row, start 0) in the step after request 0 finished, next to request
    # 1 which is decoding: prefill and decode rows share a step.
    second = steps.plans[1].rows[0]
    assert sorted(r.start == 0 for r in second) == [False, True]
    assert sum(widths) == 1 + 3 + 2 + 2 + 1  # one row per generated token, no idle slots


def test_nothing_steps_while_suspended():
    steps = FakeSteps()

    async def run():
        engine = make_engine(steps)
        engine.start()  # suspended
        task = asyncio.ensure_future(engine.generate([2], sampling(2), seed=1))
        await asyncio.sleep(0.05)
        assert steps.plans == [] and not task.done()
        engine.resume()
        out = await asyncio.wait_for(task, 1)
        engine.suspend()
        again = asyncio.ensure_future(engine.generate([2], sampling(2), seed=2))
        await asyncio.sleep(0.05)
        assert len(steps.plans) == 2 and not again.done()
        engine.resume()
        await asyncio.wait_for(again, 1)
        await engine.aclose()
        return out

    assert len(asyncio.run(run()).tokens) == 2


def test_keyed_requests_are_admitted_in_key_order_not_arrival_order():
    steps = FakeSteps()

    async def run():
        engine = make_engine(steps, max_requests=1)
        engine.start()
        keys = [(1, 0, 0), (0, 1, 1), (0, 1, 0), (0, 0, 2)]
        tasks = [
            asyncio.ensure_future(engine.generate([2], sampling(1), seed=10 + i, key=k))
            for i, k in enumerate(keys)
        ]
        await asyncio.sleep(0)  # all queued before the engine may step
        engine.resume()
        await asyncio.gather(*tasks)
        await engine.aclose()

    asyncio.run(run())
    seeds = [plan.rows[0][0].seed for plan in steps.plans]
    assert seeds == [13, 12, 11, 10]  # keys (0,0,2) < (0,1,0) < (0,1,1) < (1,0,0)


def test_barrier_waits_for_announced_requests():
    steps = FakeSteps()

    async def run():
        engine = await running(make_engine(steps))
        engine.expect_group(0, 0, 2)
        first = asyncio.ensure_future(engine.generate([2], sampling(1), seed=1, key=(0, 0, 0)))
        await asyncio.sleep(0.05)
        assert steps.plans == []  # one of two announced requests is missing
        second = asyncio.ensure_future(engine.generate([2], sampling(1), seed=2, key=(0, 0, 1)))
        await asyncio.wait_for(asyncio.gather(first, second), 1)
        # group_done withdraws what was announced and never sent
        engine.expect_group(0, 1, 3)
        third = asyncio.ensure_future(engine.generate([2], sampling(1), seed=3, key=(0, 1, 0)))
        await asyncio.sleep(0.05)
        assert not third.done()
        engine.group_done(0, 1)
        await asyncio.wait_for(third, 1)
        await engine.aclose()

    asyncio.run(run())
    assert [len(p.rows[0]) for p in steps.plans] == [2, 1]


def test_barrier_times_out_with_a_warning_instead_of_hanging(caplog):
    async def run():
        engine = await running(make_engine(barrier_timeout_s=0.1))
        engine.expect_group(0, 0, 5)
        out = await asyncio.wait_for(
            engine.generate([2], sampling(1), seed=1, key=(0, 0, 0)), timeout=2
        )
        await engine.aclose()
        return out

    with caplog.at_level(logging.WARNING):
        assert len(asyncio.run(run()).tokens) == 1
    assert "did not arrive" in caplog.text and "(0, 0)" in caplog.text


def test_window_target_stops_keyed_work_of_later_batches_but_not_unkeyed():
    steps = FakeSteps()

    async def run():
        engine = await running(make_engine(steps))
        engine.await_batch(0)
        later = asyncio.ensure_future(engine.generate([2], sampling(2), seed=1, key=(1, 0, 0)))
        await asyncio.sleep(0.05)
        assert steps.plans == []  # batch 0 has no work: batch 1 must not advance
        unkeyed = await asyncio.wait_for(engine.generate([2], sampling(2), seed=2), 1)
        assert not later.done()
        # Work of batch 0 arrives: keyed rows of batch 1 step alongside it until it finishes.
        await engine.generate([2], sampling(1), seed=3, key=(0, 0, 0))
        assert not later.done()
        engine.await_batch(1)
        await asyncio.wait_for(later, 1)
        await engine.aclose()
        return unkeyed

    assert len(asyncio.run(run()).tokens) == 2
    assert [[(r.seed, r.start) for r in p.rows[0]] for p in steps.plans[:2]] == [[(2, 0)], [(2, 1)]]


def test_without_the_window_target_later_batches_step_while_the_awaited_one_has_no_work():
    steps = FakeSteps()

    async def run():
        engine = await running(make_engine(steps, window_target=False))
        engine.await_batch(0)  # batch 0 has no work (its rewards are being computed)
        out = await asyncio.wait_for(engine.generate([2], sampling(2), seed=1, key=(1, 0, 0)), 1)
        await engine.aclose()
        return out

    assert asyncio.run(run()).tokens == [2 + (1 + p) % 7 for p in (1, 2)]
    assert [[(r.seed, r.start) for r in p.rows[0]] for p in steps.plans] == [[(1, 0)], [(1, 1)]]


def test_without_the_window_target_announced_requests_do_not_hold_the_others():
    steps = FakeSteps()

    async def run():
        engine = await running(make_engine(steps, window_target=False))
        engine.expect_group(2, 0, 3)  # a new batch whose requests are still being built
        engine.await_batch(0)
        out = await asyncio.wait_for(engine.generate([2], sampling(2), seed=1, key=(1, 0, 0)), 1)
        await engine.aclose()
        return out

    assert asyncio.run(run()).tokens == [2 + (1 + p) % 7 for p in (1, 2)]


def test_step_failure_fails_pending_and_later_requests():
    steps = FakeSteps()
    steps.fail_on_step = 1

    async def run():
        engine = await running(make_engine(steps))
        results = await asyncio.gather(
            engine.generate([2], sampling(4), seed=1),
            engine.generate([2], sampling(4), seed=2),
            return_exceptions=True,
        )
        with pytest.raises(EngineError):
            await engine.generate([2], sampling(1), seed=3)
        await engine.aclose()
        return results

    results = asyncio.run(run())
    assert all(isinstance(r, EngineError) for r in results)
    assert isinstance(results[0].__cause__, RuntimeError)
    assert results[0].__cause__ is results[1].__cause__  # the step's own exception
    assert results[0] is not results[1]  # one instance per request: tracebacks do not pile up
    assert "boom in forward" in str(results[0])


def test_cancelled_requests_free_their_slot():
    steps = FakeSteps()

    async def run():
        engine = make_engine(steps, max_requests=1)
        engine.start()
        hog = asyncio.ensure_future(engine.generate([2], sampling(20), seed=1))
        engine.resume()
        while not steps.plans:
            await asyncio.sleep(0)
        hog.cancel()
        out = await asyncio.wait_for(engine.generate([2], sampling(2), seed=2), 1)
        await engine.aclose()
        return out

    assert len(asyncio.run(run()).tokens) == 2


@pytest.mark.parametrize(
    "prompt, max_tokens",
    [pytest.param([2] * 30, 3, id="too-long"), pytest.param([], 1, id="empty-prompt")],
)
def test_requests_that_cannot_fit_are_invalid(prompt, max_tokens):
    async def run():
        engine = await running(make_engine())
        try:
            await engine.generate(prompt, sampling(max_tokens), seed=1)
        finally:
            await engine.aclose()

    with pytest.raises(InvalidInferenceRequest, match="max_seq_len=32"):
        asyncio.run(run())


def test_requests_spread_over_data_parallel_replicas():
    steps = FakeSteps(num_replicas=2)

    async def run():
        engine = await running(make_engine(steps, max_requests=2))
        outs = await asyncio.gather(*(engine.generate([2], sampling(3), seed=s) for s in range(4)))
        await engine.aclose()
        return outs

    outs = asyncio.run(run())
    assert [o.tokens for o in outs] == [[2 + (s + p) % 7 for p in (1, 2, 3)] for s in range(4)]
    first = steps.plans[0]
    assert [len(r) for r in first.rows] == [2, 2]


def test_each_token_records_the_policy_version_of_its_step():
    version = [0]
    steps = FakeSteps()
    original = steps.step

    def step_and_update(plan):
        out = original(plan)
        version[0] += 1  # the "trainer" updates between engine steps
        return out

    steps.step = step_and_update

    async def run():
        engine = await running(make_engine(steps, version=lambda: version[0] - 1))
        out = await engine.generate([2], sampling(3), seed=1)
        await engine.aclose()
        return out

    assert asyncio.run(run()).policy_versions == [0, 1, 2]


def test_a_closed_engine_refuses_new_requests_at_once():
    async def run():
        engine = await running(make_engine())
        await engine.aclose()
        await asyncio.wait_for(engine.generate([2], sampling(1), seed=1), timeout=1)

    with pytest.raises(EngineError, match="shut down"):
        asyncio.run(run())


def test_aclose_completes_when_a_wakeup_races_the_cancellation():
    """A wakeup just before aclose() must not swallow the loop's cancellation (Python 3.11's
    wait_for with a timeout did, when its inner wait had completed but it had not resumed)."""

    async def run():
        for ticks in range(4):  # cancel 0..3 loop iterations after the wakeup
            engine = make_engine()
            engine.start()
            engine.resume()
            engine.expect_group(0, 0, 2)
            await asyncio.sleep(0.001)  # the loop now waits at the barrier (with a timeout)
            engine.group_done(0, 0)  # sets the wakeup event
            for _ in range(ticks):
                await asyncio.sleep(0)
            await asyncio.wait_for(engine.aclose(), timeout=2)

    asyncio.run(run())
