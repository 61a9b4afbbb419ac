"""The shared key of a job's servers: a bearer token that the env server and the trainer's
inference server require, and that their clients send.

One key per job (the Slurm launcher generates it) reaches every party through the environment
variable ``API_KEY_ENV`` or a key file (``--rl-api-key-file`` of the trainer, ``--api-key-file``
of the env server). It is compared in constant time and never logged or put on a command line.
Without a key the servers accept every request, as on a laptop's loopback interface.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Mapping
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

API_KEY_ENV = "MEGATRON_RL_API_KEY"
"""The environment variable holding the shared key."""


def read_api_key(path: str | None, environ: Mapping[str, str], flag: str) -> str | None:
    """The key in file ``path`` (``flag`` names it in errors), else ``environ[API_KEY_ENV]``,
    else None. Raises ``ValueError`` for an unreadable or empty file."""
    if path is not None:
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{flag} {path}: cannot read the key: {exc}") from None
        if not key:
            raise ValueError(f"{flag} {path}: the file is empty")
        return key
    return environ.get(API_KEY_ENV) or None


def bearer_headers(key: str | None) -> dict[str, str]:
    """The ``Authorization`` header that carries ``key`` (none without a key)."""
    return {"authorization": f"Bearer {key}"} if key else {}


def require_api_key(app: FastAPI, key: str | None) -> None:
    """Answer 401 to every request of ``app`` without ``Authorization: Bearer <key>``."""
    if not key:
        return
    expected = key.encode()

    @app.middleware("http")
    async def _check_key(request: Request, call_next):
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), expected):
            return JSONResponse(
                status_code=401,
                content={"detail": "missing or wrong API key (Authorization: Bearer <key>)"},
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await call_next(request)


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
