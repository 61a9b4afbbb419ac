"""What a policy-loss variant declares, and what it returns for one micro-batch.

A variant's module (``policy_loss/<name>.py``) defines, at module level:

* ``SUMS``: the names of the metric sums its ``surrogate`` reports, every one of them each time.
  A name without ``/`` is a per-token sum, logged divided by the global batch's loss tokens; one
  with ``/`` is a raw sum (``gspo/sequences``) that its ``metrics`` turns into logged values;
* ``surrogate(trainer_logprobs, old_logprobs, advantages, mask, eps_lower, eps_upper)``: the
  ``Surrogate`` of (B, T) logprobs (the trainer's, differentiable, and the ratio's denominator),
  (B, 1) advantages (or (B, T) per-token ones, where it declares ``TOKEN_ADVANTAGES``), the
  (B, T) loss mask and the clip range (``--grpo-clamp-eps-lower/upper``);
* ``metrics(sums)``: its logged metrics from the sums of ``SUMS`` added over micro-batches and
  ranks (an empty dict when it has no raw sums);
* optionally ``TOKEN_ADVANTAGES = True``: its objective is per token, so a per-token advantage
  (on-policy distillation's, ``megatron/rl/grpo/distill.py``) means what it says; a variant with a
  sequence-level ratio does not declare it and is refused with one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
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
    """The variant's own metric sums by name (its ``SUMS``), detached."""


@dataclass(frozen=True)
class PolicyLoss:
    """One variant: its module's declarations (module docstring)."""

    name: str
    """The module's name: the ``--policy-loss`` value."""
    sums: tuple[str, ...]
    """``SUMS``: the names of the metric sums ``surrogate`` reports."""
    surrogate: Callable[..., Surrogate]
    """The per-token objective of a micro-batch."""
    metrics: Callable[[dict[str, float]], dict[str, float]]
    """The logged metrics from the global sums."""
    token_advantages: bool = False
    """``TOKEN_ADVANTAGES``: whether ``surrogate`` takes (B, T) per-token advantages."""

    @classmethod
    def of(cls, module: ModuleType) -> PolicyLoss:
        """The variant a module declares; a TypeError names what it lacks."""
        name = module.__name__.rsplit(".", 1)[-1]
        sums = getattr(module, "SUMS", None)
        if not (isinstance(sums, tuple) and all(isinstance(s, str) for s in sums)):
            raise TypeError(f"policy loss {name!r}: SUMS must be a tuple of names, got {sums!r}")
        for function in ("surrogate", "metrics"):
            if not callable(getattr(module, function, None)):
                raise TypeError(f"policy loss {name!r} must define a function {function}()")
        token_advantages = getattr(module, "TOKEN_ADVANTAGES", False) is True
        return cls(name, sums, module.surrogate, module.metrics, token_advantages)
