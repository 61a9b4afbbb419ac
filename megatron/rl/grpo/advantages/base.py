"""What an advantage estimator declares.

An estimator's module (``advantages/<name>.py``) defines, at module level:

* ``HELP``: its part of ``--adv-estimator``'s help (what its baseline is, and whose it is);
* ``centered(rewards, weights, total, count)``: the (G, K) float64 rewards minus its baseline,
  0 on invalid rollouts, from (G, K) float64 ``rewards`` (0 on invalid rollouts), (G, K) float64
  ``weights`` (1 on valid rollouts, 0 on placeholders), and each group's (G, 1) float64 ``total``
  of valid rewards and ``count`` of valid rollouts.

The scale (``--scale-rewards``) and the zero advantages of a group with fewer than two valid
rollouts are ``compute.advantages``' own, the same for every estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Estimator:
    """One estimator: its module's declarations (module docstring)."""

    name: str
    """The module's name: the ``--adv-estimator`` value."""
    help: str
    """``HELP``: its part of the flag's help."""
    centered: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """The rewards minus the estimator's baseline."""

    @classmethod
    def of(cls, module: ModuleType) -> Estimator:
        """The estimator a module declares; a TypeError names what it lacks."""
        name = module.__name__.rsplit(".", 1)[-1]
        help_text = getattr(module, "HELP", None)
        if not (isinstance(help_text, str) and help_text):
            raise TypeError(f"estimator {name!r} must define HELP, a non-empty string")
        if not callable(getattr(module, "centered", None)):
            raise TypeError(f"estimator {name!r} must define a function centered()")
        return cls(name, help_text, module.centered)
