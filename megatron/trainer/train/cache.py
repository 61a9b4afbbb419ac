"""What a collection computes once per micro-batch and its iterations reuse: the teacher's view of
a batch (``Policy.get_teacher_logprobs``) and each micro-batch's cache (``step.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TeacherLogprobs:
    """The distillation teacher's view of a batch's targets (``Policy.get_teacher_logprobs``)."""

    logprobs: torch.Tensor
    """(B, T) float32 log pi_teacher(target) at temperature 1."""
    argmax: torch.Tensor | None
    """(B, T) int64 the teacher's most likely next token at each position (None: unknown, a
    remote teacher's)."""
    topk_logprobs: torch.Tensor | None = None
    """(B, T, k) float32 the teacher's k largest log-probabilities at temperature 1, descending
    (the top-k variant; None: not asked)."""
    topk_ids: torch.Tensor | None = None
    """(B, T, k) int64 their token ids (``topk_ids[..., 0]`` is ``argmax``)."""


@dataclass
class MicroBatchCache:
    """Per-micro-batch tensors computed once per collection and reused by its iterations."""

    old_logprobs: torch.Tensor | None = None
    """(b, t) log pi_old, detached."""
    ref_logprobs: torch.Tensor | None = None
    """(b, t) log pi_ref."""
    mismatch: dict[str, torch.Tensor] | None = None
    """Train/inference mismatch sums (``importance.mismatch_sums``)."""
    teacher: TeacherLogprobs | None = None
    """The teacher's view of the micro-batch's rows (distillation): (b, t) and (b, t, k)."""
