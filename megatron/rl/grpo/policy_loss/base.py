"""What a policy-loss variant returns for one micro-batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Surrogate:
    """The per-token objective of a variant (maximized: the loss is ``-w_t * objective``)."""

    per_token: torch.Tensor
    """(B, T) differentiable objective (before the loss mask, the IS weight and the terms)."""
    clipped_tokens: torch.Tensor
    """Scalar: loss tokens whose ratio or weight the variant clipped (``clip_fraction``)."""
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """The variant's own metric sums by name, detached: a name without ``/`` is a per-token sum
    (logged divided by the loss tokens), one with ``/`` a raw sum the variant's ``metrics``
    turns into its logged values."""
