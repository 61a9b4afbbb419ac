"""The typed inputs of the GRPO policy loss (``loss.py``) for one micro-batch.

Their own module, below both the loss and its terms: ``loss.py`` imports the terms
(``terms/base.py``), and each term's ``compute`` reads these inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossInputs:
    """Typed inputs of the policy loss for one micro-batch."""

    trainer_logprobs: torch.Tensor
    """(B, T) log pi_theta(token), differentiable."""
    inference_logprobs: torch.Tensor
    """(B, T) log pi_behaviour(token) recorded by the engine at sampling time."""
    advantages: torch.Tensor
    """(B,) one advantage per sequence."""
    loss_mask: torch.Tensor
    """(B, T) 1.0 on generated tokens, 0.0 on prompt, padding and placeholder rows."""
    old_logprobs: torch.Tensor | None = None
    """(B, T) log pi_old (trainer, pre-update): the ratio's denominator when given."""
    is_weights: torch.Tensor | None = None
    """(B, T) importance weights multiplying the surrogate (no gradient); None: 1."""
    ref_logprobs: torch.Tensor | None = None
    """(B, T) log pi_ref of the reference policy (no gradient), for terms that require it."""
    entropy: torch.Tensor | None = None
    """(B, T) differentiable policy entropy, for terms that require it."""
    token_advantages: torch.Tensor | None = None
    """(B, T) per-token advantages added to each token's sequence advantage (on-policy
    distillation's teacher term, ``distill.py``; no gradient); None: none."""

    def advantage_per_token(self) -> torch.Tensor:
        """(B, 1) the sequence advantages, or (B, T) with the per-token ones added."""
        sequence = self.advantages[:, None]  # (B, 1)
        return sequence if self.token_advantages is None else sequence + self.token_advantages

    def advantage_per_sequence(self) -> torch.Tensor:
        """(B,) the sequence advantages, with the per-token ones' mean over each row's loss
        tokens added (what a sequence-level decision such as OPSM's reads)."""
        if self.token_advantages is None:
            return self.advantages
        tokens = self.loss_mask.sum(dim=1).clamp(min=1)  # (B,)
        return self.advantages + (self.token_advantages * self.loss_mask).sum(dim=1) / tokens
