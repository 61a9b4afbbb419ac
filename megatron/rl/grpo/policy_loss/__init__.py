"""Variants of the GRPO policy loss's surrogate, one module each (``--policy-loss``).

``vanilla`` is the token-level clipped surrogate of ``megatron/rl/grpo/loss.py`` (GRPO with
DAPO's clip-higher, verl's ``vanilla``); ``gspo.py`` the sequence-level ratio of GSPO;
``cispo.py`` the clipped, stop-gradient IS weight of CISPO. Each variant returns a ``Surrogate``
(``base.py``): the per-token objective, its clipped count and its own metric sums. The loss
(``loss.py``) applies the IS weights, the off-policy sequence mask, the terms and the aggregation
to every variant alike.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from megatron.rl.grpo.policy_loss.base import Surrogate

POLICY_LOSSES = ("vanilla", "gspo", "cispo")
"""The variants (verl's ``policy_loss.loss_mode`` names)."""


def surrogate_function(name: str) -> Callable[..., Surrogate]:
    """``surrogate`` of the variant's module (``gspo``, ``cispo``); ``vanilla`` is ``loss.py``'s."""
    if name not in POLICY_LOSSES[1:]:
        raise ValueError(f"no surrogate module for policy loss {name!r}")
    return importlib.import_module(f"{__name__}.{name}").surrogate
