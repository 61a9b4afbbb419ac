"""Advantage estimators, one module each (``--adv-estimator``).

An estimator is the module ``<name>.py`` of this package, its file name its name (the flag's
value): ``grpo.py`` the group mean as baseline, ``rloo.py`` the mean of the group's other
rollouts. Each module declares what ``base.Estimator`` holds: ``HELP`` (its part of the flag's
help) and ``centered`` (the rewards minus its baseline). ``compute.advantages`` is the one place
advantages are computed: the estimator's centered rewards, then the scale of
``--scale-rewards``. Estimator modules import no torch, so the flags read their names and help
without loading it: adding an estimator is adding its module and its test.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.rl.grpo.advantages.base import Estimator

DEFAULT_ESTIMATOR = "grpo"
"""GRPO's group mean (``grpo.py``)."""
_SUPPORT = frozenset({"base", "compute"})
"""Modules of this package that are not estimators."""


@functools.cache
def estimators() -> tuple[str, ...]:
    """The names of the estimators, the default first, then sorted: the modules of this package
    (found without importing them)."""
    names = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}
    return (DEFAULT_ESTIMATOR, *sorted(names - _SUPPORT - {DEFAULT_ESTIMATOR}))


@functools.cache
def load_estimator(name: str) -> Estimator:
    """The estimator ``name`` (one of ``estimators()``), its module imported on first use."""
    from megatron.rl.grpo.advantages.base import Estimator

    if name not in estimators():
        raise ValueError(f"estimator must be one of {estimators()}, got {name!r}")
    return Estimator.of(importlib.import_module(f"{__name__}.{name}"))


def estimators_help() -> str:
    """Each estimator's name and ``HELP``, in ``estimators()``' order (``--adv-estimator``)."""
    return "; ".join(f"'{name}', {load_estimator(name).help}" for name in estimators())
