"""The engine's work in flight across a checkpoint: ``snapshot`` between two windows, ``restore``
in a new engine, and the agents' requests sent again and answered by key (``engine_snapshot.py``).

The scheduler runs over ``FakeSteps`` (token 2 + (seed + position) % 7, stateless like the real
sampler, and a route per fed position), so the steps themselves can be compared; the runner's KV
cache export is tested on the tiny model.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from grpo_testing.fakes import FakeSteps, fake_route
from grpo_testing.models import VOCAB, tiny_gpt

from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.engine_snapshot import EngineSnapshot
from megatron.rl.inference.protocol import RowWork
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.wire import SamplingParams

TURNS = {(0, 0): 1, (1, 0): 2, (1, 1): 1}
"""Turns per rollout of each group (batch, index): group (1, 0) is multi-turn."""


def max_tokens(key: tuple[int, int, int], turn: int) -> int:
    """Batch 0 is short; the multi-turn rollouts' first turn finishes before batch 0 does."""
    return 3 if key[0] == 0 else 2 if (key[:2], turn) == ((1, 0), 0) else 6


class Job:
    """A forced-lag job in miniature: batches 0 and 1 in flight, the trainer waits for 0, trains
    (the version goes to 1), then waits for 1."""

    def __init__(self, engine: ContinuousBatchingScheduler, version: list[int]) -> None:
        self.engine, self.version = engine, version
        self.outputs: dict = {}
        self.prompts: dict = {}
        self.tasks: list[asyncio.Task] = []
        self.by_batch: dict[int, list[asyncio.Task]] = {}

    async def rollout(self, key: tuple[int, int, int], prompt: list[int]) -> None:
        turns = TURNS[key[:2]]
        for turn in range(turns):
            out = await self.engine.generate(
                prompt,
                SamplingParams(max_tokens=max_tokens(key, turn)),
                seed=sum(key) * 10 + turn,
                key=key,
                continued=turn < turns - 1,
            )
            self.outputs[(key, turn)] = out
            self.prompts[(key, turn)] = prompt
            prompt = prompt + out.tokens + [5]  # the environment answers between turns
            await asyncio.sleep(0)

    async def group(self, batch: int, index: int, prompt: list[int]) -> None:
        try:
            keys = [(batch, index, s) for s in range(2)]
            await asyncio.gather(*(self.rollout(k, prompt) for k in keys))
        finally:
            self.engine.group_done(batch, index)

    def submit(self, groups, prompt: list[int] | None = None) -> None:
        for batch, index in groups:
            self.engine.expect_group(batch, index, 2)
            task = asyncio.create_task(self.group(batch, index, prompt or [2, 3 + index]))
            self.tasks.append(task)
            self.by_batch.setdefault(batch, []).append(task)


def engine_of(steps: FakeSteps, version: list[int], slots: int = 4) -> ContinuousBatchingScheduler:
    config = SchedulerConfig(max_requests=slots, max_seq_len=64)
    return ContinuousBatchingScheduler(steps, config, lambda: version[0])


async def window(job: Job, batch: int) -> None:
    """Step until every group of ``batch`` has returned (the trainer's window), then suspend."""
    job.engine.await_batch(batch)
    job.engine.resume()
    await asyncio.gather(*job.by_batch[batch])
    job.engine.suspend()


def started_job() -> tuple[FakeSteps, list[int], Job]:
    """An engine at version 0 with batches 0 and 1 submitted."""
    steps, version = FakeSteps(routes=True), [0]
    engine = engine_of(steps, version)
    engine.start()
    job = Job(engine, version)
    job.submit(TURNS)
    return steps, version, job


async def uninterrupted() -> tuple[dict, list]:
    steps, version, job = started_job()
    engine = job.engine
    try:
        await window(job, 0)
        mark = len(steps.plans)
        version[0] = 1
        await window(job, 1)
        await asyncio.gather(*job.tasks)
    finally:
        await engine.aclose()
    return job.outputs, steps.plans[mark:]


async def saved_after_batch_0() -> EngineSnapshot:
    _, version, job = started_job()
    engine = job.engine
    try:
        await window(job, 0)
        version[0] = 1
        return engine.snapshot()
    finally:
        for task in job.tasks:
            task.cancel()
        await asyncio.gather(*job.tasks, return_exceptions=True)
        await engine.aclose()


async def resumed(snapshot: EngineSnapshot, prompt: list[int] | None = None) -> tuple:
    """A new engine restored from ``snapshot``; batch 1's agents run again from the start."""
    steps, version = FakeSteps(routes=True), [1]
    engine = engine_of(steps, version)
    engine.start()
    engine.restore(snapshot)
    job = Job(engine, version)
    job.submit([g for g in TURNS if g[0] == 1], prompt)
    try:
        await window(job, 1)
        await asyncio.gather(*job.tasks)
        held = engine.holds_requests()
    finally:
        await engine.aclose()
    return job.outputs, steps.plans, held, job.prompts


def test_a_restored_engine_continues_the_uninterrupted_schedule_exactly():
    full, full_plans = asyncio.run(uninterrupted())
    snapshot = asyncio.run(saved_after_batch_0())
    # batch 1 was half generated at version 0, one multi-turn rollout's first turn finished
    assert snapshot.in_flight and all(s.key[0] == 1 for s in snapshot.in_flight)
    assert any(s.tokens for s in snapshot.in_flight)
    assert snapshot.finished and all(s.key[:2] == (1, 0) and s.turn == 0 for s in snapshot.finished)
    assert snapshot == EngineSnapshot.model_validate_json(snapshot.model_dump_json())  # lossless
    assert any(s.routed_experts for s in snapshot.in_flight if s.tokens)
    outputs, plans, held, prompts = asyncio.run(resumed(snapshot))
    # tokens, logprobs, versions and the routes (those recorded before the save, then after)
    assert {k: v for k, v in full.items() if k[0][0] == 1} == outputs
    for (key, turn), out in outputs.items():
        fed = len(prompts[(key, turn)]) + len(out.tokens) - 1
        seed = sum(key) * 10 + turn
        assert out.routed_experts == [fake_route(seed, p) for p in range(fed)]
    assert plans == full_plans  # the same rows in every step after the save
    assert not held
    versions = {v for out in outputs.values() for v in out.policy_versions}
    assert versions == {0, 1}  # tokens of both versions, as in the run that never saved


def test_a_request_sent_again_with_another_prompt_is_generated_anew_with_a_warning(caplog):
    snapshot = asyncio.run(saved_after_batch_0())
    with caplog.at_level(logging.WARNING):
        outputs, _, held, _ = asyncio.run(resumed(snapshot, prompt=[9, 9, 9]))
    assert "different prompt or sampling than the saved one" in caplog.text
    assert all(set(out.policy_versions) == {1} for (_, turn), out in outputs.items() if turn == 0)
    assert not held  # the saved requests' slots were freed


def test_a_snapshot_saved_before_routes_existed_restores_with_no_partial_routes():
    snapshot = asyncio.run(saved_after_batch_0())
    payload = snapshot.model_dump(mode="json")
    for saved in payload["in_flight"] + payload["finished"]:
        del saved["routed_experts"]
    old = EngineSnapshot.model_validate(payload)
    outputs, _, held, prompts = asyncio.run(resumed(old))
    assert not held
    started = {(s.key, s.turn) for s in old.in_flight + old.finished if s.tokens}
    assert started and set(outputs) - started  # some turns began before the save, some after
    for (key, turn), out in outputs.items():
        if (key, turn) in started:  # its routes before the save are unknown: none at all
            assert out.routed_experts is None
        else:
            fed = len(prompts[(key, turn)]) + len(out.tokens) - 1
            assert out.routed_experts == [fake_route(sum(key) * 10 + turn, p) for p in range(fed)]


def test_restore_refuses_an_engine_of_another_shape():
    snapshot = asyncio.run(saved_after_batch_0())

    async def run():
        engine = engine_of(FakeSteps(), [1], slots=8)
        engine.start()
        try:
            engine.restore(snapshot)
        finally:
            await engine.aclose()

    with pytest.raises(
        ValueError, match="1 data-parallel replicas of 4 slots; this one has 1 of 8"
    ):
        asyncio.run(run())


@torch.no_grad()
def test_exported_kv_slots_continue_a_generation_bitwise(single_rank_world):
    """Decode in one runner, export its slots, import them into a fresh one: the next steps'
    tokens and logprobs are bitwise those of the runner that kept going."""
    model = tiny_gpt().eval()
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    c = model.config

    def runner() -> KVCacheRowRunner:
        shape = (c.num_layers, 4, 32, c.num_query_groups, c.kv_channels)
        return KVCacheRowRunner(model, KVCache(*shape, torch.float32, torch.device("cpu")), VOCAB)

    def rows(tokens, starts, slots=(1, 3)):
        return [
            RowWork(s, tuple(t), st, 1.0, 1.0, 0, seed=s) for s, t, st in zip(slots, tokens, starts)
        ]

    a = runner()
    out = a.run(rows([[2, 3, 4], [5, 6]], [0, 0]))
    out = a.run(rows([[out[0].token], [out[1].token]], [3, 2]))
    tokens = [[r.token] for r in out]
    saved = a.export_slots({1: 4, 3: 3})
    assert saved[1][0].shape == (c.num_layers, c.num_query_groups, 4, c.kv_channels)
    b = runner()
    b.import_slots(saved)
    for step in range(4):
        ra, rb = a.run(rows(tokens, [4 + step, 3 + step])), b.run(
            rows(tokens, [4 + step, 3 + step])
        )
        assert [(r.token, r.logprob) for r in ra] == [(r.token, r.logprob) for r in rb]
        tokens = [[r.token] for r in ra]
    with pytest.raises(ValueError, match="saved KV cache of slot 1 has shape"):
        b.import_slots({1: (saved[1][0][:1], saved[1][1][:1])})


def test_saved_requests_of_a_group_that_ends_without_them_are_freed():
    """An agent that fails before generating again (its group ends, ``group_done``): its saved
    requests give their slots back at once, without waiting for the barrier's timeout."""
    snapshot = asyncio.run(saved_after_batch_0())

    async def run():
        engine = engine_of(FakeSteps(), [1])
        engine.start()
        engine.restore(snapshot)
        assert engine.holds_requests()
        for batch, index in [g for g in TURNS if g[0] == 1]:
            engine.expect_group(batch, index, 2)
            engine.group_done(batch, index)  # the environment raised before any request
        engine.await_batch(1)
        engine.resume()
        await asyncio.sleep(0)
        held = engine.holds_requests()
        await engine.aclose()
        return held

    assert not asyncio.run(asyncio.wait_for(run(), timeout=5))
