"""The forced-lag generator across a checkpoint: ``drain`` finishes every submitted batch without
consuming it, and a generator resumed from that state continues the uninterrupted run exactly."""

from __future__ import annotations

import asyncio

import pytest
from grpo_testing.generator import GROUPS, FailingAgent, RandomDelayAgent, make_generator

from megatron.rl.inference.protocol import EngineError
from megatron.rl.rollout.generator import PipelineState, RolloutBatch
from megatron.rl.wire import GroupedRolloutRequest


async def train_with_checkpoint(
    lag: int, steps: int, save_at: int, seed: int
) -> tuple[list[RolloutBatch], PipelineState, list[GroupedRolloutRequest]]:
    """Train ``steps`` steps, draining (as a checkpoint does) after ``save_at`` steps."""
    agent, version = RandomDelayAgent(seed=seed), [0]
    gen = make_generator(agent, lag, version)
    batches, state = [], None
    gen.start()
    try:
        for step in range(steps):
            batches.append(await gen.next_batch())
            version[0] = step + 1
            if step + 1 == save_at:
                state = await gen.drain()
    finally:
        await gen.aclose()
    return batches, state, agent.requests


async def resume_and_train(
    lag: int, state: PipelineState, steps: int, seed: int
) -> tuple[list[RolloutBatch], list[GroupedRolloutRequest]]:
    """A new generator (a new process) restored from ``state``, trained up to ``steps``."""
    agent, version = RandomDelayAgent(seed=seed + 100), [state.next_batch_id]
    gen = make_generator(agent, lag, version, first_batch_id=state.next_batch_id, resume_from=state)
    batches = []
    gen.start()
    try:
        for step in range(state.next_batch_id, steps):
            batches.append(await gen.next_batch())
            version[0] = step + 1
    finally:
        await gen.aclose()
    return batches, agent.requests


@pytest.mark.parametrize("lag", [0, 1, 2, 4])
def test_drain_finishes_every_submitted_batch_and_keeps_them_unconsumed(lag):
    _, state, requests = asyncio.run(train_with_checkpoint(lag, steps=5, save_at=5, seed=lag))
    assert state.next_batch_id == 5 and state.submitted == 5 + lag
    assert [(g.batch_id, g.index_in_batch) for g in state.groups] == [
        (b, i) for b in range(5, 5 + lag) for i in range(GROUPS)
    ]
    for g in state.groups:  # submitted at version batch - lag, as the contract says
        assert {r.submission_policy_version for r in g.rollouts} == {g.batch_id - lag}
    assert state == PipelineState.model_validate_json(state.model_dump_json())  # lossless


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_resumed_generator_continues_the_uninterrupted_one_exactly(lag):
    """Same batches, same submissions, same permits: the lag contract survives a restart."""
    full, state, full_requests = asyncio.run(train_with_checkpoint(lag, 12, save_at=6, seed=lag))
    resumed, resumed_requests = asyncio.run(resume_and_train(lag, state, 12, seed=lag))

    assert [b.batch_id for b in resumed] == list(range(6, 12))
    assert [b.groups for b in resumed] == [b.groups for b in full[6:]]
    for step, batch in zip(range(6, 12), resumed):
        versions = {r.submission_policy_version for g in batch.groups for r in g.rollouts}
        assert versions == {step - lag}

    # The resumed process sends exactly the requests the uninterrupted one sent after the drain
    # (for the batches both consumed: later ones may be cancelled before their agent starts).
    def sent(requests):
        return sorted(
            (r for r in requests if 6 + lag <= r.batch_id < 12),
            key=lambda r: (r.batch_id, r.index_in_batch),
        )

    assert sent(resumed_requests) == sent(full_requests)
    assert len(sent(resumed_requests)) == max(0, 6 - lag) * GROUPS


def test_resume_rejects_a_state_that_was_not_drained_or_another_lag():
    _, state, _ = asyncio.run(train_with_checkpoint(2, steps=4, save_at=4, seed=0))
    agent, version = RandomDelayAgent(), [4]
    with pytest.raises(ValueError, match="forced_lag"):
        make_generator(agent, 3, version, first_batch_id=4, resume_from=state)
    partial = state.model_copy(update={"groups": state.groups[:-1]})
    with pytest.raises(ValueError, match="must be complete"):
        make_generator(agent, 2, version, first_batch_id=4, resume_from=partial)


def test_drain_raises_a_worker_failure():
    async def run():
        gen = make_generator(FailingAgent(fail_at=(2, 1)), 2, [0])
        gen.start()
        try:
            with pytest.raises(EngineError, match="the engine failed"):
                await asyncio.wait_for(gen.drain(), timeout=5)
        finally:
            await gen.aclose()

    asyncio.run(run())
