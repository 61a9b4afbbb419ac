"""The ground every wire module stands on: the size limits, ``WireModel``, routes, base URLs and
the servers' error body."""

from __future__ import annotations

from typing import Annotated

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_ID = 2**31 - 1
"""Largest batch id, group index, sample index or policy version on the wire."""
MAX_TOKENS = 1 << 20
"""Largest prompt (characters or tokens) and generation budget a request may ask for: every
size on the wire is bounded, so no single request can make a server allocate without limit."""
MAX_CHAT_MESSAGES = 1024
"""Most messages in one chat prompt; their contents together are bounded by ``MAX_TOKENS``
characters."""
Seed = Annotated[int, Field(ge=0, lt=2**63)]
TokenId = Annotated[int, Field(ge=0, le=MAX_ID)]


class WireModel(BaseModel):
    """Base for wire types: unknown fields and non-finite floats are rejected (a 4xx, not a
    silent ``null`` after a JSON round trip)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


MAX_ROUTE = 1 << 16
"""Longest route of one position (MoE layers x top-k expert ids)."""
ExpertId = Annotated[int, Field(ge=0, le=MAX_ID)]
Routes = list[Annotated[list[ExpertId], Field(min_length=1, max_length=MAX_ROUTE)]]
"""Routing replay: per fed position, the experts each MoE layer's router chose, a flat list of
``layers * topk`` ids, layer-major."""


def check_routes(routes: list[list[int]] | None, positions: int, field: str, what: str) -> None:
    """Raise ``ValueError`` naming ``field`` unless ``routes`` is None or has ``positions``
    entries (``what`` says which) of one length."""
    if routes is None:
        return
    if len(routes) != positions:
        raise ValueError(
            f"'{field}' must have one entry per {what} ({positions}), got {len(routes)}"
        )
    lengths = {len(route) for route in routes}
    if len(lengths) > 1:
        raise ValueError(
            f"'{field}' entries must all have one length (MoE layers x top-k), got lengths "
            f"{sorted(lengths)[:5]}"
        )


HTTP_URL_PATTERN = r"^https?://[A-Za-z0-9.\-\[\]:]+(:\d{1,5})?(/[^\s]*)?$"
"""The shape of a base URL, as published in the OpenAPI schemas; ``parse_base_url`` decides."""


def parse_base_url(value: str) -> httpx.URL:
    """``value`` parsed by httpx, the client that will call it: an http(s) URL with a host, a
    port in 1-65535 (or none), no user info, query or fragment. Raises ``ValueError`` saying
    what is wrong otherwise."""
    try:
        url = httpx.URL(value)
        host = url.host  # decodes an IDNA host, as a request's Host header does
    except (httpx.InvalidURL, ValueError) as exc:  # an IDNA error is a ValueError
        raise ValueError(f"not a URL httpx can call ({exc})") from None
    if url.scheme not in ("http", "https"):
        raise ValueError(f"scheme {url.scheme!r}: only http and https")
    if not host:
        raise ValueError("no host")
    if url.userinfo:
        raise ValueError("user info (user@host) is not allowed: the job's key goes to the host")
    if url.port is not None and not 1 <= url.port <= 65535:
        raise ValueError(f"port {url.port} is outside 1-65535")
    if url.query or url.fragment:
        raise ValueError("a base URL has no query or fragment")
    return url


def _check_base_url(value: str) -> str:
    parse_base_url(value)
    return value


BaseUrl = Annotated[
    str, Field(pattern=HTTP_URL_PATTERN, max_length=2048), AfterValidator(_check_base_url)
]
"""A base URL on the wire or in a config: the schema's pattern, then ``parse_base_url``."""


class ErrorResponse(WireModel):
    """Body of every 4xx/5xx answer of the servers: one readable sentence."""

    detail: str
