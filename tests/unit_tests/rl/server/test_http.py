"""The embedded uvicorn server of the trainer's inference server."""

from __future__ import annotations

import asyncio
import signal
import socket

import httpx
import pytest
from fastapi import FastAPI, HTTPException

from megatron.rl.server.http import EmbeddedServer


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


def test_embedded_server_serves_on_a_free_port_and_stops():
    app, _ = scripted_app([200])

    async def run():
        server = await EmbeddedServer.start(app, "127.0.0.1", 0)
        listening = server.servers[0].sockets[0]
        assert listening.proto == socket.IPPROTO_TCP  # accepted sockets get TCP_NODELAY
        async with httpx.AsyncClient() as c:
            first = (await c.get(f"{server.url}/x")).json()
        await server.stop()
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as c:
                await c.get(f"{server.url}/x")
        return server.port, first

    port, first = asyncio.run(run())
    assert port > 0 and first == {"n": 1}


def test_embedded_server_leaves_signal_handlers_alone():
    app, _ = scripted_app([200])
    before = signal.getsignal(signal.SIGTERM)

    async def run():
        server = await EmbeddedServer.start(app, "127.0.0.1", 0)
        during = signal.getsignal(signal.SIGTERM)
        await server.stop()
        return during

    assert asyncio.run(run()) is before
