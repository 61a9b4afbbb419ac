"""HTTP plumbing of the env server and the trainer's inference server.

* ``install_error_handlers``: every error answer is ``ErrorResponse`` with a sentence naming the
  offending field, instead of FastAPI's default list.
* ``EmbeddedServer``: uvicorn inside an already running event loop (the trainer's), leaving the
  process's signal handlers alone.

Clients live in ``megatron.rl.http_client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from megatron.rl.wire import ErrorResponse

logger = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse}
    for status in (400, 401, 403, 404, 413, 422, 424, 429, 500, 503)
}
"""``responses=`` for routes, so the OpenAPI schema documents the error body."""


def install_error_handlers(app: FastAPI) -> None:
    """422 answers name each invalid field; unexpected exceptions become a 500 sentence."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": describe_errors(exc.errors())})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(
            status_code=500, content={"detail": f"internal error: {type(exc).__name__}: {exc}"}
        )


def describe_errors(errors: Sequence[Any]) -> str:
    """One sentence per validation error: the field it names, or the byte of invalid JSON.

    For a body that is not JSON, FastAPI reports ``loc = ("body", <byte offset>)``; that offset
    is no field, so it reads ``invalid JSON at byte N: <reason>``.
    """
    problems = []
    for err in errors:
        if err.get("type") == "json_invalid":
            where = [p for p in err.get("loc", ()) if p != "body"]
            reason = (err.get("ctx") or {}).get("error", err.get("msg", "invalid"))
            at = f" at byte {where[0]}" if where and isinstance(where[0], int) else ""
            problems.append(f"invalid JSON{at}: {reason}")
            continue
        loc = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
        problems.append(f"field '{loc or 'body'}': {err.get('msg', 'invalid')}")
    return "; ".join(problems)


class EmbeddedServer(uvicorn.Server):
    """uvicorn serving ``app`` as a task of the running loop, without touching signals.

    ``await EmbeddedServer.start(app, host, port)`` binds (port 0 picks a free one) and serves;
    ``await server.stop()`` shuts down gracefully, dropping connections after a few seconds.
    """

    @contextlib.contextmanager
    def capture_signals(self):
        """The host process keeps its own signal handling."""
        yield

    @classmethod
    async def start(cls, app: FastAPI, host: str, port: int) -> EmbeddedServer:
        """Bind ``host:port`` and start serving ``app`` in the current loop."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto must be IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets whose
        # proto says TCP; with proto 0 every response waits ~40 ms for a delayed ACK (Nagle).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=5, lifespan="on"
        )
        server = cls(config)
        server.port = sock.getsockname()[1]
        server.host = host
        server._task = asyncio.get_running_loop().create_task(
            server.serve(sockets=[sock]), name=f"http-server-{host}:{server.port}"
        )
        while not server.started:
            if server._task.done():
                server._task.result()  # raises the start-up error
                raise RuntimeError(f"server on {host}:{server.port} stopped during start-up")
            await asyncio.sleep(0.01)
        return server

    @property
    def url(self) -> str:
        """Base URL clients use (the machine's name when bound to every interface)."""
        host = self.host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        """Stop accepting, finish or drop open connections, and wait for the task."""
        self.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
