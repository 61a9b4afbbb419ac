"""G submission end to end: ``GroupStreamingGenerator`` over a ``ContinuousBatchingScheduler``
(fake steps) with adversarial timing (engine steps, rewards and training steps of random,
long-tailed durations), in G/G and G/B at integer, fractional and -1 lags.

Whatever the timing, every step must train the same groups with the same tokens from the same
policy versions, the engine must take the same steps, and every group must be trained exactly
``group_staleness(u, C, P)`` versions after its submission, with never more than ``C`` groups
submitted and not consumed.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from grpo_testing.fakes import FakeSteps
from unit_tests.rl.rollout.test_reward_wait_budget import EngineAgent

from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.rollout.generator import GroupedRolloutGenerator, RolloutConfig
from megatron.rl.rollout.granularity import gate_capacity, group_staleness, staleness_bounds
from megatron.rl.rollout.group_stream import GroupStreamingGenerator, rollout_generator

GROUPS, GROUP_SIZE, STEPS = 4, 3, 7


def run(consumption: str, lag: float, timing_seed: int | None, budget: int = 0):
    """Train ``STEPS`` steps; per step the trained (u, staleness, tokens, versions) and the held
    units at hand-over, and the engine's steps. ``timing_seed=None``: everything instant."""
    rng = random.Random(timing_seed)

    def delay(most: float) -> float:
        return 0.0 if timing_seed is None else rng.choice([0.0, 0.0, rng.uniform(0, most)])

    steps = FakeSteps()
    original = steps.step

    def timed_step(plan):
        time.sleep(delay(0.002))
        return original(plan)

    steps.step = timed_step
    version = [0]
    capacity = gate_capacity(lag, GROUPS)
    engine = ContinuousBatchingScheduler(
        steps,
        SchedulerConfig(max_requests=64, max_seq_len=32, reward_wait_steps=budget),
        lambda: version[0],
    )
    config = RolloutConfig(
        forced_lag=0,
        groups_per_batch=GROUPS,
        group_size=GROUP_SIZE,
        seed=1,
        submission="G",
        consumption=consumption,
        capacity=capacity,
    )

    async def train():
        engine.start()
        gen = rollout_generator(
            EngineAgent(engine, lambda: delay(0.01)),
            None,
            config,
            lambda: version[0],
            scheduler=engine,
        )
        gen.start()
        trained = []
        try:
            for step in range(STEPS):
                engine.resume()
                batch = await gen.next_batch()
                engine.suspend()
                assert batch.batch_id == step and batch.gate_held <= capacity
                trained.append(
                    [
                        (
                            g.batch_id * GROUPS + g.index_in_batch,
                            step - g.rollouts[0].submission_policy_version,
                            [(r.tokens, r.policy_versions) for r in g.rollouts],
                        )
                        for g in batch.groups
                    ]
                )
                await asyncio.sleep(delay(0.005))
                version[0] += 1
        finally:
            await gen.aclose()
            await engine.aclose()
        return trained

    trained = asyncio.run(train())
    return trained, [[(r.seed, r.start) for r in p.rows[0]] for p in steps.plans], capacity


MODES = [
    pytest.param("G", 0.0, id="G/G-lag-0"),
    pytest.param("G", 0.5, id="G/G-lag-0.5"),
    pytest.param("G", -1.0, id="G/G-lag-minus-1"),
    pytest.param("G", 2.0, id="G/G-lag-2"),
    pytest.param("B", 0.0, id="G/B-lag-0"),
    pytest.param("B", 1.25, id="G/B-lag-1.25"),
]


@pytest.mark.parametrize("consumption, lag", MODES)
def test_every_group_has_the_staleness_of_the_gate_whatever_the_timing(consumption, lag):
    reference, engine_steps, capacity = run(consumption, lag, None)
    for step, groups in enumerate(reference):
        assert [u for u, _, _ in groups] == list(range(step * GROUPS, (step + 1) * GROUPS))
        for u, staleness, _ in groups:
            assert staleness == group_staleness(u, capacity, GROUPS), (step, u)
    for timing_seed in (1, 2, 3):
        trained, timed_steps, _ = run(consumption, lag, timing_seed)
        assert trained == reference, f"timing seed {timing_seed}"
        assert timed_steps == engine_steps, f"timing seed {timing_seed}"


def test_a_reward_wait_budget_keeps_g_g_reproducible():
    reference, engine_steps, _ = run("G", 0.5, None, budget=3)
    trained, timed_steps, _ = run("G", 0.5, 7, budget=3)
    assert (trained, timed_steps) == (reference, engine_steps)


@pytest.mark.parametrize(
    "capacity, groups, bounds",
    [
        pytest.param(4, 4, (1, 1), id="lag-0"),
        pytest.param(6, 4, (1, 2), id="lag-0.5"),
        pytest.param(1, 4, (0, 1), id="lag-minus-1"),
        pytest.param(12, 4, (3, 3), id="lag-2"),
    ],
)
def test_staleness_bounds(capacity, groups, bounds):
    assert staleness_bounds(capacity, groups) == bounds
    full = [group_staleness(u, capacity, groups) for u in range(capacity, capacity + 4 * groups)]
    assert (min(full), max(full)) == bounds


def test_the_factory_picks_the_generator_of_the_mode():
    base = dict(forced_lag=0, groups_per_batch=2, group_size=1, seed=0)
    assert (
        type(rollout_generator(None, None, RolloutConfig(**base), int)) is GroupedRolloutGenerator
    )
    streaming = RolloutConfig(**base, submission="G", consumption="G", capacity=3)
    assert isinstance(rollout_generator(None, None, streaming, int), GroupStreamingGenerator)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(dict(submission="G", consumption="B", capacity=1), "whole batch", id="G/B"),
        pytest.param(dict(submission="B", consumption="G"), "unsupported", id="B/G"),
        pytest.param(dict(submission="G", consumption="G"), "capacity", id="no-capacity"),
    ],
)
def test_modes_that_cannot_run_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(forced_lag=0, groups_per_batch=2, group_size=1, seed=0, **kwargs)
