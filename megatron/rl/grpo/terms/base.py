"""The interface of an additive GRPO loss term.

Per generated token t the GRPO loss is ``-w_t * surrogate_t + sum over terms of term_t``
(``megatron/rl/grpo/loss.py``). A term is a frozen dataclass whose only field is its ``weight``;
it declares which optional ``LossInputs`` it needs (``requires``), the flag that sets its weight
(0 turns it off, so the term is not built), and the name of the metric it reports: the mean of
``value`` over the loss tokens of the global batch.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # the terms' declarations load without torch: the trainer's --help lists them
    import torch

    from megatron.rl.grpo.loss_inputs import LossInputs


@dataclass(frozen=True)
class TermValue:
    """What a term contributes for one micro-batch."""

    per_token: torch.Tensor
    """(B, T) added to the per-token loss (before the loss mask), differentiable."""
    metric: torch.Tensor
    """(B, T) the value whose masked mean over loss tokens is logged as the term's ``name``."""


@dataclass(frozen=True)
class LossTerm(ABC):
    """One weighted per-token term of the loss."""

    weight: float
    """Multiplies the term; 0 means off (the trainer then does not build it)."""

    name: ClassVar[str]
    """Metric name (``ref_kl``, ``entropy``) and key of the term."""
    flag: ClassVar[str]
    """The command-line flag of ``weight`` (declared by the trainer from this class)."""
    help: ClassVar[str]
    """The flag's help text."""
    requires: ClassVar[frozenset[str]] = frozenset()
    """Optional ``LossInputs`` fields the term reads (``ref_logprobs``, ``entropy``)."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.weight):
            raise ValueError(f"must be finite, got {self.weight}")

    @abstractmethod
    def compute(self, inputs: LossInputs) -> TermValue:
        """The term's (B, T) contribution and metric for one micro-batch."""
