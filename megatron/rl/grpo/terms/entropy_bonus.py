"""Entropy bonus: ``term_t = -weight * H_t`` with H_t the entropy (nats) of the tempered policy
at token t (``megatron/rl/grpo/entropy.py``, vocab-parallel under TP); a positive weight rewards
exploration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron.rl.grpo.terms.base import LossTerm, TermValue

if TYPE_CHECKING:
    from megatron.rl.grpo.loss_inputs import LossInputs


@dataclass(frozen=True)
class EntropyBonus(LossTerm):
    """-weight x H_t; logs ``entropy`` (mean entropy per loss token)."""

    name = "entropy"
    flag = "--grpo-entropy-term-weight"
    help = "Weight of the entropy bonus: loss -= weight x mean token entropy (0: off)."
    requires = frozenset({"entropy"})

    def compute(self, inputs: LossInputs) -> TermValue:
        """-weight x masked entropy per token, and the masked entropy as the metric."""
        if inputs.entropy is None:
            raise ValueError("the entropy bonus needs entropy")
        entropy = inputs.entropy * inputs.loss_mask  # (B, T)
        return TermValue(per_token=-(self.weight * entropy), metric=entropy)
