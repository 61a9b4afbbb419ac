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

Top-k variant (``DistillConfig.topk`` = k, ``--distill-topk-logits-k``): instead of the sampled
token's gap in the advantage, the loss gains, per trained token, the exact reverse KL between the
student's and the teacher's next-token distributions restricted to the teacher's k most likely
ids S_t (both renormalized on S_t), differentiable in the student:

    loss_t += c * KL_t,   KL_t = sum_{i in S_t} p_hat_i (log p_hat_i - log q_hat_i),
    log p_hat_i = log pi_theta(i) - log sum_{j in S_t} pi_theta(j)   (q_hat: the teacher's)

``pi_theta`` at the row's sampling temperature (the distribution the student samples from), the
teacher's at temperature 1, as above. It uses k of the teacher's logprobs per token instead of
one sampled token's, so its gradient has no sampling variance on S_t; what lies outside S_t is
not constrained (``distill/teacher_topk_mass`` says how much of the teacher's distribution S_t
holds). The term is summed like the surrogate (``--loss-agg-mode``), with the environment's
advantage (or none with ``only``) in the surrogate.
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
TOPK_SUMS = ("distill/student_topk_mass", "distill/teacher_topk_mass", "distill/topk_kl")
"""Per-token sums the top-k variant adds, sorted (``topk_sums``)."""


@dataclass(frozen=True)
class DistillConfig:
    """The teacher term of the per-token advantage (``--distill-coef``)."""

    coef: float
    """c: the weight of the teacher-minus-sampler log-probability of each token (> 0)."""
    reward: bool = True
    """Whether the environment's sequence advantage stays in the sum (False: ``only``)."""
    topk: int | None = None
    """k of the top-k variant: c times the reverse KL on the teacher's k most likely ids is
    added to each token's loss, and no teacher term to its advantage (None: sampled-token)."""
    argmax: bool = True
    """Whether the teacher's argmax is known (a remote teacher's is not): the
    ``distill/argmax_mismatch`` sum."""

    def __post_init__(self) -> None:
        if not self.coef > 0:
            raise ValueError(f"the teacher term's coefficient must be > 0, got {self.coef}")
        if self.topk is not None and self.topk < 1:
            raise ValueError(f"the top-k variant needs k >= 1, got {self.topk}")
        if self.topk is not None and not self.argmax:
            raise ValueError("the top-k variant needs the teacher's top-k (a local teacher)")

    def sum_keys(self) -> tuple[str, ...]:
        """The names of the per-token sums a distilling step reports."""
        keys = tuple(k for k in DISTILL_SUMS if self.argmax or k != "distill/argmax_mismatch")
        return keys + (TOPK_SUMS if self.topk is not None else ())


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
    teacher_argmax: torch.Tensor | None,
    targets: torch.Tensor,
    loss_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Scalar sums over the loss tokens of (B, T) inputs: the reverse-KL estimate
    log pi_old - log pi_teacher, each side's log-probability, and (when the argmax is known)
    the tokens whose teacher argmax is not the sampled token."""
    mask = loss_mask.float()
    sums = {
        "distill/reverse_kl": ((student_logprobs - teacher_logprobs) * mask).sum(),
        "distill/student_logprob": (student_logprobs * mask).sum(),
        "distill/teacher_logprob": (teacher_logprobs * mask).sum(),
    }
    if teacher_argmax is not None:
        mismatch = (teacher_argmax.to(targets.device) != targets).float()  # (B, T)
        sums["distill/argmax_mismatch"] = (mismatch * mask).sum()
    return sums


def topk_reverse_kl(
    student_support: torch.Tensor, teacher_support: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """(B, T) KL(p_hat || q_hat) on the loss tokens (0 elsewhere), the student's and the
    teacher's distributions renormalized on the support (module docstring).

    Args:
        student_support: (B, T, k) log pi_theta of the support ids, differentiable.
        teacher_support: (B, T, k) log pi_teacher of the same ids (no gradient).
        loss_mask: (B, T) 1.0 on trained tokens.
    """
    log_q = torch.log_softmax(teacher_support.detach(), dim=-1)  # (B, T, k)
    return _TopKReverseKL.apply(student_support, log_q) * loss_mask


class _TopKReverseKL(torch.autograd.Function):
    """(B, T) KL(softmax(s) || q_hat) of (B, T, k) logits s and log q_hat, with its gradient in
    closed form, dKL/ds_j = p_j (d_j - KL), d = log p_hat - log q_hat: exactly 0 where the two
    are equal (autograd's chain through log_softmax leaves p (1 - sum p), float rounding)."""

    @staticmethod
    def forward(ctx, student_support, log_q):
        log_p = torch.log_softmax(student_support, dim=-1)  # (B, T, k) renormalized
        p, gap = log_p.exp(), log_p - log_q  # (B, T, k)
        kl = (p * gap).sum(-1)  # (B, T)
        ctx.save_for_backward(p, gap, kl)
        return kl

    @staticmethod
    def backward(ctx, grad):
        p, gap, kl = ctx.saved_tensors
        return grad[..., None] * p * (gap - kl[..., None]), None


def topk_sums(
    kl: torch.Tensor,
    student_support: torch.Tensor,
    teacher_support: torch.Tensor,
    loss_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Scalar sums over the loss tokens: the top-k KL (``topk_reverse_kl``'s (B, T) ``kl``) and
    the probability each side puts on the teacher's top-k ids ((B, T, k) logprobs)."""
    mask = loss_mask.float()
    return {
        "distill/student_topk_mass": (student_support.detach().exp().sum(-1) * mask).sum(),
        "distill/teacher_topk_mass": (teacher_support.exp().sum(-1) * mask).sum(),
        "distill/topk_kl": (kl.detach() * mask).sum(),
    }
