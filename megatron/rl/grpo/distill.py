"""On-policy distillation: a frozen teacher scores every sampled token, the student is trained
toward it with the sampled-token reverse KL as a per-token advantage.

Variant: on-policy distillation with a per-token reverse KL and discount 0 (the student samples;
the advantage of token t is the teacher's log-probability of it minus the student's). Per token:

    A_t = c_env * A_i + c * (log pi_teacher(y_t | y_<t) - log pi_old(y_t | y_<t))

* ``A_i`` is the sequence's environment advantage (GRPO's group-normalized reward, or any
  ``--adv-estimator``); ``c_env`` is 1, or 0 with ``--distill-coef only`` (no reward needed).
* ``log pi_old`` is the student being trained, before its collection's first update (the
  trainer's forward: pi_old of ``--grpo-iterations``), detached; ``log pi_teacher`` is the
  teacher's forward on the same tokens at temperature 1, computed once per collection where the
  reference logprobs are. Both are fixed for the collection, as an advantage is.
* The gradient of -KL(pi_theta || pi_teacher) is E_{y ~ pi_theta}[grad log pi_theta(y) (log
  pi_teacher(y) - log pi_theta(y))]: the policy gradient with this advantage. The tokens were
  sampled by the engine's policy, at forced lag L an older one; the loss's ratio against the
  sampler's logprobs (``loss.py``) is the importance weight that corrects for it, so clipping,
  the IS corrections and ``--loss-agg-mode`` apply unchanged. At L = 0 pi_old is the sampler
  (to the float rounding between the engine's and the trainer's forwards, ``mismatch_kl``).

A teacher equal to the student gives A_t = c_env * A_i exactly (with ``only``: zero, hence a zero
gradient). The metrics are per trained token (``DISTILL_SUMS``, divided by the loss tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DISTILL_SUMS = (
    "distill/argmax_mismatch",
    "distill/reverse_kl",
    "distill/student_logprob",
    "distill/teacher_logprob",
)
"""Per-token sums a distilling step reports, sorted (``distill_sums``)."""


@dataclass(frozen=True)
class DistillConfig:
    """The teacher term of the per-token advantage (``--distill-coef``)."""

    coef: float
    """c: the weight of the teacher-minus-sampler log-probability of each token (> 0)."""
    reward: bool = True
    """Whether the environment's sequence advantage stays in the sum (False: ``only``)."""

    def __post_init__(self) -> None:
        if not self.coef > 0:
            raise ValueError(f"the teacher term's coefficient must be > 0, got {self.coef}")


def teacher_advantages(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    config: DistillConfig,
) -> torch.Tensor:
    """(B, T) c * (log pi_teacher - log pi_old) on the loss tokens, 0 elsewhere (no gradient:
    both are fixed for the collection)."""
    gap = (teacher_logprobs - student_logprobs).detach()  # (B, T)
    return config.coef * gap * loss_mask


def sequence_advantages(advantages: torch.Tensor, config: DistillConfig) -> torch.Tensor:
    """(B,) the environment's part of the advantage: ``advantages``, or zeros with ``only``."""
    return advantages if config.reward else torch.zeros_like(advantages)


def distill_sums(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_argmax: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Scalar sums over the loss tokens of (B, T) inputs: the reverse-KL estimate
    log pi_old - log pi_teacher, each side's log-probability, and the tokens whose teacher
    argmax is not the sampled token."""
    mask = loss_mask.float()
    mismatch = (teacher_argmax.to(targets.device) != targets).float()  # (B, T)
    return {
        "distill/argmax_mismatch": (mismatch * mask).sum(),
        "distill/reverse_kl": ((student_logprobs - teacher_logprobs) * mask).sum(),
        "distill/student_logprob": (student_logprobs * mask).sum(),
        "distill/teacher_logprob": (teacher_logprobs * mask).sum(),
    }
