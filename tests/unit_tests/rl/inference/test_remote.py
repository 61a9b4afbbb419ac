"""``RemoteInferenceInterface`` against the real inference server app over a running engine: a
multi-turn exchange over HTTP gives exactly what the in-process interface gives."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from grpo_testing.fakes import FakeSteps, fake_route

from megatron.rl.http_client import ClientPool, RetryPolicy
from megatron.rl.inference.interface import InferenceInterface, LocalInferenceInterface
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.inference.remote import RemoteInferenceInterface
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import InferenceRequest, RolloutKey, SamplingParams

TOK = CharTokenizer()
KEY = RolloutKey(batch_id=0, index_in_batch=0, sample_index=0)


async def two_turns(inference: InferenceInterface):
    """Turn 0 from text, turn 1 from the history plus an observation, then the end."""
    first = await inference.generate(
        InferenceRequest(
            prompt="12=",
            sampling=SamplingParams(max_tokens=2),
            seed=3,
            rollout_key=KEY,
            continued=True,
        )
    )
    history = first.prompt_tokens + first.tokens
    second = await inference.generate(
        InferenceRequest(
            prompt_tokens=history,
            prompt_suffix="+",
            sampling=SamplingParams(max_tokens=2),
            seed=4,
            rollout_key=KEY,
            continued=True,
        )
    )
    ended = await inference.end_rollout(KEY)
    return first, second, ended


def run_over(remote: bool, work=two_turns, keep_keys: bool = True, routes: bool = False):
    """Run ``work`` through the local interface or over HTTP (ASGI transport) to the server
    (``routes``: the steps record expert routes)."""
    steps = FakeSteps(routes=routes)

    async def run():
        engine = ContinuousBatchingScheduler(
            steps, SchedulerConfig(max_requests=4, max_seq_len=24, barrier_timeout_s=5), lambda: 1
        )
        engine.start()
        engine.resume()
        local = LocalInferenceInterface(engine, TOK)
        pool = ClientPool(
            4, httpx.Timeout(5.0), httpx.ASGITransport(create_inference_app(local, TOK))
        )
        inference = (
            RemoteInferenceInterface("http://t", pool, RetryPolicy(0), keep_keys)
            if remote
            else local
        )
        try:
            return await asyncio.wait_for(work(inference), 10)
        finally:
            await pool.aclose()
            await engine.aclose()

    return asyncio.run(run()), steps.plans


def test_a_multi_turn_exchange_over_http_equals_the_in_process_one():
    (first, second, ended), plans = run_over(remote=True)
    assert run_over(remote=False) == ((first, second, ended), plans)
    # The observation is tokenized by the server and appended to the history.
    assert second.prompt_tokens == TOK.encode("12=") + first.tokens + TOK.encode("+")
    assert ended is True  # the engine was waiting for a third turn until end_rollout
    assert [r.tokens for r in plans[2].rows[0]] == [tuple(second.prompt_tokens)]


@pytest.mark.parametrize(
    "remote", [pytest.param(False, id="in_process"), pytest.param(True, id="http")]
)
def test_recorded_routes_come_back_for_every_fed_position(remote):
    (first, second, _), _ = run_over(remote, routes=True)
    for out, seed in ((first, 3), (second, 4)):
        fed = len(out.prompt_tokens) + len(out.tokens) - 1
        assert out.routed_experts == [fake_route(seed, p) for p in range(fed)]
    (plain, _, _), _ = run_over(remote)
    assert plain.routed_experts is None
    assert plain.model_copy(update={"routed_experts": first.routed_experts}) == first


def test_an_observation_outside_the_alphabet_is_an_invalid_request_naming_the_field():
    async def bad_turn(inference):
        first = await inference.generate(
            InferenceRequest(prompt="1=", seed=1, rollout_key=KEY, continued=True)
        )
        with pytest.raises(InvalidInferenceRequest, match="prompt_suffix"):
            await inference.generate(
                InferenceRequest(
                    prompt_tokens=first.prompt_tokens, prompt_suffix="higher", rollout_key=KEY
                )
            )
        return await inference.end_rollout(KEY)  # the unusable turn already released the wait

    for remote in (False, True):
        ended, _ = run_over(remote, bad_turn)
        assert ended is False


def test_evaluation_traffic_drops_keys_and_announcements():
    async def unkeyed(inference):
        out = await inference.generate(
            InferenceRequest(prompt="1=", seed=1, rollout_key=KEY, continued=True)
        )
        # Nothing is awaited: the engine serves the next request without an end_rollout.
        again = await inference.generate(InferenceRequest(prompt="1=", seed=2, rollout_key=KEY))
        return out, again, await inference.end_rollout(KEY)

    (out, again, ended), _ = run_over(True, unkeyed, keep_keys=False)
    assert ended is False and len(out.tokens) == len(again.tokens) == 16
