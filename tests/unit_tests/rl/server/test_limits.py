"""What a server takes from outside clients: body size (413), n x max_tokens (422), requests in
flight per client (429), and abandoned requests shed from the engine, measured over real
sockets."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from grpo_testing.fakes import FakeSteps, SeededInference
from grpo_testing.inference_apps import inference_app

from megatron.rl.agent.env_config import build_agents
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.scheduler import SchedulerConfig
from megatron.rl.server.env_server import EnvServerConfig, create_app
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.server.limits import ServerLimits
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import InferenceRequest, InferenceResponse


async def serving(app):
    return await EmbeddedServer.start(app, "127.0.0.1", 0)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("server", ["inference", "env"])
def test_a_body_over_the_limit_is_413_before_it_is_read_whole(chunked, server):
    limit = 64 << 10
    inference = SeededInference()
    if server == "inference":
        limits = ServerLimits(max_body_bytes=limit)
        app = create_inference_app(inference, inference.tokenizer, limits=limits)
        path = "/v1/completions"
    else:
        envs = [{"agent_type": "digits", "env_id": "copy", "agent_args": {"task": "copy"}}]
        app = create_app(build_agents(envs), EnvServerConfig(max_body_bytes=limit))
        path = "/v1/grouped_rollouts"
    sent = []

    async def body():
        for _ in range(1000):  # 16 MiB in all, if it were read
            sent.append(1)
            yield b"x" * (16 << 10)

    async def run():
        server = await serving(app)
        try:
            async with httpx.AsyncClient(base_url=server.url) as client:
                if chunked:  # the answer may come while the client still sends: then the
                    try:  # client sees the connection closed instead of reading the 413
                        response = await client.post(path, content=body())
                    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                        response = None
                else:
                    response = await client.post(path, content=b"{" + b" " * (2 * limit) + b"}")
                small = await client.post(
                    "/v1/completions", json={"prompt": "12=", "max_tokens": 2}
                )
        finally:
            await server.stop()
        return response, small

    response, small = asyncio.run(run())
    if response is not None or not chunked:
        assert response.status_code == 413, response.text
        assert "request body larger than 65536 bytes" in response.json()["detail"]
    if chunked:
        assert len(sent) < 1000  # the server stopped reading
    if server == "inference":
        assert small.status_code == 200  # a body within the limit is served as before


def test_n_times_max_tokens_over_the_limit_is_422_for_outside_requests_only():
    inference = SeededInference()
    app = create_inference_app(
        inference, inference.tokenizer, limits=ServerLimits(max_request_tokens=100)
    )

    async def run():
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            big = await client.post(
                "/v1/completions", json={"prompt": "1", "n": 4, "max_tokens": 26}
            )
            fits = await client.post(
                "/v1/completions", json={"prompt": "1", "n": 4, "max_tokens": 25}
            )
            key = {"batch_id": 0, "index_in_batch": 0, "sample_index": 0}
            keyed = await client.post(
                "/v1/completions",
                json={"prompt": "1", "n": 4, "max_tokens": 26, "rollout_key": key},
            )
        return big, fits, keyed

    big, fits, keyed = asyncio.run(run())
    assert big.status_code == 422 and "4 x 26 = 104 tokens" in big.json()["detail"]
    assert fits.status_code == 200 and keyed.status_code == 200


class Held(InferenceInterface):
    """Generates nothing until released; records cancellations."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0
        self.cancelled = 0

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        self.started += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return InferenceResponse(
            prompt_tokens=[1],
            tokens=[1],
            text="",
            logprobs=[0.0],
            policy_versions=[0],
            finish_reason="stop",
        )


def test_a_client_over_its_in_flight_limit_gets_429_and_its_slots_come_back():
    async def run():
        held = Held()
        app = create_inference_app(
            held, CharTokenizer(), limits=ServerLimits(max_requests_per_client=2)
        )
        server = await serving(app)
        body = {"prompt": "1", "max_tokens": 2}
        try:
            async with httpx.AsyncClient(base_url=server.url) as client:
                first = [
                    asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)
                ]
                while held.started < 2:
                    await asyncio.sleep(0.01)
                refused = await client.post("/v1/completions", json=body)
                held.release.set()
                done = await asyncio.gather(*first)
                after = await client.post("/v1/completions", json=body)
        finally:
            await server.stop()
        return refused, done, after

    refused, done, after = asyncio.run(run())
    assert refused.status_code == 429 and "2 requests in flight" in refused.json()["detail"]
    assert [r.status_code for r in done] == [200, 200] and after.status_code == 200


def test_a_disconnected_clients_generation_is_cancelled():
    async def run():
        held = Held()
        server = await serving(create_inference_app(held, CharTokenizer()))
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=0.3) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post("/v1/completions", json={"prompt": "1", "max_tokens": 2})
            deadline = time.monotonic() + 3
            while not held.cancelled and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return held.started, held.cancelled  # before the server's shutdown cancels anything
        finally:
            await server.stop()

    assert asyncio.run(run()) == (1, 1)


class SlowSteps(FakeSteps):
    """A forward that takes ``seconds`` of the event loop's thread, as a real one does."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def step(self, plan):
        time.sleep(self.seconds)
        return super().step(plan)


def test_after_abandoned_large_requests_a_fresh_request_is_answered_within_two_steps():
    """Three clients ask for n=4 x 2000 tokens and leave; a fresh 2-token request then gets its
    two tokens within two engine steps of its arrival, and the abandoned rows stop stepping."""
    steps = SlowSteps(0.01)
    tokenizer = CharTokenizer()

    async def run():
        config = SchedulerConfig(max_requests=16, max_seq_len=2048)
        async with inference_app(steps, config, tokenizer) as (app, engine):
            server = await serving(app)
            big = {"prompt": "12=", "max_tokens": 2000, "n": 4, "ignore_eos": True}
            try:
                async with httpx.AsyncClient(base_url=server.url, timeout=0.5) as client:
                    for outcome in await asyncio.gather(
                        *(client.post("/v1/completions", json=big) for _ in range(3)),
                        return_exceptions=True,
                    ):
                        assert isinstance(outcome, httpx.ReadTimeout), outcome
                await asyncio.sleep(0.2)  # the server notices the disconnects
                before = len(steps.plans)
                async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                    fresh = await client.post(
                        "/v1/completions", json={"prompt": "1", "max_tokens": 2, "ignore_eos": True}
                    )
                return fresh, steps.plans[before:], engine.holds_requests()
            finally:
                await server.stop()

    fresh, plans, holding = asyncio.run(run())
    assert fresh.status_code == 200 and len(fresh.json()["choices"][0]["token_ids"]) == 2
    rows = [sum(len(r) for r in plan.rows) for plan in plans]
    assert rows == [1, 1], rows  # two steps, each with the fresh request's row alone
    assert not holding
