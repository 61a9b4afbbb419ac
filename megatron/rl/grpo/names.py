"""The names of the GRPO library's modes, torch-free: the trainer's flags offer exactly these.

``aggregation.py``, ``importance.py`` and ``advantages/compute.py`` (which import torch) check
their configs against these tuples, and ``megatron/trainer/flags`` takes its choices and defaults
from them, so ``--help`` lists the library's own names without loading torch. The policy-loss
variants and the advantage estimators are named by their modules instead
(``policy_loss.policy_losses``, ``advantages.estimators``).
"""

from __future__ import annotations

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""verl's names of the loss aggregations (``aggregation.py``, ``--loss-agg-mode``)."""
DEFAULT_AGG_MODE = AGG_MODES[0]
"""``token-mean``: every loss token of the global batch weighs the same (DAPO)."""

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""TRL's names of the rollout importance-sampling modes (``importance.py``,
``--rl-importance-sampling-mode``)."""
DEFAULT_IS_MODE = IS_MODES[0]
"""``token_truncate``: token-level truncated importance sampling (TIS)."""

SCALES = ("group", "batch", "none")
"""What the centered rewards are divided by (``advantages/compute.py``, ``--scale-rewards``): the
group's reward std, the batch's, nothing."""
