"""The forced-lag contract of ``GroupedRolloutGenerator`` (docs/architecture.md, points 1-4).

The fake agent (``grpo_testing.generator``) finishes groups after random delays, so later groups
and later batches often finish first; the trainer side is simulated by a loop that bumps the
policy version after each consumed batch, exactly as the training loop does. Draining and
resuming across a checkpoint: ``test_generator_resume.py``.
"""

from __future__ import annotations

import asyncio
import random
import time
import traceback

import pytest
from grpo_testing.generator import (
    GROUP_SIZE,
    GROUPS,
    FailingAgent,
    RandomDelayAgent,
    make_generator,
    make_group,
    train_loop,
)

from megatron.rl.agent.api import Agent
from megatron.rl.inference.protocol import EngineError
from megatron.rl.rollout.generator import (
    RolloutConfig,
)
from megatron.rl.wire import GroupedRolloutRequest


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_batches_arrive_in_submission_order_whatever_order_groups_finish(lag):
    agent = RandomDelayAgent(seed=lag)
    version = [0]
    batches = asyncio.run(train_loop(make_generator(agent, lag, version), version, steps=12))

    assert [b.batch_id for b in batches] == list(range(12))
    for b in batches:
        assert [g.index_in_batch for g in b.groups] == list(range(GROUPS))
        assert all(g.batch_id == b.batch_id for g in b.groups)
    # The test is only meaningful if completions really were out of order.
    assert agent.finished != sorted(agent.finished)
    if lag > 0:
        out_of_batch_order = any(
            later[0] < earlier[0] for earlier, later in zip(agent.finished, agent.finished[1:])
        )
        assert out_of_batch_order


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_step_s_trains_only_on_rollouts_submitted_at_step_s_minus_lag(lag):
    version = [0]
    batches = asyncio.run(train_loop(make_generator(RandomDelayAgent(), lag, version), version, 10))

    for step, batch in enumerate(batches):
        versions = {r.submission_policy_version for g in batch.groups for r in g.rollouts}
        assert versions == {max(0, step - lag)}, f"step {step}"


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_gate_never_holds_more_than_lag_plus_one_batches(lag):
    agent = RandomDelayAgent(max_delay=0.002)
    version = [0]
    gen = make_generator(agent, lag, version)
    held: list[int] = []

    async def slow_trainer():
        gen.start()
        consumed = 0
        try:
            for step in range(8):
                batch = await gen.next_batch()
                consumed += 1
                # A slow training step: the generator has all the time it wants to run ahead.
                for _ in range(5):
                    await asyncio.sleep(0.004)
                    submitted = len({r.batch_id for r in agent.requests})
                    held.append(submitted - consumed + 1)  # +1: the batch being trained on
                assert batch.in_flight <= lag + 1
                version[0] = step + 1
        finally:
            await gen.aclose()

    asyncio.run(slow_trainer())
    assert max(held) == lag + 1


def test_lag_zero_equals_a_synchronous_reference_exactly():
    """L=0: each batch is submitted at the current version, as a synchronous loop would."""

    class VersionedAgent(Agent):
        async def group_rollout(self, request, inference):
            await asyncio.sleep(random.random() * 0.003)
            return make_group(request, salt=request.submission_policy_version * 11)

    agent = VersionedAgent("v")
    version = [0]
    streamed = asyncio.run(train_loop(make_generator(agent, 0, version), version, steps=6))

    async def synchronous_reference():
        batches = []
        for step in range(6):
            groups = []
            for index in range(GROUPS):
                request = GroupedRolloutRequest(
                    batch_id=step,
                    index_in_batch=index,
                    groups_in_batch=GROUPS,
                    group_size=GROUP_SIZE,
                    seed=1,
                    submission_policy_version=step,  # the weights after `step` updates
                )
                groups.append(await agent.group_rollout(request, None))
            batches.append(groups)
        return batches

    assert [b.groups for b in streamed] == asyncio.run(synchronous_reference())


def test_inference_failure_reaches_the_trainer_with_its_traceback():
    version = [0]
    gen = make_generator(FailingAgent(fail_at=(3, 2)), lag=2, version=version)

    async def run():
        return await asyncio.wait_for(train_loop(gen, version, steps=20), timeout=5)

    with pytest.raises(EngineError, match="the engine failed") as info:
        asyncio.run(run())
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "raise_engine_failure" in frames


def test_environment_exception_masks_its_group_and_is_logged_once(caplog):
    version = [0]
    agent = FailingAgent(fail_at=(3, 2), environment_bug=True)
    gen = make_generator(agent, lag=2, version=version)
    batches = asyncio.run(asyncio.wait_for(train_loop(gen, version, steps=6), timeout=5))
    failed = batches[3].groups[2].rollouts
    assert all(
        r.is_placeholder and "ZeroDivisionError: bug in the agent" in r.error for r in failed
    )
    assert len(failed) == GROUP_SIZE and failed[0].submission_policy_version == 1
    others = [r for b in batches for g in b.groups for r in g.rollouts if r not in failed]
    assert not any(r.is_placeholder for r in others)
    logged = [r for r in caplog.records if "raised on group 3/2" in r.getMessage()]
    assert len(logged) == 1 and "raise_environment_bug" in logged[0].getMessage()


def test_failure_in_a_later_batch_does_not_wait_for_the_current_one():
    """Batch 0 never completes; a failure in batch 1 must still reach the trainer at once."""
    version = [0]
    gen = make_generator(FailingAgent(fail_at=(1, 0), hang_before=1), lag=1, version=version)

    async def run():
        gen.start()
        try:
            await asyncio.wait_for(gen.next_batch(), timeout=5)
        finally:
            await gen.aclose()

    start = time.monotonic()
    with pytest.raises(EngineError):
        asyncio.run(run())
    assert time.monotonic() - start < 2


def test_aclose_cancels_every_task_it_started():
    agent = RandomDelayAgent(max_delay=10.0)  # nothing finishes on its own
    version = [0]
    gen = make_generator(agent, lag=2, version=version)

    async def run():
        gen.start()
        await asyncio.sleep(0.05)
        assert len(agent.requests) == 3 * GROUPS  # batches 0..L submitted at start
        await gen.aclose()
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(run()) == []
    assert agent.cancelled == 3 * GROUPS


@pytest.mark.parametrize(
    "bad, message",
    [
        pytest.param("batch", "answered request", id="wrong-batch-id"),
        pytest.param("size", "returned 2 rollouts", id="wrong-group-size"),
    ],
)
def test_malformed_group_from_agent_is_an_error(bad, message):
    class BadAgent(Agent):
        async def group_rollout(self, request, inference):
            group = make_group(request)
            if bad == "batch":
                return group.model_copy(update={"batch_id": request.batch_id + 5})
            return group.model_copy(update={"rollouts": group.rollouts[:2]})

    version = [0]
    with pytest.raises(ValueError, match=message):
        asyncio.run(train_loop(make_generator(BadAgent("bad"), 0, version), version, steps=1))


def test_schedule_hints_reach_the_scheduler_in_order():
    class Recorder:
        def __init__(self):
            self.calls = []

        def expect_group(self, batch_id, index_in_batch, num_requests):
            self.calls.append(("expect", batch_id, index_in_batch, num_requests))

        def group_done(self, batch_id, index_in_batch):
            self.calls.append(("done", batch_id, index_in_batch))

        def await_batch(self, batch_id):
            self.calls.append(("await", batch_id))

        async def window_spent(self, batch_id):
            self.calls.append(("spent", batch_id))

    class AnnouncingAgent(RandomDelayAgent):
        def expected_requests(self, request):
            return request.group_size

        async def group_rollout(self, request, inference):
            recorder.calls.append(("run", request.batch_id, request.index_in_batch))
            return await super().group_rollout(request, inference)

    recorder = Recorder()
    version = [0]
    gen = make_generator(AnnouncingAgent(), lag=1, version=version, scheduler=recorder)
    asyncio.run(train_loop(gen, version, steps=3))

    calls = recorder.calls
    for b in range(3):
        for i in range(GROUPS):
            expect = calls.index(("expect", b, i, GROUP_SIZE))
            assert expect < calls.index(("run", b, i)) < calls.index(("done", b, i))
    awaits = [c for c in calls if c[0] == "await"]
    assert awaits == [("await", 0), ("await", 1), ("await", 2)]
    # A batch is handed over only after its window is spent, asked once all its groups are in.
    assert [c for c in calls if c[0] == "spent"] == [("spent", 0), ("spent", 1), ("spent", 2)]
    for b in range(3):
        last_done = max(calls.index(("done", b, i)) for i in range(GROUPS))
        assert calls.index(("await", b)) < calls.index(("spent", b))
        assert last_done < calls.index(("spent", b))
    # Batch b+1 is announced (submitted) only once the trainer asks for batch b (lag 1), after
    # batch b-1 was consumed, and before the engine is told to work on batch b.
    expect_2 = calls.index(("expect", 2, 0, GROUP_SIZE))
    assert max(calls.index(("done", 0, i)) for i in range(GROUPS)) < expect_2
    assert calls.index(("await", 0)) < expect_2 < calls.index(("await", 1))


def test_invalid_lag_is_rejected():
    with pytest.raises(ValueError, match="forced_lag"):
        RolloutConfig(forced_lag=-1, groups_per_batch=8, group_size=8, seed=1)
