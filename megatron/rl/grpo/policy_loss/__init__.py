"""Variants of the GRPO policy loss's surrogate, one module each (``--policy-loss``).

A variant is the module ``<name>.py`` of this package, its file name its name (the flag's
value): ``vanilla.py`` the token-level clipped surrogate (GRPO with DAPO's clip-higher, verl's
``vanilla``), ``gspo.py`` the sequence-level ratio of GSPO, ``cispo.py`` the clipped,
stop-gradient IS weight of CISPO, and so on. Each module defines what ``base.PolicyLoss`` holds:
``SUMS`` (the metric sums it reports), ``surrogate`` (the per-token objective of a micro-batch,
a ``Surrogate``) and ``metrics`` (its logged metrics from the global sums).

``policy_losses()`` lists the modules without importing them (the trainer's flags offer exactly
these names, and ``--help`` loads no torch); ``load_policy_loss(name)`` imports one when it is used.
The loss (``loss.py``) applies the IS weights, the off-policy sequence mask, the terms and the
aggregation to every variant alike: adding a variant is adding its module and its test.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.rl.grpo.policy_loss.base import PolicyLoss

DEFAULT_POLICY_LOSS = "vanilla"
"""The clipped token-level surrogate (``vanilla.py``)."""
_SUPPORT = frozenset({"base"})
"""Modules of this package that are not variants."""


@functools.cache
def policy_losses() -> tuple[str, ...]:
    """The names of the variants, the default first, then sorted: the modules of this package
    (found without importing them)."""
    names = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}
    variants = sorted(names - _SUPPORT - {DEFAULT_POLICY_LOSS})
    return (DEFAULT_POLICY_LOSS, *variants)


@functools.cache
def load_policy_loss(name: str) -> PolicyLoss:
    """The variant ``name`` (one of ``policy_losses()``), its module imported on first use."""
    from megatron.rl.grpo.policy_loss.base import PolicyLoss

    if name not in policy_losses():
        raise ValueError(f"policy_loss must be one of {policy_losses()}, got {name!r}")
    return PolicyLoss.of(importlib.import_module(f"{__name__}.{name}"))
