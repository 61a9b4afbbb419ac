"""The job's shared key: each server refuses requests without it, each client sends it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from grpo_testing.fakes import SeededInference

from megatron.rl.agent.env_config import build_agents
from megatron.rl.agent.remote import RemoteAgent, RemoteAgentArgs, RemoteEnvironmentError
from megatron.rl.auth import API_KEY_ENV, read_api_key
from megatron.rl.server.env_server import EnvServerConfig, create_app, main
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.wire import GroupedRolloutCall, GroupedRolloutRequest, RolloutGroup

KEY = "s3cret-key-of-this-job"
ENVS = [{"agent_type": "digits", "env_id": "copy", "agent_args": {"task": "copy"}}]
INFERENCE_URL = "http://trainer:9000"


def request() -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=1, index_in_batch=0, groups_in_batch=2, group_size=3, seed=4,
        submission_policy_version=0,
    )  # fmt: skip


def call(app, method: str, path: str, headers: dict, body=None):
    async def run():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
                return await client.request(method, path, json=body, headers=headers)

    return asyncio.run(run())


def env_app(config: EnvServerConfig, inference_key: str | None = KEY):
    inference = SeededInference()
    inference_app = create_inference_app(inference, inference.tokenizer, api_key=inference_key)
    return create_app(build_agents(ENVS), config, transport=httpx.ASGITransport(inference_app))


def grouped_call(url: str = INFERENCE_URL) -> dict:
    return GroupedRolloutCall(request=request(), inference_url=url).model_dump(mode="json")


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="no-key"),
        pytest.param({"authorization": "Bearer wrong"}, id="wrong-key"),
        pytest.param({"authorization": KEY}, id="no-bearer-scheme"),
    ],
)
@pytest.mark.parametrize("path", ["/health", "/v1/grouped_rollouts", "/openapi.json"])
def test_env_server_refuses_requests_without_the_key(headers, path):
    app = env_app(EnvServerConfig(api_key=KEY))
    method, body = ("GET", None) if path != "/v1/grouped_rollouts" else ("POST", grouped_call())
    response = call(app, method, path, headers, body)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert KEY not in response.text


def test_env_server_with_the_key_generates_through_an_inference_server_that_needs_it_too():
    app = env_app(EnvServerConfig(api_key=KEY))
    response = call(app, "POST", "/v1/grouped_rollouts", {"authorization": f"Bearer {KEY}"},
                    grouped_call())  # fmt: skip
    assert response.status_code == 200
    group = RolloutGroup.model_validate(response.json())
    assert not any(r.is_placeholder for r in group.rollouts)  # the key reached the inference app


def test_inference_server_refusing_the_env_servers_key_is_a_424_not_placeholders():
    app = env_app(EnvServerConfig(api_key=KEY), inference_key="another-key")
    response = call(app, "POST", "/v1/grouped_rollouts", {"authorization": f"Bearer {KEY}"},
                    grouped_call())  # fmt: skip
    assert response.status_code == 424 and "HTTP 401" in response.json()["detail"]


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}])
def test_inference_server_refuses_requests_without_the_key(headers):
    inference = SeededInference()
    app = create_inference_app(inference, inference.tokenizer, api_key=KEY)
    body = {"prompt": "12=", "max_tokens": 4}
    assert call(app, "POST", "/v1/completions", headers, body).status_code == 401
    assert call(app, "GET", "/health", headers).status_code == 401
    assert call(app, "GET", "/v1/models", headers).status_code == 401
    ok = call(app, "POST", "/v1/completions", {"authorization": f"Bearer {KEY}"}, body)
    assert ok.status_code == 200 and inference.requests


def test_env_server_refuses_inference_urls_outside_its_allowed_prefixes():
    config = EnvServerConfig(allowed_inference_urls=("http://trainer:",))
    refused = call(env_app(config, None), "POST", "/v1/grouped_rollouts", {},
                   grouped_call("http://elsewhere:9000"))  # fmt: skip
    assert refused.status_code == 403
    assert "field 'inference_url'" in refused.json()["detail"]
    allowed = call(env_app(config, None), "POST", "/v1/grouped_rollouts", {}, grouped_call())
    assert allowed.status_code == 200


def test_remote_agent_sends_the_key_from_its_environment_variable(monkeypatch):
    async def run(key: str | None):
        env = await EmbeddedServer.start(env_app(EnvServerConfig(api_key=KEY)), "127.0.0.1", 0)
        agent = RemoteAgent("remote", RemoteAgentArgs(url=env.url, max_retries=0))
        try:
            if key is None:
                monkeypatch.delenv(API_KEY_ENV, raising=False)
            else:
                monkeypatch.setenv(API_KEY_ENV, key)
            await agent.astart()
        finally:
            await agent.aclose()
            await env.stop()

    asyncio.run(run(KEY))
    with pytest.raises(RemoteEnvironmentError, match="HTTP 401"):
        asyncio.run(run(None))


def test_key_sources_and_the_config_never_shows_it(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n")
    assert read_api_key(str(key_file), {}, "--api-key-file") == KEY
    assert read_api_key(None, {API_KEY_ENV: "from-env"}, "--x") == "from-env"
    assert read_api_key(None, {}, "--x") is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="--api-key-file .*empty"):
        read_api_key(str(tmp_path / "empty"), {}, "--api-key-file")
    assert KEY not in repr(EnvServerConfig(api_key=KEY))


def test_env_server_cli_refuses_an_unreadable_key_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--api-key-file", str(tmp_path / "missing")])
    assert exc.value.code == 2 and "--api-key-file" in capsys.readouterr().err
