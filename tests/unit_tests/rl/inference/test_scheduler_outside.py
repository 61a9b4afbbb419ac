"""Unkeyed ("outside") requests in the slots reserved for them (``SchedulerConfig.outside_slots``,
``slots.py``) under the deterministic schedule: answered within their token budget of engine
steps whatever the keyed work does, and never changing the keyed rows' steps."""

from __future__ import annotations

import asyncio

import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.inference.slots import SlotPools
from megatron.rl.wire import SamplingParams


def make_engine(steps, outside_slots: int, max_requests: int = 2) -> ContinuousBatchingScheduler:
    config = SchedulerConfig(max_requests=max_requests, max_seq_len=32, outside_slots=outside_slots)
    return ContinuousBatchingScheduler(steps, config, lambda: 0)


def keyed_rows(steps: FakeSteps) -> list[list[tuple[int, int, int]]]:
    """Each plan's keyed rows as (slot, seed, start); outside rows have seeds >= 100 here."""
    plans = [[(r.slot, r.seed, r.start) for r in p.rows[0] if r.seed < 100] for p in steps.plans]
    return [p for p in plans if p]


async def outside_request(engine, seed: int, max_tokens: int = 3):
    """An unkeyed request's output and the engine steps from its arrival to its answer."""
    before = engine.counters.steps
    out = await engine.generate([5, 6], SamplingParams(max_tokens=max_tokens), seed=seed)
    return out, engine.counters.steps - before


def test_outside_request_is_answered_while_rollouts_fill_every_slot_and_are_held():
    """Two keyed requests of batch 1 hold both rollout slots and may not step (the trainer awaits
    batch 0, which has nothing left), a third waits for a slot: the outside request still takes
    exactly its 3 tokens' steps."""
    steps = FakeSteps()

    async def run():
        engine = make_engine(steps, outside_slots=1)
        engine.start()
        engine.resume()
        engine.await_batch(0)
        held = [
            asyncio.ensure_future(engine.generate([2], SamplingParams(max_tokens=4), i, (1, 0, i)))
            for i in range(3)
        ]
        await asyncio.sleep(0.01)
        out, waited = await asyncio.wait_for(outside_request(engine, seed=100), 2)
        assert not any(h.done() for h in held)
        engine.await_batch(1)
        await asyncio.wait_for(asyncio.gather(*held), 2)
        await engine.aclose()
        return out, waited

    out, waited = asyncio.run(run())
    assert len(out.tokens) == 3 and waited == 3
    assert {r.slot for p in steps.plans for r in p.rows[0] if r.seed == 100} == {2}


def test_outside_request_steps_at_the_barrier_without_admitting_keyed_work():
    steps = FakeSteps()

    async def run():
        engine = make_engine(steps, outside_slots=1)
        engine.start()
        engine.resume()
        engine.expect_group(0, 0, 2)  # one of two announced requests never comes in time
        first = asyncio.ensure_future(
            engine.generate([2], SamplingParams(max_tokens=2), 1, (0, 0, 0))
        )
        out, waited = await asyncio.wait_for(outside_request(engine, seed=100), 2)
        assert not first.done() and keyed_rows(steps) == []
        engine.group_done(0, 0)
        await asyncio.wait_for(first, 2)
        await engine.aclose()
        return out, waited

    out, waited = asyncio.run(run())
    assert len(out.tokens) == 3 and waited == 3


@pytest.mark.parametrize("outside", [0, 3], ids=["none", "three-outside-requests"])
def test_keyed_steps_are_the_same_with_and_without_outside_requests(outside):
    """The keyed rows of every step, their slots and the steps they share, are those of the run
    without outside traffic; outside rows never share a forward with keyed rows."""

    def run_with(outside_requests: int):
        steps = FakeSteps(eos_at={3: 4})

        async def run():
            engine = make_engine(steps, outside_slots=2)
            engine.start()
            engine.resume()
            engine.await_batch(0)
            engine.expect_group(0, 0, 3)
            extra = [
                asyncio.ensure_future(outside_request(engine, seed=100 + i, max_tokens=2 + i))
                for i in range(outside_requests)
            ]
            keyed = [
                engine.generate([2, 3], SamplingParams(max_tokens=5), seed=s, key=(0, 0, s))
                for s in range(3)
            ]
            outs = await asyncio.wait_for(asyncio.gather(*keyed, *extra), 5)
            await engine.aclose()
            return outs[:3]

        outs = asyncio.run(run())
        mixed = [p for p in steps.plans if len({r.seed >= 100 for r in p.rows[0]}) > 1]
        return [o.tokens for o in outs], keyed_rows(steps), mixed

    baseline_tokens, baseline_rows, _ = run_with(0)
    tokens, rows, mixed = run_with(outside)
    assert tokens == baseline_tokens and rows == baseline_rows
    assert mixed == []


def test_without_reserved_slots_outside_requests_wait_for_a_free_rollout_slot():
    steps = FakeSteps()

    async def run():
        engine = make_engine(steps, outside_slots=0, max_requests=1)
        engine.start()
        engine.resume()
        engine.await_batch(0)
        held = asyncio.ensure_future(
            engine.generate([2], SamplingParams(max_tokens=2), 1, (1, 0, 0))
        )
        outside = asyncio.ensure_future(outside_request(engine, seed=100))
        await asyncio.sleep(0.05)
        assert not outside.done()  # the only slot is held by batch 1's request
        engine.await_batch(1)
        await asyncio.wait_for(asyncio.gather(held, outside), 2)
        await engine.aclose()

    asyncio.run(run())


def test_slot_pools_keep_rollout_and_reserved_slots_apart():
    pools = SlotPools(num_replicas=2, keyed=2, outside=1, share=False)
    assert [pools.take_keyed() for _ in range(5)] == [(0, 0), (1, 0), (0, 1), (1, 1), None]
    assert [pools.take_outside() for _ in range(3)] == [(0, 2), (1, 2), None]
    pools.give_back(0, 1)
    assert pools.take_outside() is None and pools.take_keyed() == (0, 1)
    shared = SlotPools(num_replicas=1, keyed=1, outside=0, share=False)
    assert shared.share and shared.take_outside(reserved_only=True) is None
    assert shared.take_outside() == (0, 0)


@pytest.mark.parametrize(
    "outside, window_target, capacity",
    [
        pytest.param(3, True, 6, id="reserved-only"),
        pytest.param(0, True, 4, id="none-reserved-shares-rollout-slots"),
        pytest.param(3, False, 10, id="throughput-schedule-shares"),
    ],
)
def test_outside_capacity_counts_the_slots_an_unkeyed_request_may_take(
    outside, window_target, capacity
):
    """What the servers' queue admits at once (``FairQueue``'s slots), over two replicas."""
    config = SchedulerConfig(
        max_requests=2, max_seq_len=32, outside_slots=outside, window_target=window_target
    )
    engine = ContinuousBatchingScheduler(FakeSteps(num_replicas=2), config, lambda: 0)
    assert engine.outside_capacity == capacity
