"""Generation rounds of dynamic sampling in ``GroupedRolloutGenerator`` (contract point 5): lazy at
L = 0 (a round more only while the batch is short of groups whose rewards differ, at the batch's
own policy version), eager otherwise (every round with the batch)."""

from __future__ import annotations

import asyncio
import random

import pytest

from megatron.rl.agent.api import Agent
from megatron.rl.inference.protocol import EngineError
from megatron.rl.rollout.generator import GroupedRolloutGenerator, RolloutConfig
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup, TokenRollout

P, R, GROUP_SIZE = 2, 3, 3
QUALIFYING = {0: {0, 1}, 1: {1, 3}, 2: {5}, 3: set(), 4: {2, 3, 4}}
"""batch -> indices of the groups whose rewards differ (the others' are all equal)."""
ROUNDS_NEEDED = {0: 1, 1: 2, 2: 3, 3: 3, 4: 2}
"""Lazy rounds each batch takes by hand: until P qualifying groups are in, at most R."""


class ScriptedAgent(Agent):
    """Groups finish after random delays; a group's rewards differ iff ``QUALIFYING`` says so.
    Fails group ``fail_at`` with an engine error."""

    def __init__(self, seed: int = 0, fail_at: tuple[int, int] | None = None) -> None:
        super().__init__("scripted")
        self.rng = random.Random(seed)
        self.fail_at = fail_at
        self.requests: list[GroupedRolloutRequest] = []

    def expected_requests(self, request):
        return request.group_size

    async def group_rollout(self, request, inference):
        self.requests.append(request)
        await asyncio.sleep(self.rng.uniform(0, 0.003))
        b, i = request.batch_id, request.index_in_batch
        if (b, i) == self.fail_at:
            raise EngineError("the engine failed")
        differ = i in QUALIFYING.get(b % 5, set())
        rollouts = [
            TokenRollout(
                env_id="scripted",
                problem_id=f"{b}/{i}",
                prompt="p",
                completion="c",
                reward=float(k if differ else 1),
                tokens=[2, 3],
                generation_mask=[False, True],
                logprobs=[-0.5],
                policy_versions=[request.submission_policy_version],
                submission_policy_version=request.submission_policy_version,
            )
            for k in range(request.group_size)
        ]
        return RolloutGroup(batch_id=b, index_in_batch=i, rollouts=rollouts)


class Recorder:
    """A ``BatchScheduler`` that records the hints."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def expect_group(self, batch_id, index_in_batch, num_requests):
        self.calls.append(("expect", batch_id, index_in_batch))

    def group_done(self, batch_id, index_in_batch):
        self.calls.append(("done", batch_id, index_in_batch))

    def await_batch(self, batch_id):
        self.calls.append(("await", batch_id))

    async def window_spent(self, batch_id):
        self.calls.append(("spent", batch_id))


def generator(agent: Agent, lag: int, lazy: bool, version: list[int], **kwargs):
    config = RolloutConfig(
        forced_lag=lag,
        groups_per_batch=P * R,
        group_size=GROUP_SIZE,
        seed=1,
        rounds=R,
        lazy_rounds=lazy,
    )
    return GroupedRolloutGenerator(agent, None, config, lambda: version[0], **kwargs)


async def train(gen: GroupedRolloutGenerator, version: list[int], steps: int, first: int = 0):
    """The trainer: take batch s, train (bump the version), repeat."""
    batches = []
    gen.start()
    try:
        for step in range(first, steps):
            batches.append(await gen.next_batch())
            await asyncio.sleep(0.001)
            version[0] = step + 1
    finally:
        await gen.aclose()
    return batches


def test_lazy_rounds_generate_only_the_rounds_a_batch_needs():
    agent, version, recorder = ScriptedAgent(), [0], Recorder()
    gen = generator(agent, 0, True, version, scheduler=recorder)
    batches = asyncio.run(train(gen, version, steps=5))

    for b, batch in enumerate(batches):
        rounds = ROUNDS_NEEDED[b]
        assert [g.index_in_batch for g in batch.groups] == list(range(rounds * P))
        sent = sorted(r.index_in_batch for r in agent.requests if r.batch_id == b)
        assert sent == list(range(rounds * P))  # no round beyond the one that filled the batch
        versions = {r.submission_policy_version for r in agent.requests if r.batch_id == b}
        assert versions == {b}  # every round at the batch's own version (L = 0)
        assert batch.in_flight == 1
    for request in agent.requests:  # the requests of the eager rounds: same ids and batch size
        assert request.groups_in_batch == P * R
    # a lazy round is announced only after the batch's earlier rounds are done, before its run
    calls = recorder.calls
    assert calls.index(("done", 1, 1)) < calls.index(("expect", 1, 2))
    assert calls.index(("await", 1)) < calls.index(("expect", 1, 2)) < calls.index(("await", 2))


@pytest.mark.parametrize("lag", [pytest.param(0, id="lag0"), pytest.param(2, id="lag2")])
def test_eager_rounds_submit_every_round_with_the_batch(lag):
    agent, version = ScriptedAgent(seed=lag), [0]
    batches = asyncio.run(train(generator(agent, lag, False, version), version, steps=5))
    for b, batch in enumerate(batches):
        assert [g.index_in_batch for g in batch.groups] == list(range(P * R))
        versions = {r.submission_policy_version for r in agent.requests if r.batch_id == b}
        assert versions == {max(0, b - lag)}


def test_lazy_rounds_keep_what_eager_rounds_give_at_lag_zero():
    version = [0]
    eager = asyncio.run(train(generator(ScriptedAgent(1), 0, False, version), version, 5))
    version = [0]
    lazy = asyncio.run(train(generator(ScriptedAgent(2), 0, True, version), version, 5))
    for e, z in zip(eager, lazy):
        assert z.groups == e.groups[: len(z.groups)]  # the same groups, fewer of them


def test_a_resumed_lazy_generator_continues_the_uninterrupted_one():
    async def until_checkpoint():
        agent, version = ScriptedAgent(3), [0]
        gen = generator(agent, 0, True, version)
        gen.start()
        try:
            batches = []
            for step in range(3):
                batches.append(await gen.next_batch())
                version[0] = step + 1
            return batches, await gen.drain()
        finally:
            await gen.aclose()

    _, state = asyncio.run(until_checkpoint())
    assert (state.next_batch_id, state.submitted, state.groups) == (3, 3, [])
    version = [3]
    gen = generator(ScriptedAgent(4), 0, True, version, first_batch_id=3, resume_from=state)
    resumed = asyncio.run(train(gen, version, steps=6, first=3))
    version = [0]
    full = asyncio.run(train(generator(ScriptedAgent(5), 0, True, version), version, steps=6))
    assert [b.groups for b in resumed] == [b.groups for b in full[3:]]


def test_a_failure_in_a_lazy_round_reaches_the_trainer():
    version = [0]
    gen = generator(ScriptedAgent(fail_at=(1, 3)), 0, True, version)  # round 2 of batch 1
    with pytest.raises(EngineError, match="the engine failed"):
        asyncio.run(train(gen, version, steps=3))


@pytest.mark.parametrize(
    "fields, message",
    [
        pytest.param(dict(forced_lag=1, rounds=3, lazy_rounds=True), "forced_lag 0", id="lag1"),
        pytest.param(dict(rounds=4), "4 rounds do not divide 6", id="not-dividing"),
        pytest.param(dict(rounds=0), "0 rounds", id="zero"),
    ],
)
def test_bad_round_configs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**{"forced_lag": 0, "group_size": 2, "seed": 1, **fields}, groups_per_batch=6)
