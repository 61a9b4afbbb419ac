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
