"""KL penalty towards a frozen reference policy (GRPO, Shao et al. 2024).

    term_t = beta * k3_t,   k3_t = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1

the k3 estimate of KL(pi_theta || pi_ref) on the sampled tokens (``megatron/rl/grpo/kl.py``).
The reference policy is the initial weights or ``--ref-load``; the trainer computes its logprobs
once per micro-batch (no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron.rl.grpo.terms.base import LossTerm, TermValue

if TYPE_CHECKING:
    from megatron.rl.grpo.loss_inputs import LossInputs


@dataclass(frozen=True)
class ReferenceKL(LossTerm):
    """beta x k3 KL(pi_theta || pi_ref); logs ``ref_kl`` (mean k3 per loss token)."""

    name = "ref_kl"
    flag = "--grpo-kl-beta"
    help = (
        "Weight beta of the k3 KL penalty towards a frozen reference policy (0: off, no "
        "reference model). The reference is the initial weights (rebuilt from --seed on resume) "
        "or --ref-load."
    )
    requires = frozenset({"ref_logprobs"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight < 0:
            raise ValueError(f"must be >= 0, got {self.weight}")

    def compute(self, inputs: LossInputs) -> TermValue:
        """beta x k3 per token, and k3 as the metric."""
        if inputs.ref_logprobs is None:
            raise ValueError("the reference KL term needs ref_logprobs")
        from megatron.rl.grpo.kl import reference_kl  # torch: loaded when a loss is computed

        kl = reference_kl(inputs.trainer_logprobs, inputs.ref_logprobs, inputs.loss_mask)  # (B, T)
        return TermValue(per_token=self.weight * kl, metric=kl)
