"""What a server takes from an outside client, and when it stops working for one.

* ``BodyLimit``: a request body over ``max_body_bytes`` is answered 413 as soon as its
  ``Content-Length`` (or, without one, the bytes received) exceed it, before it is read whole.
* ``ClientSlots``: at most ``max_requests_per_client`` outside generation requests of one client
  address in flight; the next is answered 429 naming the limit.
* ``unless_disconnected``: the generation of an outside request is cancelled when its client
  disconnects; the engine frees a cancelled request's slot at its next step.

Keyed rollout requests (an environment's, owned by the trainer's schedule) are exempt from the
last two: the trainer sized them, and cancelling one would change the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import HTTPException, Request

T = TypeVar("T")


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and per-client limits of a server's outside requests."""

    max_body_bytes: int = 8 << 20
    """Largest request body (413 above it)."""
    max_request_tokens: int = 1 << 16
    """Largest ``n`` x ``max_tokens`` of one outside generation request (422 above it)."""
    max_requests_per_client: int = 16
    """Outside generation requests of one client address in flight at once (429 above it)."""


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


class ClientSlots:
    """Outside requests in flight per client address, at most ``limit`` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, client: str) -> Iterator[None]:
        """One of ``client``'s slots for the ``with`` block; 429 when it has none left."""
        release = self.take(client)
        try:
            yield
        finally:
            release()

    def take(self, client: str) -> Callable[[], None]:
        """One of ``client``'s slots until the returned function is called (once; later calls do
        nothing); 429 when it has none left."""
        if self._in_flight[client] >= self.limit:
            raise HTTPException(
                429,
                f"{client} has {self.limit} requests in flight, the most this server takes from "
                "one client: wait for one to finish",
            )
        self._in_flight[client] += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self._in_flight[client] -= 1
                if not self._in_flight[client]:
                    del self._in_flight[client]

        return release


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
