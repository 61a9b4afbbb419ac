"""The megatron-core row runner under the scheduler: bookkeeping, windows, seeded sampling.

On CPU the runner drives ``FakeDynamicEngine`` (megatron-core's request semantics, full
recomputation of a real tiny GPT); every test compares against the CPU tier's KV-cache runner on
the same weights. The ``gpu`` tests drive megatron-core's real ``DynamicInferenceEngine``.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch
from grpo_testing.emulated_dynamic_engine_moe import RouteCapture
from grpo_testing.fake_dynamic import FakeDynamicEngine
from grpo_testing.models import VOCAB, tiny_gpt

from megatron.rl.inference.cpu.kv_cache import KVCache
from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.megatron_core.dynamic_runner import (
    DynamicEngineConfig,
    DynamicEngineRowRunner,
    RowSampling,
    SeededSampler,
    drive,
    split_routes,
)
from megatron.rl.inference.protocol import EngineError, RowWork
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.inference.step_group import StepGroup
from megatron.rl.wire import SamplingParams

EOS = 1
SEQ = 32

REQUESTS = [  # prompt, temperature, max_tokens, seed
    ([2, 3, 4], 0.0, 6, 11),
    ([5], 1.0, 8, 12),
    ([6, 7, 8, 9, 10, 11], 1.0, 5, 13),
    ([3, 3], 0.0, 9, 14),
    ([12, 13, 14, 15], 0.7, 7, 15),
    ([4, 2], 1.0, 4, 16),
]


@pytest.fixture
def model(single_rank_world):
    with torch.no_grad():
        yield tiny_gpt(seed=3).eval()


def logits_fn(model):
    def full(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.tensor([tokens])
            return model(ids, torch.arange(len(tokens))[None], None)[0, -1].float()

    return full


def local_engine(model, max_requests=3, eos=EOS) -> ContinuousBatchingScheduler:
    c = model.config
    cache = KVCache(
        c.num_layers, max_requests, SEQ, c.num_query_groups, c.kv_channels, torch.float32, "cpu"
    )
    steps = StepGroup(KVCacheRowRunner(model, cache, VOCAB))
    return ContinuousBatchingScheduler(steps, SchedulerConfig(max_requests, SEQ, eos), lambda: 0)


def dynamic_engine(
    model, max_requests=3, fake_max_requests=None, fake_seq=SEQ, version=None, eos=EOS
):
    sampler = SeededSampler(VOCAB)
    fake_max = max_requests if fake_max_requests is None else fake_max_requests
    fake = FakeDynamicEngine(sampler, logits_fn(model), fake_max, fake_seq)
    runner = DynamicEngineRowRunner(fake, sampler, DynamicEngineConfig(max_requests, SEQ, eos))
    steps = StepGroup(runner)
    engine = ContinuousBatchingScheduler(
        steps, SchedulerConfig(max_requests, SEQ, eos), version or (lambda: 0)
    )
    return engine, fake, runner


async def generate_all(engine, requests=REQUESTS, ignore_eos=False):
    engine.start()
    engine.resume()
    try:
        return await asyncio.gather(
            *(
                engine.generate(
                    p, SamplingParams(temperature=t, max_tokens=n, ignore_eos=ignore_eos), seed=s
                )
                for p, t, n, s in requests
            )
        )
    finally:
        await engine.aclose()


def assert_same_outputs(got, want):
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        assert g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_outputs_equal_the_local_engine_on_the_same_weights(model):
    want = asyncio.run(generate_all(local_engine(model)))
    engine, fake, runner = dynamic_engine(model)
    got = asyncio.run(generate_all(engine))
    assert_same_outputs(got, want)
    assert any(t == 0.0 for _, t, _, _ in REQUESTS) and any(o.finish_reason for o in got)
    assert not fake.requests and not fake.active  # every megatron-core request finished


def test_each_request_gets_its_token_budget_and_eos_as_termination(model):
    engine, fake, _ = dynamic_engine(model)
    asyncio.run(generate_all(engine))
    adds = [entry for entry in fake.log if entry[0] == "add"]
    assert [(prompt, budget, stop) for _, _, prompt, budget, stop in adds] == [
        (tuple(p), n, EOS) for p, _, n, _ in REQUESTS
    ]


def test_ignore_eos_runs_megatron_core_requests_past_eos_to_their_budget(model):
    greedy = [([2, 3, 4], 0.0, 6, 11)]
    free = asyncio.run(generate_all(local_engine(model, eos=-1), greedy))[0]  # nothing stops it
    eos = free.tokens[0]  # the stop token of this test: the first token greedy decoding gives
    engine, _, _ = dynamic_engine(model, eos=eos)
    stopped = asyncio.run(generate_all(engine, greedy))[0]
    engine, fake, _ = dynamic_engine(model, eos=eos)
    full = asyncio.run(generate_all(engine, greedy, ignore_eos=True))[0]
    assert (stopped.tokens, stopped.finish_reason) == ([eos], "stop")
    assert (full.tokens, full.finish_reason) == (free.tokens, "length")
    assert [entry[4] for entry in fake.log if entry[0] == "add"] == [-1]  # no token terminates
    assert not fake.requests and not fake.active


def test_windows_suspend_and_resume_megatron_core_without_changing_outputs(model):
    want = asyncio.run(generate_all(local_engine(model)))
    engine, fake, runner = dynamic_engine(model)

    async def windows():
        engine.start()
        tasks = [
            asyncio.ensure_future(
                engine.generate(p, SamplingParams(temperature=t, max_tokens=n), seed=s)
            )
            for p, t, n, s in REQUESTS
        ]
        try:
            while not all(t.done() for t in tasks):
                engine.resume()
                for _ in range(3):  # a short generation window
                    await asyncio.sleep(0)
                engine.suspend()
                engine.steps.stop_followers()  # what RolloutSource does at the end of a window
                assert fake.suspended or all(t.done() for t in tasks)
            return [t.result() for t in tasks]
        finally:
            await engine.aclose()

    got = asyncio.run(windows())
    assert_same_outputs(got, want)
    kinds = [entry[0] for entry in fake.log]
    assert kinds.count("suspend") >= 2 and kinds.count("resume") >= 2


def test_a_cancelled_request_is_finished_in_megatron_core_when_its_slot_is_reused(model):
    engine, fake, runner = dynamic_engine(model, max_requests=1)
    (want,) = asyncio.run(generate_all(local_engine(model, 1), REQUESTS[1:2]))

    async def run():
        engine.start()
        engine.resume()
        try:
            doomed = asyncio.ensure_future(engine.generate([2, 2, 2], SamplingParams(), seed=1))
            for _ in range(4):
                await asyncio.sleep(0)
            doomed.cancel()
            p, t, n, s = REQUESTS[1]
            return await engine.generate(p, SamplingParams(temperature=t, max_tokens=n), seed=s)
        finally:
            await engine.aclose()

    got = asyncio.run(run())
    assert_same_outputs([got], [want])
    assert not fake.requests and not fake.stop_word_finished_request_ids


def test_tokens_sampled_ahead_are_handed_over_in_order(model):
    """Keyed rows outside the window target still advance in megatron-core while an unkeyed
    request steps; the scheduler later receives exactly the tokens the KV-cache runner samples."""

    buffered = []

    async def scenario(engine, runner=None):
        engine.start()
        engine.resume()
        try:
            engine.await_batch(0)
            first = asyncio.ensure_future(
                engine.generate([2, 3], SamplingParams(max_tokens=1), seed=5, key=(0, 0, 0))
            )
            later = asyncio.ensure_future(
                engine.generate([4, 5], SamplingParams(max_tokens=6), seed=6, key=(1, 0, 0))
            )
            free = asyncio.ensure_future(
                engine.generate([6], SamplingParams(max_tokens=12), seed=7)
            )
            await asyncio.gather(first, free)
            if runner is not None:  # the later request advanced while only `free` was planned
                buffered.append(sum(len(r.ahead) for r in runner._requests.values()))
            engine.await_batch(1)
            return await asyncio.gather(first, later, free)
        finally:
            await engine.aclose()

    want = asyncio.run(scenario(local_engine(model)))
    engine, fake, runner = dynamic_engine(model)
    got = asyncio.run(scenario(engine, runner))
    assert_same_outputs(got, want)
    assert buffered[0] > 0


def test_a_request_megatron_core_cannot_schedule_fails_instead_of_hanging(model):
    engine, _, _ = dynamic_engine(model, fake_max_requests=0)
    with pytest.raises(EngineError, match="could not schedule"):
        asyncio.run(generate_all(engine, REQUESTS[:1]))


def test_a_request_megatron_core_fails_fails_the_engine(model):
    engine, _, _ = dynamic_engine(model, fake_seq=6)  # megatron-core's context is shorter
    with pytest.raises(EngineError, match="failed request"):
        asyncio.run(generate_all(engine, REQUESTS[:1]))


def test_a_decode_row_for_an_unknown_slot_is_an_error():
    runner = DynamicEngineRowRunner(object(), SeededSampler(VOCAB), DynamicEngineConfig())
    with pytest.raises(RuntimeError, match="slot 3"):
        runner.run([RowWork(slot=3, tokens=(5,), start=4, temperature=1, top_p=1, top_k=0, seed=1)])


def test_rows_with_their_token_budget_travel_between_ranks():
    row = RowWork(
        slot=1, tokens=(2, 3), start=0, temperature=1.0, top_p=1.0, top_k=0, seed=9, max_tokens=4
    )
    assert pickle.loads(pickle.dumps(row)) == row


def test_sampler_is_seeded_per_request_and_masks_padded_vocabulary():
    sampler = SeededSampler(vocab_size=5)
    sampler.requests = {7: RowSampling(3, 1.0, 1.0, 0), 8: RowSampling(4, 1.0, 1.0, 0)}
    logits = torch.zeros(2, 8)
    logits[:, 5:] = 100.0  # padded ids: must never be sampled
    alone = sampler.sample(logits[:1], [7], [10]).tolist()
    together = sampler.sample(logits, [7, 8], [10, 3]).tolist()
    assert together[0] == alone[0]  # independent of batch composition
    assert all(t < 5 for t in together)
    assert [rid for rid, _, _, _ in sampler.take()] == [7, 8]
    assert sampler.take() == []


def test_split_routes_gives_each_request_its_packed_rows():
    routes = torch.arange(7, dtype=torch.int16).view(7, 1, 1).expand(7, 2, 3)  # (rows, L, k)
    split = split_routes(routes, [4, 9, 2], [3, 1, 2])  # row 6: padding
    assert {r: t[:, 0, 0].tolist() for r, t in split.items()} == {4: [0, 1, 2], 9: [3], 2: [4, 5]}
    assert split[9].shape == (1, 2, 3) and split[9].dtype == torch.int16
    with pytest.raises(ValueError, match="router rows"):
        split_routes(routes, [4, 9], [5, 3])


def test_each_row_gets_the_routes_of_the_tokens_it_fed(model):
    """The stand-in feeds a request's whole sequence every step, as megatron-core does when it
    re-prefills: a request's first token gets the prompt's routes, every later one the routes of
    its previous token only, so a request's rows together route each fed position once."""
    sampler = SeededSampler(VOCAB)
    sample = sampler.sample

    def sample_and_route(logits, request_ids, positions):
        fed = {
            r: torch.arange(p, dtype=torch.int16).view(p, 1, 1)
            for r, p in zip(request_ids, positions)
        }
        sampler.keep_routes(fed)  # route of each fed token: its position
        return sample(logits, request_ids, positions)

    sampler.sample = sample_and_route
    fake = FakeDynamicEngine(sampler, logits_fn(model), 3, SEQ)
    capture = RouteCapture(DynamicEngineRowRunner(fake, sampler, DynamicEngineConfig(3, SEQ, EOS)))
    engine = ContinuousBatchingScheduler(
        StepGroup(capture), SchedulerConfig(3, SEQ, EOS), lambda: 0
    )
    got = asyncio.run(generate_all(engine))
    for (prompt, *_), output in zip(REQUESTS, got):
        routes = torch.cat(capture.routes[tuple(prompt)])  # (prompt + generated - 1, 1, 1)
        assert routes.flatten().tolist() == list(range(len(prompt) + len(output.tokens) - 1))


def test_drive_runs_coroutines_that_only_yield_to_the_loop():
    async def steps():
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return 42

    assert drive(steps()) == 42

    async def waits_for_a_future():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(RuntimeError):
        drive(waits_for_a_future())


# --------------------------------------------------------------------- megatron-core, CUDA


@pytest.mark.gpu
def test_greedy_outputs_of_megatron_core_equal_the_local_engine_on_cuda(single_rank_world):
    from megatron.rl.inference.megatron_core.dynamic_engine import build_megatron_engine
    from megatron.rl.inference.megatron_core.flash_reference import attention_backend_name

    torch.cuda.set_device(0)
    with torch.no_grad():
        model = tiny_gpt(seed=3).cuda().eval()
    greedy = [(p, 0.0, n, s) for p, _, n, s in REQUESTS]
    c = model.config
    cache = KVCache(c.num_layers, 3, SEQ, c.num_query_groups, c.kv_channels, torch.float32, "cuda")
    local = ContinuousBatchingScheduler(
        StepGroup(KVCacheRowRunner(model, cache, VOCAB)), SchedulerConfig(3, SEQ, EOS), lambda: 0
    )
    want = asyncio.run(generate_all(local, greedy))

    config = DynamicEngineConfig(max_requests=3, max_seq_len=SEQ, eos_id=EOS, block_size_tokens=256)
    sampler = SeededSampler(VOCAB)
    megatron_engine = build_megatron_engine(model, config, VOCAB, 24, sampler)
    runner = DynamicEngineRowRunner(megatron_engine, sampler, config)
    engine = ContinuousBatchingScheduler(StepGroup(runner), SchedulerConfig(3, SEQ, EOS), lambda: 0)
    got = asyncio.run(generate_all(engine, greedy))
    print("attention backend:", attention_backend_name())
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)


@pytest.mark.gpu
def test_megatron_core_engine_survives_suspend_resume_windows_on_cuda(single_rank_world):
    from megatron.rl.inference.megatron_core.dynamic_engine import build_dynamic_step_group

    torch.cuda.set_device(0)
    with torch.no_grad():
        model = tiny_gpt(seed=3).cuda().eval()
    config = DynamicEngineConfig(max_requests=3, max_seq_len=SEQ, eos_id=EOS)
    steps = build_dynamic_step_group(model, config, VOCAB, 24)
    engine = ContinuousBatchingScheduler(steps, SchedulerConfig(3, SEQ, EOS), lambda: 0)
    want = asyncio.run(generate_all(local_engine_on(model, "cuda"), REQUESTS))

    async def windows():
        engine.start()
        tasks = [
            asyncio.ensure_future(
                engine.generate(p, SamplingParams(temperature=t, max_tokens=n), seed=s)
            )
            for p, t, n, s in REQUESTS
        ]
        try:
            while not all(t.done() for t in tasks):
                engine.resume()
                for _ in range(3):
                    await asyncio.sleep(0)
                engine.suspend()
                engine.steps.stop_followers()
            return [t.result() for t in tasks]
        finally:
            await engine.aclose()

    got = asyncio.run(windows())
    for g, w in zip(got, want):
        assert g.tokens == w.tokens


def local_engine_on(model, device: str) -> ContinuousBatchingScheduler:
    c = model.config
    cache = KVCache(c.num_layers, 3, SEQ, c.num_query_groups, c.kv_channels, torch.float32, device)
    return ContinuousBatchingScheduler(
        StepGroup(KVCacheRowRunner(model, cache, VOCAB)), SchedulerConfig(3, SEQ, EOS), lambda: 0
    )
