"""What a server takes from an outside client, and when it stops working for one.

* ``BodyLimit``: a request body over ``max_body_bytes`` is answered 413 as soon as its
  ``Content-Length`` (or, without one, the bytes received) exceed it, before it is read whole.
* ``admission``: the ``FairQueue`` (``fair_queue.py``) an outside generation request waits in for
  its turn: at most ``max_requests_per_client`` of one client address running and
  ``engine_slots`` engine slots taken by all, the rest queued and served round robin across
  client addresses; past ``max_queued_requests`` queued (``max_queued_per_client`` of one client)
  the next is answered 429 with ``Retry-After``.
* ``unless_disconnected``: the generation of an outside request (or its wait in the queue) is
  cancelled when its client disconnects; the engine frees a cancelled request's slot at its next
  step.

Keyed rollout requests (an environment's, owned by the trainer's schedule) are exempt from the
last two: the trainer sized them, and cancelling or delaying one would change the run.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import HTTPException, Request

from megatron.rl.server.fair_queue import FairQueue

T = TypeVar("T")


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and per-client limits of a server's outside requests."""

    max_body_bytes: int = 8 << 20
    """Largest request body (413 above it)."""
    max_request_tokens: int = 1 << 16
    """Largest ``n`` x ``max_tokens`` of one outside generation request (422 above it)."""
    max_requests_per_client: int = 16
    """Outside generation requests of one client address running at once (more wait their turn
    in the queue)."""
    max_queued_requests: int = 512
    """Outside generation requests waiting in the queue, in all (429 with ``Retry-After`` above
    it)."""
    max_queued_per_client: int = 256
    """Outside generation requests of one client address waiting in the queue (429 above it)."""
    engine_slots: int | None = None
    """Engine slots outside requests may take at once (the rest wait in the queue, served round
    robin across clients); None: not bounded here (the engine queues them first come first
    served)."""


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes``, decided from ``Content-Length`` or
    while receiving, so an oversized body is never held whole; a body within the limit is
    passed on unchanged (and the client's disconnect after it)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return body
            return await receive()  # after the body: the client's disconnect, if it comes

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        message = (
            f"request body larger than {self.max_bytes} bytes (the server's request body limit)"
        )
        detail = json.dumps({"detail": message}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(detail)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": detail})


def admission(limits: ServerLimits) -> FairQueue:
    """The queue outside generation requests wait in for their turn under ``limits``."""
    return FairQueue(
        limits.engine_slots,
        limits.max_requests_per_client,
        limits.max_queued_requests,
        limits.max_queued_per_client,
    )


def client_of(http: Request) -> str:
    """The client address a request's slots are counted under."""
    return http.client.host if http.client else "unknown"


async def unless_disconnected(http: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled (and awaited)
    and the request ends with 499 (no one reads the answer). Call it after the body was read:
    the only message left to receive is the disconnect. Owns both tasks: whatever ends this
    call (the result, the disconnect, its own cancellation) cancels what still runs."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        raise HTTPException(499, "the client closed the request; its generation was cancelled")
    return task.result()


async def _disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
