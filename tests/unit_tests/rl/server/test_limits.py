"""What a server takes from outside clients: body size (413), n x max_tokens (422), the queue of
outside requests (their turn within the engine's slots and the per-client limit, round robin
across client addresses, 429 with Retry-After past its bound, keyed requests exempt), and
abandoned requests (queued or generating) shed, measured over real sockets or in process."""

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
        return one_token_answer()


def one_token_answer() -> InferenceResponse:
    """The response of the test engines: one token, stopped."""
    return InferenceResponse(
        prompt_tokens=[1],
        tokens=[1],
        text="",
        logprobs=[0.0],
        policy_versions=[0],
        finish_reason="stop",
    )


async def until(condition, timeout: float = 5.0) -> None:
    """Wait for ``condition()`` (polling the loop)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


def client_at(app, address: str) -> httpx.AsyncClient:
    """A client of ``app`` (in process) whose requests come from ``address``."""
    transport = httpx.ASGITransport(app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://s", timeout=10)


class Turnstile(InferenceInterface):
    """Each request runs until ``finish_oldest``; records the prompts in the order they start."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._running: list[asyncio.Event] = []

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        gate = asyncio.Event()
        self.started.append(request.prompt)
        self._running.append(gate)
        await gate.wait()
        return one_token_answer()

    def finish_oldest(self) -> None:
        self._running.pop(0).set()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_seventeen_simultaneous_requests_from_one_address_queue_and_all_succeed(stream):
    """16 run at once (--rl-max-requests-per-client), the 17th waits its turn (before the queue:
    429) and runs as soon as one of them ends."""

    async def run():
        held = Held()
        app = create_inference_app(held, CharTokenizer())  # the default limits
        server = await serving(app)
        body = {"prompt": "1", "max_tokens": 2, "stream": stream}
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                sent = [
                    asyncio.create_task(client.post("/v1/completions", json=body))
                    for _ in range(17)
                ]
                await until(lambda: held.started == 16)
                await asyncio.sleep(0.1)  # the 17th arrived too (before the queue: a 429)
                running_before = held.started
                queue = getattr(app.state, "admission", None)
                queued_then = None if queue is None else queue.queued
                held.release.set()
                answers = await asyncio.gather(*sent)
        finally:
            await server.stop()
        return running_before, queued_then, answers, held.started

    running_before, queued_then, answers, started = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 17, [a.text for a in answers]
    assert (running_before, queued_then, started) == (16, 1, 17)
    if stream:
        assert all(a.text.rstrip().endswith("data: [DONE]") for a in answers)


def test_another_clients_request_is_served_before_the_tail_of_a_flood():
    """One slot for outside requests: client A sends six requests at once, then client B one;
    B's request runs after A's second, not after its sixth."""

    async def run():
        turnstile = Turnstile()
        app = create_inference_app(turnstile, CharTokenizer(), limits=ServerLimits(engine_slots=1))
        queue = app.state.admission
        async with client_at(app, "10.0.0.1") as a, client_at(app, "10.0.0.2") as b:
            body = {"prompt": "1", "max_tokens": 2}
            sent = [asyncio.create_task(a.post("/v1/completions", json=body)) for _ in range(6)]
            await until(lambda: turnstile.started == ["1"] and queue.queued == 5)
            body = {"prompt": "2", "max_tokens": 2}
            sent.append(asyncio.create_task(b.post("/v1/completions", json=body)))
            await until(lambda: queue.queued == 6)
            for count in range(2, 8):
                turnstile.finish_oldest()
                await until(lambda: len(turnstile.started) == count)
            turnstile.finish_oldest()
            answers = await asyncio.gather(*sent)
        return turnstile.started, answers

    started, answers = asyncio.run(run())
    assert started == ["1", "1", "2", "1", "1", "1", "1"]
    assert [a.status_code for a in answers] == [200] * 7


def test_past_the_queue_bound_an_outside_request_gets_429_with_retry_after():
    async def run():
        held = Held()
        limits = ServerLimits(engine_slots=1, max_queued_requests=2)
        app = create_inference_app(held, CharTokenizer(), limits=limits)
        async with client_at(app, "10.0.0.1") as a, client_at(app, "10.0.0.2") as b:
            body = {"prompt": "1", "max_tokens": 2}
            sent = [asyncio.create_task(a.post("/v1/completions", json=body)) for _ in range(3)]
            await until(lambda: held.started == 1 and app.state.admission.queued == 2)
            refused = await b.post("/v1/completions", json=body)
            streamed = await b.post("/v1/completions", json={**body, "stream": True})
            held.release.set()
            answers = await asyncio.gather(*sent)
            after = await b.post("/v1/completions", json=body)
        return refused, streamed, answers, after

    refused, streamed, answers, after = asyncio.run(run())
    for response in (refused, streamed):
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "1"  # nothing served yet: the least
        assert "--rl-max-queued-requests" in response.json()["detail"]
    assert [a.status_code for a in answers] == [200] * 3 and after.status_code == 200


def test_a_client_that_disconnects_while_queued_leaves_the_queue_at_once():
    async def run():
        held = Held()
        app = create_inference_app(held, CharTokenizer(), limits=ServerLimits(engine_slots=1))
        queue = app.state.admission
        server = await serving(app)
        body = {"prompt": "1", "max_tokens": 2}
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                running = asyncio.create_task(client.post("/v1/completions", json=body))
                await until(lambda: held.started == 1)
                async with httpx.AsyncClient(base_url=server.url, timeout=0.3) as leaving:
                    with pytest.raises(httpx.ReadTimeout):
                        await leaving.post("/v1/completions", json=body)
                await until(lambda: queue.queued == 0)  # it left while the first still runs
                started_then = held.started
                held.release.set()
                first = await running
                fresh = await client.post("/v1/completions", json=body)
        finally:
            await server.stop()
        return started_then, first, fresh, held.started, held.cancelled

    started_then, first, fresh, started, cancelled = asyncio.run(run())
    assert started_then == 1  # the queued request never reached the engine
    assert first.status_code == 200 and fresh.status_code == 200
    assert (started, cancelled) == (2, 0)


def test_keyed_rollout_requests_skip_the_queue():
    """Outside requests fill the one slot and the client's one running request, and another
    waits; the trainer's keyed requests from the same address go straight to the engine."""

    async def run():
        held = Held()
        limits = ServerLimits(engine_slots=1, max_requests_per_client=1, max_queued_requests=1)
        app = create_inference_app(held, CharTokenizer(), limits=limits)
        queue = app.state.admission
        async with client_at(app, "10.0.0.1") as client:
            body = {"prompt": "1", "max_tokens": 2}
            sent = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in "ab"]
            await until(lambda: held.started == 1 and queue.queued == 1)
            for i in range(3):
                key = {"batch_id": 0, "index_in_batch": i, "sample_index": 0}
                keyed = {**body, "rollout_key": key}
                sent.append(asyncio.create_task(client.post("/v1/completions", json=keyed)))
            await until(lambda: held.started == 4)
            queued_then = queue.queued
            held.release.set()
            answers = await asyncio.gather(*sent)
        return queued_then, answers

    queued_then, answers = asyncio.run(run())
    assert queued_then == 1  # the outside request still waits; the keyed ones run
    assert [a.status_code for a in answers] == [200] * 5


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
