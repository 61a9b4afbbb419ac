"""Alternatives (``top_logprobs``) and scoring on the ``megatron_core`` backend's runner, over the
megatron-core stand-in that samples with the runner's ``SeededSampler`` (as megatron-core's step
does): the same numbers as the local engine's."""

from __future__ import annotations

import asyncio

import pytest
import torch
from grpo_testing.fake_dynamic import FakeDynamicEngine
from grpo_testing.models import VOCAB, tiny_gpt

from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.megatron_core.dynamic_runner import (
    DynamicEngineConfig,
    DynamicEngineRowRunner,
)
from megatron.rl.inference.megatron_core.seeded_sampler import SeededSampler
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.inference.scoring import ScoringForward
from megatron.rl.inference.step_group import StepGroup
from megatron.rl.wire import SamplingParams

SEQ, EOS = 32, 1


@pytest.fixture
def model(single_rank_world):
    with torch.no_grad():
        yield tiny_gpt(seed=3).eval()


def local_engine(model) -> ContinuousBatchingScheduler:
    c = model.config
    cache = KVCache(c.num_layers, 3, SEQ, c.num_query_groups, c.kv_channels, torch.float32, "cpu")
    steps = StepGroup(KVCacheRowRunner(model, cache, VOCAB))
    return ContinuousBatchingScheduler(steps, SchedulerConfig(3, SEQ, EOS), lambda: 0)


def dynamic_engine(model) -> tuple[ContinuousBatchingScheduler, None, DynamicEngineRowRunner]:
    """The runner over the megatron-core stand-in (logits of a full forward of ``model``)."""

    def logits(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.tensor([tokens])
            return model(ids, torch.arange(len(tokens))[None], None)[0, -1].float()

    sampler = SeededSampler(VOCAB)
    fake = FakeDynamicEngine(sampler, logits, 3, SEQ)
    runner = DynamicEngineRowRunner(fake, sampler, DynamicEngineConfig(3, SEQ, EOS))
    engine = ContinuousBatchingScheduler(StepGroup(runner), SchedulerConfig(3, SEQ, EOS), lambda: 0)
    return engine, None, runner


def test_alternatives_and_scores_equal_the_local_engine(model):
    """``top_logprobs`` through megatron-core's sampling hook equal the local engine's; both
    runners score a sequence with the same plain forward."""

    async def run(engine):
        engine.start()
        engine.resume()
        try:
            sampling = SamplingParams(temperature=0.8, max_tokens=5, top_logprobs=4)
            out = await engine.generate([3, 4, 5], sampling, seed=2)
            return out, await engine.score([3, 4, 5, *out.tokens], top_logprobs=4)
        finally:
            await engine.aclose()

    want, want_scored = asyncio.run(run(local_engine(model)))
    engine, _, runner = dynamic_engine(model)
    runner.scoring = ScoringForward(model, VOCAB, torch.device("cpu"))
    got, got_scored = asyncio.run(run(engine))
    assert got.tokens == want.tokens
    assert [[t for t, _ in top] for top in got.top_logprobs] == [
        [t for t, _ in top] for top in want.top_logprobs
    ]
    for top_got, top_want in zip(got.top_logprobs, want.top_logprobs):
        assert [v for _, v in top_got] == pytest.approx([v for _, v in top_want], abs=1e-4)
    assert got_scored == want_scored
    assert all(len(top) == 4 for top in got_scored.top_logprobs)


def test_a_runner_without_scoring_refuses_to_score_by_name(model):
    engine, _, _ = dynamic_engine(model)  # as with pipeline parallelism: no scoring forward

    async def run():
        engine.start()
        engine.resume()
        try:
            with pytest.raises(InvalidInferenceRequest, match="no pipeline parallelism"):
                await engine.score([3, 4, 5])
        finally:
            await engine.aclose()

    asyncio.run(run())
