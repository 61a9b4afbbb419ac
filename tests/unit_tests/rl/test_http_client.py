"""Retries, error messages and client pools of the RL library's HTTP client."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import PlainTextResponse
from grpo_testing.fakes import RaisingTransport

from megatron.rl.http_client import ClientPool, RemoteCallError, RetryPolicy, call_json
from megatron.rl.server.http import EmbeddedServer

FAST = RetryPolicy(max_retries=2, backoff_s=0.001)


def scripted_app(statuses: list[int]):
    """An app answering GET /x with the given statuses in turn (200 answers {"n": calls})."""
    app = FastAPI()
    calls = []

    @app.get("/x")
    async def x():
        calls.append(1)
        status = statuses[min(len(calls), len(statuses)) - 1]
        if status != 200:
            raise HTTPException(status, f"scripted {status}")
        return {"n": len(calls)}

    return app, calls


def call(app, policy=FAST, timeout=5.0):
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), timeout=timeout) as c:
            return await call_json(c, "GET", "http://server/x", policy=policy)

    return asyncio.run(run())


def test_retries_5xx_then_succeeds():
    app, calls = scripted_app([503, 502, 200])
    assert call(app) == {"n": 3}


def test_gives_up_after_max_retries_naming_the_url_and_last_error():
    app, calls = scripted_app([503])
    with pytest.raises(RemoteCallError, match=r"http://server/x failed after 3 attempts.*503"):
        call(app)
    assert len(calls) == 3


def test_4xx_is_not_retried_and_keeps_the_status():
    app, calls = scripted_app([422, 200])
    with pytest.raises(RemoteCallError, match="scripted 422") as info:
        call(app)
    assert info.value.status == 422 and len(calls) == 1


def test_connection_refused_is_retried_then_reported():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def run():
        async with httpx.AsyncClient() as c:
            await call_json(c, "GET", f"http://127.0.0.1:{port}/x", policy=FAST)

    with pytest.raises(RemoteCallError, match=f"127.0.0.1:{port}.*after 3 attempts.*Connect"):
        asyncio.run(run())


def test_read_timeout_is_not_retried():
    app = FastAPI()
    calls = []

    @app.get("/x")
    async def slow():
        calls.append(1)
        await asyncio.sleep(5)

    async def run():
        server = await EmbeddedServer.start(app, "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(0.2)) as c:
                await call_json(c, "GET", f"{server.url}/x", policy=FAST)
        finally:
            server.force_exit = True
            await server.stop()

    with pytest.raises(RemoteCallError, match="read timeout"):
        asyncio.run(run())
    assert len(calls) == 1


def test_client_pool_spreads_calls_over_small_pools():
    pool = ClientPool(max_connections=40, timeout=httpx.Timeout(1.0), shard_size=16)
    clients = [pool.client() for _ in range(6)]
    assert len({id(c) for c in clients}) == 3  # ceil(40 / 16) shards, used in turn
    assert clients[:3] == clients[3:]
    asyncio.run(pool.aclose())


# --------------------------------------------------------------------------- every failure named


def httpx_error_classes() -> list[type[Exception]]:
    """Every exception class httpx exports."""
    return sorted(
        (c for c in vars(httpx).values() if isinstance(c, type) and issubclass(c, Exception)),
        key=lambda c: c.__name__,
    )


@pytest.mark.parametrize("error", httpx_error_classes(), ids=lambda c: c.__name__)
def test_every_httpx_error_ends_as_one_remote_call_error_naming_the_url(error):
    transport = RaisingTransport(error)

    async def run():
        async with httpx.AsyncClient(transport=transport) as c:
            await call_json(c, "POST", "http://trainer:9000/v1/completions", policy=FAST)

    with pytest.raises(RemoteCallError, match="http://trainer:9000/v1/completions") as info:
        asyncio.run(run())
    assert info.value.status is None and error.__name__ in str(info.value)
    retried = issubclass(error, httpx.TransportError) and not issubclass(
        error, (httpx.ReadTimeout, httpx.UnsupportedProtocol, httpx.LocalProtocolError)
    )
    assert transport.calls == (FAST.max_retries + 1 if retried else 1)


@pytest.mark.parametrize(
    "error, needle",
    [
        pytest.param(
            ExceptionGroup(
                "unhandled errors in a TaskGroup", [OverflowError("port must be 0-65535")]
            ),
            "OverflowError: port must be 0-65535",
            id="exception-group",
        ),
        pytest.param(UnicodeError("label too long"), "UnicodeError: label too long", id="idna"),
    ],
)
def test_errors_from_beneath_httpx_end_as_a_remote_call_error(error, needle):
    async def run():
        async with httpx.AsyncClient(transport=RaisingTransport(error)) as c:
            await call_json(c, "POST", "http://trainer:9000/x", policy=FAST)

    with pytest.raises(RemoteCallError, match=needle):
        asyncio.run(run())


def test_a_port_the_socket_layer_refuses_is_a_remote_call_error_not_an_exception_group():
    """What anyio raises for port 99999 on a real connection (the schema refuses such URLs)."""

    async def run():
        async with httpx.AsyncClient() as c:
            await call_json(c, "POST", "http://127.0.0.1:99999/x", policy=FAST)

    with pytest.raises(RemoteCallError, match="OverflowError"):
        asyncio.run(run())


def test_a_success_whose_body_is_not_json_is_a_remote_call_error():
    app = FastAPI()

    @app.get("/x")
    async def text():
        return PlainTextResponse("<html>proxy page</html>")

    with pytest.raises(RemoteCallError, match="HTTP 200 with a body that is not JSON.*proxy page"):
        call(app)
