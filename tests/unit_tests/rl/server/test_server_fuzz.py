"""Property-based fuzzing of both servers from their OpenAPI schemas: no input gives a 5xx.

schemathesis generates schema-conforming and schema-violating requests for every operation;
each answer must be 2xx or a 4xx with a readable ``detail``.
"""

from __future__ import annotations

import contextlib

import httpx
import schemathesis
from grpo_testing.fakes import FakeSteps, SeededInference
from hypothesis import HealthCheck, settings

from megatron.rl.agent.env_config import build_agents
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.server.env_server import create_app
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


def inference_app_over_a_running_engine():
    """The inference server over a real ContinuousBatchingScheduler whose loop the app's lifespan runs
    (schemathesis serves ASGI apps from its own event loop; each lifespan gets a fresh engine)."""
    tokenizer = CharTokenizer()
    interface = LocalInferenceInterface(None, tokenizer)
    app = create_inference_app(interface, tokenizer)

    @contextlib.asynccontextmanager
    async def engine_running(app):
        interface.engine = ContinuousBatchingScheduler(
            FakeSteps(), SchedulerConfig(max_requests=8, max_seq_len=64), lambda: 0
        )
        interface.engine.start()
        interface.engine.resume()
        yield
        await interface.engine.aclose()

    app.router.lifespan_context = engine_running
    return app


inference_schema = schemathesis.openapi.from_asgi(
    "/openapi.json", inference_app_over_a_running_engine()
)


@inference_schema.parametrize()
@FUZZ
def test_inference_server_never_answers_5xx(case):
    check_answer(case.call())
