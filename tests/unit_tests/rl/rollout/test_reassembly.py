"""``OrderedReassembly``: groups put in any order come out per batch in ``index_in_batch`` order."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from megatron.rl.rollout.reassembly import OrderedReassembly
from megatron.rl.wire import RolloutGroup, TokenRollout

GROUPS = 4


def group(batch_id: int, index: int) -> RolloutGroup:
    """A one-rollout group whose problem id names its place in the batch order."""
    rollout = TokenRollout(
        env_id="fake",
        problem_id=f"{batch_id}/{index}",
        prompt="p",
        completion="c",
        reward=0.0,
        tokens=[2, 3],
        generation_mask=[False, True],
        logprobs=[-0.5],
        policy_versions=[0],
        submission_policy_version=0,
    )
    return RolloutGroup(batch_id=batch_id, index_in_batch=index, rollouts=[rollout])


def places(groups: list[RolloutGroup]) -> list[tuple[int, int]]:
    return [(g.batch_id, g.index_in_batch) for g in groups]


@pytest.mark.parametrize("seed", range(6))
def test_batches_come_out_in_order_whatever_order_groups_finish(seed):
    """A consumer pops batches 0, 1, 2 while workers put their groups in a shuffled order, one per
    event-loop turn, so the consumer often waits for a batch whose later groups are already in."""
    finish_order = [(b, i) for b in range(3) for i in range(GROUPS)]
    random.Random(seed).shuffle(finish_order)

    async def run():
        reassembly = OrderedReassembly(GROUPS)

        async def workers():
            for b, i in finish_order:
                reassembly.put(group(b, i))
                await asyncio.sleep(0)

        producer = asyncio.ensure_future(workers())
        popped = [await reassembly.pop(b) for b in range(3)]
        await producer
        return popped, reassembly.depth

    popped, depth = asyncio.run(run())
    assert [places(groups) for groups in popped] == [
        [(b, i) for i in range(GROUPS)] for b in range(3)
    ]
    assert depth == 0


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_pop_waits_for_the_last_missing_group_and_returns_index_order(order):
    async def run():
        reassembly = OrderedReassembly(3)
        waiter = asyncio.ensure_future(reassembly.pop(0))
        for index in order[:-1]:
            reassembly.put(group(0, index))
            await asyncio.sleep(0.001)
            assert not waiter.done()  # a group is still missing
        reassembly.put(group(0, order[-1]))  # the last one unblocks the consumer
        return await asyncio.wait_for(waiter, 1)

    assert places(asyncio.run(run())) == [(0, 0), (0, 1), (0, 2)]


def test_a_round_pops_only_its_indices_and_later_groups_stay_buffered():
    async def run():
        reassembly = OrderedReassembly(GROUPS)
        for b, i in [(1, 0), (0, 3), (0, 1), (0, 2), (0, 0)]:
            reassembly.put(group(b, i))
        first_round = await reassembly.pop(0, range(2))
        assert places(reassembly.buffered()) == [(0, 2), (0, 3), (1, 0)]
        assert reassembly.depth == 3
        second_round = await reassembly.pop(0, range(2, 4))
        return first_round, second_round, reassembly

    first_round, second_round, reassembly = asyncio.run(run())
    assert places(first_round) == [(0, 0), (0, 1)]
    assert places(second_round) == [(0, 2), (0, 3)]
    assert places(reassembly.buffered()) == [(1, 0)]


def test_fail_unblocks_a_waiting_pop_and_every_later_one():
    async def run():
        reassembly = OrderedReassembly(GROUPS)
        reassembly.put(group(0, 0))
        waiter = asyncio.ensure_future(reassembly.pop(0))
        await asyncio.sleep(0)
        reassembly.fail(RuntimeError("worker died"))
        reassembly.fail(RuntimeError("closed"))  # the first failure wins
        with pytest.raises(RuntimeError, match="worker died"):
            await asyncio.wait_for(waiter, 1)
        with pytest.raises(RuntimeError, match="worker died"):
            await reassembly.pop(1)
        with pytest.raises(RuntimeError, match="worker died"):
            reassembly.raise_if_failed()

    asyncio.run(run())


def test_a_group_outside_its_batch_or_delivered_twice_is_rejected():
    reassembly = OrderedReassembly(GROUPS)
    with pytest.raises(ValueError, match="outside its batch"):
        reassembly.put(group(0, GROUPS))
    reassembly.put(group(0, 1))
    with pytest.raises(ValueError, match="delivered twice"):
        reassembly.put(group(0, 1))
