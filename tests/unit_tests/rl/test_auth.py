"""The job's shared key: each server refuses requests without it, each client sends it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from grpo_testing.fakes import SeededInference

from megatron.rl.agent.env_config import build_agents
from megatron.rl.agent.remote import RemoteAgent, RemoteAgentArgs, RemoteEnvironmentError
from megatron.rl.auth import API_KEY_ENV, api_key_source, read_api_key
from megatron.rl.http_client import RetryPolicy
from megatron.rl.server.env_server import EnvServerConfig, create_app, main
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup

KEY = "s3cret-key-of-this-job"
ENVS = [{"agent_type": "digits", "env_id": "copy", "agent_args": {"task": "copy"}}]
INFERENCE_URL = "http://trainer:9000"


def request() -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=1,
        index_in_batch=0,
        groups_in_batch=2,
        group_size=3,
        seed=4,
        submission_policy_version=0,
    )


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
    """The JSON body of a grouped-rollouts call (``url`` unchecked: the server validates it)."""
    return {"request": request().model_dump(mode="json"), "inference_url": url}


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


KEYED = EnvServerConfig(api_key=KEY, allowed_inference_urls=(INFERENCE_URL,))
"""A keyed env server that may send the key to the trainer of ``INFERENCE_URL``."""


def test_env_server_with_the_key_generates_through_an_inference_server_that_needs_it_too():
    app = env_app(KEYED)
    response = call(
        app, "POST", "/v1/grouped_rollouts", {"authorization": f"Bearer {KEY}"}, grouped_call()
    )
    assert response.status_code == 200
    group = RolloutGroup.model_validate(response.json())
    assert not any(r.is_placeholder for r in group.rollouts)  # the key reached the inference app


def test_inference_server_refusing_the_env_servers_key_is_a_424_not_placeholders():
    app = env_app(KEYED, inference_key="another-key")
    response = call(
        app, "POST", "/v1/grouped_rollouts", {"authorization": f"Bearer {KEY}"}, grouped_call()
    )
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


@pytest.mark.parametrize(
    "allowed, url, status",
    [
        pytest.param("http://127.0.0.1:800", "http://127.0.0.1:800", 200, id="same-origin"),
        pytest.param("http://127.0.0.1:800", "http://127.0.0.1:8007", 403, id="digit-extension"),
        pytest.param("http://127.0.0.1:800", "http://127.0.0.1:80", 403, id="digits-cut"),
        pytest.param(
            "http://127.0.0.1:800", "http://127.0.0.1.evil.com:800", 403, id="host-suffix"
        ),
        pytest.param("http://trainer:9000", "http://trainer.evil:9000", 403, id="label-suffix"),
        pytest.param("http://trainer:9000", "http://user@trainer:9000", 422, id="userinfo"),
        pytest.param("http://trainer:9000", "https://trainer:9000", 403, id="https-for-http"),
        pytest.param("https://trainer", "http://trainer:443", 403, id="http-on-https-port"),
        pytest.param("http://trainer", "http://trainer:80", 200, id="http-default-port"),
        pytest.param("https://trainer:443", "https://trainer", 200, id="https-default-port"),
        pytest.param("http://trainer:9000", "http://trainer", 403, id="port-left-out"),
        pytest.param("http://trainer:9000/", "http://trainer:9000", 200, id="entry-slash"),
        pytest.param("http://trainer:9000", "http://trainer:9000/", 200, id="url-slash"),
        pytest.param("http://trainer:9000", "http://trainer:9000/v2", 200, id="url-path"),
        pytest.param("http://trainer:9000", "http://TRAINER:9000", 200, id="host-case"),
        pytest.param("http://[::1]:9000", "http://[::1]:9000", 200, id="ipv6"),
    ],
)
def test_env_server_calls_only_the_origins_it_allows(allowed, url, status):
    config = EnvServerConfig(allowed_inference_urls=("http://other:1", allowed))
    response = call(env_app(config, None), "POST", "/v1/grouped_rollouts", {}, grouped_call(url))
    assert response.status_code == status, response.text
    if status != 200:
        assert "field 'inference_url'" in response.json()["detail"]


def test_the_job_key_reaches_only_an_allowed_origin_and_no_other_listener():
    """Real sockets: the allowed port P gets the key, the listener on port P7 gets nothing."""

    async def run():
        heard: dict[int, bytes] = {}
        servers, port = await listeners_on_p_and_p7(heard)
        allowed = f"http://127.0.0.1:{port}"
        config = EnvServerConfig(
            api_key=KEY, allowed_inference_urls=(allowed,), retry=RetryPolicy(0)
        )
        app = create_app(build_agents(ENVS), config)  # real network
        headers = {"authorization": f"Bearer {KEY}"}
        try:
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app)
                async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
                    refused = await client.post(
                        "/v1/grouped_rollouts",
                        headers=headers,
                        json=grouped_call(f"http://127.0.0.1:{port}7"),
                    )
                    served = await client.post(
                        "/v1/grouped_rollouts", headers=headers, json=grouped_call(allowed)
                    )
                    await asyncio.sleep(0.2)  # a late connection to P7 would be heard by now
        finally:
            for server in servers:
                server.close()
        return refused, served, heard, port

    refused, served, heard, port = asyncio.run(run())
    assert refused.status_code == 403
    assert served.status_code == 424  # the listener on P is no inference server
    assert f"\r\nauthorization: Bearer {KEY}\r\n".encode() in heard[port]
    assert heard.get(port * 10 + 7, b"") == b""


async def listeners_on_p_and_p7(heard: dict[int, bytes]):
    """TCP listeners on 127.0.0.1 ports P and P*10+7 (P < 6553) that record what they receive
    (by port) and close; (servers, P)."""

    def recorder(port: int):
        async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            heard[port] = heard.get(port, b"") + await reader.read(65536)
            writer.close()

        return record

    for port in range(3001, 6553, 97):
        servers = []
        try:
            for p in (port, port * 10 + 7):
                servers.append(await asyncio.start_server(recorder(p), "127.0.0.1", p))
            return servers, port
        except OSError:
            for server in servers:
                server.close()
    raise RuntimeError("no free port pair P, P7 below 65536")


@pytest.mark.parametrize(
    "url, status",
    [
        pytest.param("http://127.0.0.1:9000", 200, id="loopback-v4"),
        pytest.param("http://localhost:9000", 200, id="localhost"),
        pytest.param("http://[::1]:9000", 200, id="loopback-v6"),
        pytest.param(INFERENCE_URL, 403, id="another-host"),
        pytest.param("http://10.0.0.7:9000", 403, id="private-address"),
    ],
)
def test_a_keyed_env_server_without_an_allow_list_sends_its_key_to_loopback_only(url, status):
    response = call(
        env_app(EnvServerConfig(api_key=KEY)),
        "POST",
        "/v1/grouped_rollouts",
        {"authorization": f"Bearer {KEY}"},
        grouped_call(url),
    )
    assert response.status_code == status, response.text
    if status == 403:
        assert "loopback servers only" in response.json()["detail"]


def test_every_server_refuses_a_public_interface_without_a_key_in_the_same_words(capsys):
    from megatron.rl.auth import listen_problem

    expected = listen_problem("0.0.0.0", False, "--host", "--api-key-file")
    assert expected and "\n" not in expected and "0.0.0.0 is reachable" in expected
    with pytest.raises(SystemExit) as exc:  # the env server's command line
        main(["--host", "0.0.0.0"])
    assert exc.value.code == 2 and expected in capsys.readouterr().err
    assert listen_problem("0.0.0.0", True, "--host", "--api-key-file") is None
    for host in ("127.0.0.1", "localhost", "::1"):
        assert listen_problem(host, False, "--host", "--api-key-file") is None


@pytest.mark.parametrize(
    "entry, needle",
    [
        pytest.param("http://trainer:9000/v1", "is an origin", id="path"),
        pytest.param("http://u@trainer:9000", "user info", id="userinfo"),
        pytest.param("http://trainer:99999", "outside 1-65535", id="port"),
        pytest.param("trainer:9000", "only http and https", id="no-scheme"),
    ],
)
def test_env_server_cli_refuses_an_allowed_entry_that_is_not_an_origin(entry, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--allowed-inference-url", entry])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--allowed-inference-url {entry!r}" in err and needle in err


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


@pytest.mark.parametrize(
    "path, environ, source",
    [
        pytest.param("/run/job.key", {API_KEY_ENV: "s3cret"}, "--flag /run/job.key", id="file"),
        pytest.param(
            None, {API_KEY_ENV: "s3cret"}, f"the environment variable {API_KEY_ENV}", id="variable"
        ),
        pytest.param(None, {API_KEY_ENV: ""}, "none", id="empty-variable"),
        pytest.param(None, {}, "none", id="none"),
    ],
)
def test_the_key_source_names_the_file_or_variable_never_the_key(path, environ, source):
    assert api_key_source(path, environ, "--flag") == source
    assert "s3cret" not in source
