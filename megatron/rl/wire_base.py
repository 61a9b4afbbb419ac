"""The ground every wire module stands on: the size limits and ``WireModel``."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

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
