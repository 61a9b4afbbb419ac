"""Property-based fuzzing of both servers from their OpenAPI schemas: no input gives a 5xx.

schemathesis generates schema-conforming and schema-violating requests for every operation;
each answer must be 2xx or a 4xx with a readable ``detail``.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import schemathesis
from grpo_testing.fakes import FakeSteps, SeededInference
from hypothesis import HealthCheck, settings

from megatron.rl.agent.env_config import build_agents
from megatron.rl.inference.engine import LocalEngineConfig, LocalInferenceEngine
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.server.env_server import create_app
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tokenizer import CharTokenizer

ENVS = [
    {"agent_type": "digits", "env_id": "copy", "agent_args": {"task": "copy"}},
    {"agent_type": "grpo_testing.fakes:FlakyDigits", "env_id": "flaky"},
]
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same examples on every run: a failure reproduces
)


def check_answer(response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        assert response.json()["detail"]


# The env server in process; its calls to "the trainer" go to an in-process stub whatever URL
# was generated.
stub = SeededInference()
env_app = create_app(
    build_agents(ENVS), transport=httpx.ASGITransport(create_inference_app(stub, stub.tokenizer))
)
env_schema = schemathesis.openapi.from_asgi("/openapi.json", env_app)


@env_schema.parametrize()
@FUZZ
def test_env_server_never_answers_5xx(case):
    check_answer(case.call())


class EngineServerThread:
    """The inference server over a real LocalInferenceEngine, in a thread with its own loop."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)

    async def _start(self) -> str:
        tokenizer = CharTokenizer()
        self.engine = LocalInferenceEngine(
            FakeSteps(), LocalEngineConfig(max_requests=8, max_seq_len=64), lambda: 0
        )
        self.engine.start()
        self.engine.resume()
        app = create_inference_app(LocalInferenceInterface(self.engine, tokenizer), tokenizer)
        self.server = await EmbeddedServer.start(app, "127.0.0.1", 0)
        return self.server.url

    async def _stop(self) -> None:
        await self.engine.aclose()
        await self.server.stop()

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def inference_url():
    with EngineServerThread() as url:
        yield url


@pytest.fixture(scope="module")
def inference_schema(inference_url):
    return schemathesis.openapi.from_url(f"{inference_url}/openapi.json")


lazy_inference_schema = schemathesis.pytest.from_fixture("inference_schema")


@lazy_inference_schema.parametrize()
@FUZZ
def test_inference_server_never_answers_5xx(case):
    check_answer(case.call())
