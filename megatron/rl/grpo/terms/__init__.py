"""Additive per-token terms of the GRPO loss, one module each.

A term is a ``LossTerm`` subclass in a module of this package; ``loss_terms()`` finds every one.
The trainer declares each term's flag from the class (``flag``, ``help``), builds it when its
weight is not 0, and reports its metric by ``name``: adding a term means adding its module and its
test, nothing else (see docs/architecture.md, "Where to make the common changes").
"""

from __future__ import annotations

import importlib
import pkgutil

from megatron.rl.grpo.terms.base import LossTerm


def loss_terms() -> tuple[type[LossTerm], ...]:
    """Every ``LossTerm`` subclass defined in this package, ordered by ``name``."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return tuple(sorted(LossTerm.__subclasses__(), key=lambda cls: cls.name))


__all__ = ["LossTerm", "loss_terms"]
