"""The engine's per-token watcher (how streams and stop strings see tokens) and its scoring queue:
a watcher ends its own request or fails it alone; scoring that a runner cannot do fails the
caller, never the engine; a rollout asks for no stop strings, alternatives or adapter."""

from __future__ import annotations

import asyncio

import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.wire import SamplingParams


async def with_engine(work):
    engine = ContinuousBatchingScheduler(FakeSteps(), SchedulerConfig(2, 32), lambda: 3)
    engine.start()
    engine.resume()
    try:
        return await work(engine)
    finally:
        await engine.aclose()


def test_a_watcher_sees_every_token_and_may_end_the_request():
    seen = []

    def watch(token, logprob, version, alternatives):
        seen.append((token, version))
        return len(seen) == 3

    async def work(engine):
        sampling = SamplingParams(max_tokens=10, ignore_eos=True)
        return await engine.generate([2, 3], sampling, seed=1, watch=watch)

    out = asyncio.run(with_engine(work))
    assert out.finish_reason == "stop" and len(out.tokens) == 3
    assert seen == [(t, 3) for t in out.tokens]


def test_a_failing_watcher_fails_its_own_request_only():
    def broken(*_):
        raise KeyError("watcher bug")

    async def work(engine):
        sampling = SamplingParams(max_tokens=5, ignore_eos=True)
        failed = engine.generate([2, 3], sampling, seed=1, watch=broken)
        healthy = engine.generate([2, 3], sampling, seed=2)
        results = await asyncio.gather(failed, healthy, return_exceptions=True)
        after = await engine.generate([4], sampling, seed=3)  # the engine still serves
        return results, after, engine.holds_requests()

    (failed, healthy), after, holds = asyncio.run(with_engine(work))
    assert isinstance(failed, KeyError)
    assert len(healthy.tokens) == 5 and len(after.tokens) == 5 and not holds


def test_scoring_the_runner_cannot_do_fails_the_caller_not_the_engine():
    async def work(engine):
        with pytest.raises(InvalidInferenceRequest, match="cannot score"):
            await engine.score([2, 3, 4])  # the fake steps have no forward to score with
        with pytest.raises(InvalidInferenceRequest, match="at least 2"):
            await engine.score([2])
        return await engine.generate([2], SamplingParams(max_tokens=2), seed=0)

    assert len(asyncio.run(with_engine(work)).tokens) == 2


@pytest.mark.parametrize(
    "sampling, adapter",
    [
        pytest.param(SamplingParams(stop=["\n"]), None, id="stop"),
        pytest.param(SamplingParams(top_logprobs=2), None, id="top-logprobs"),
        pytest.param(SamplingParams(), "sql", id="adapter"),
    ],
)
def test_a_rollout_asks_for_no_stop_strings_alternatives_or_adapter(sampling, adapter):
    async def work(engine):
        with pytest.raises(InvalidInferenceRequest, match="a rollout"):
            await engine.generate([2], sampling, seed=0, key=(0, 0, 0), adapter=adapter)

    asyncio.run(with_engine(work))
