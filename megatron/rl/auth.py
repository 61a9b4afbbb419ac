"""The shared key of a job's servers: a bearer token that the env server and the trainer's
inference server require, and that their clients send.

One key per job (the Slurm launcher generates it) reaches every party through the environment
variable ``API_KEY_ENV`` or a key file (``--rl-api-key-file`` of the trainer, ``--api-key-file``
of the env server). It is compared in constant time and never logged or put on a command line.
Without a key the servers accept every request, as on a laptop's loopback interface.

The env server sends the key to the inference server a request names; ``Origin`` and
``allowed_origins`` restrict those to the origins of its ``--allowed-inference-url`` entries,
compared exactly (scheme, host, port) as httpx will connect to them; with a key and no entry,
loopback origins only (``may_receive_key``).

One rule for listening (``listen_problem``): every server refuses to listen on an interface
other machines reach unless requests need the key.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megatron.rl.wire import parse_base_url

API_KEY_ENV = "MEGATRON_RL_API_KEY"
"""The environment variable holding the shared key."""
DEFAULT_PORTS = {"http": 80, "https": 443}


class Origin(NamedTuple):
    """Where a request to a URL connects: scheme, host (lowercase, IDNA-encoded; an IPv6 address
    without brackets) and port (the scheme's default when the URL has none)."""

    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Origin:
        """The origin of base URL ``url``; ``ValueError`` (``wire.parse_base_url``) for one that
        httpx cannot call or that carries user info."""
        parsed = parse_base_url(url)
        host = parsed.raw_host.decode("ascii").lower()
        return cls(parsed.scheme, host, parsed.port or DEFAULT_PORTS[parsed.scheme])

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def allowed_origins(
    urls: Iterable[str], flag: str = "--allowed-inference-url"
) -> frozenset[Origin]:
    """The origins of allow-list entries. An entry is an origin, ``scheme://host[:port]`` (a
    trailing ``/`` is accepted); ``ValueError`` naming ``flag`` for an entry with a path, user
    info or anything httpx cannot call. A path is refused rather than compared: the key goes to
    the host, whatever path a request names."""
    origins = set()
    for url in urls:
        try:
            if parse_base_url(url).raw_path not in (b"", b"/"):
                raise ValueError("an allowed inference server is an origin, scheme://host[:port]")
            origins.add(Origin.of(url))
        except ValueError as exc:
            raise ValueError(f"{flag} {url!r}: {exc}") from None
    return frozenset(origins)


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


def api_key_source(path: str | None, environ: Mapping[str, str], flag: str) -> str:
    """Where ``read_api_key(path, environ, flag)`` takes the key from, for a log line (never the
    key): ``"<flag> <path>"``, ``"the environment variable <API_KEY_ENV>"`` or ``"none"``."""
    if path is not None:
        return f"{flag} {path}"
    return f"the environment variable {API_KEY_ENV}" if environ.get(API_KEY_ENV) else "none"


def bearer_headers(key: str | None) -> dict[str, str]:
    """The ``Authorization`` header that carries ``key`` (none without a key)."""
    return {"authorization": f"Bearer {key}"} if key else {}


def require_api_key(app: FastAPI, key: str | None, exempt_prefix: str | None = None) -> None:
    """Answer 401 to every request of ``app`` without ``Authorization: Bearer <key>``, except
    under ``exempt_prefix`` (routes that check a credential of their own)."""
    if not key:
        return
    expected = key.encode()

    @app.middleware("http")
    async def _check_key(request: Request, call_next):
        if exempt_prefix is not None and request.url.path.startswith(exempt_prefix):
            return await call_next(request)
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


def listen_problem(host: str, has_key: bool, host_flag: str, key_flag: str) -> str | None:
    """The one-line refusal of a server about to listen on ``host`` (``host_flag``) without a
    key (``key_flag`` or ``API_KEY_ENV``) where other machines reach it; None when allowed."""
    if has_key or is_loopback(host):
        return None
    return (
        f"{host_flag} {host} is reachable from other machines: set {API_KEY_ENV} or {key_flag} "
        "so that every request needs the job's key (or listen on 127.0.0.1)"
    )


def may_receive_key(origin: Origin, allowed: frozenset[Origin], has_key: bool) -> bool:
    """Whether a server may call ``origin`` (and send it the job's key): one of ``allowed``;
    with no allow-list, any origin when there is no key to leak, loopback ones when there is."""
    if allowed:
        return origin in allowed
    return not has_key or origin.host == "localhost" or _loopback_address(origin.host)


def _loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
