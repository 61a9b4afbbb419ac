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
