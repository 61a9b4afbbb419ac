"""The policy interface: what the training loop asks of the model it trains, on either tier.

The semantics are NeMo-RL's ``PolicyInterface`` on this trainer's SPMD ranks. Every rank calls a
method with the same global batch ``data`` (a ``TrainBatch``: one row per rollout, inputs
``tokens[:-1]`` and targets ``tokens[1:]``, so T = S - 1 for S tokens); each data-parallel rank
runs its consecutive shard of the rows in micro-batches, and the forward-only methods return the
whole batch's result on every rank (gathered over data parallelism, and from the last pipeline
stage on CUDA). With the keyed data plane a rank holds only its shard of a global batch
(``TrainBatch.is_shard``, carrying the global token counts the loss is averaged over): it is called
with that shard, runs all of its rows, and the forward-only methods return those rows. Per-token
outputs are aligned with the targets; positions past a row's length
hold padding values (0 past its micro-batch's width) that callers mask.

* ``get_logprobs``: log pi(target) of every position, forward only, no gradient.
* ``get_reference_policy_logprobs``: the same under the frozen reference model.
* ``get_teacher_logprobs``: log pi_teacher(target) at temperature 1 and the teacher's argmax (and
  its top-k log-probabilities) under the frozen distillation teacher (``--distill-teacher``).
* ``get_topk_logits``: the k largest logits of the next token at every position, with their ids.
* ``train``: one optimizer update per global batch with a pluggable ``LossFunction`` (defined
  in ``step.py``, whose ``step_result`` asks it for the metrics), or with ``eval_mode`` only the
  loss (no update, no LR step, no gradient kept).

Implementations: ``CPUPolicy`` (``tiers/cpu.py``: micro-batches in a loop) and ``CUDAPolicy``
(``tiers/cuda_policy.py``: megatron-core's ``forward_backward_func``); ``Tier.build_policy``
builds the one of the device. The training loop (``grpo.py``, ``collection.py``) reaches the
model only through this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.train.remote_teacher import RemoteTeacher
from megatron.trainer.train.step import (
    LossFunction,
    MicroBatch,
    MicroBatchCache,
    StepConfig,
    StepResult,
    TeacherLogprobs,
    data_parallel_rows,
)


@dataclass(frozen=True)
class PolicyConfig:
    """How the policy runs its forward passes and updates (independent of the loss)."""

    vocab_size: int
    """Real vocabulary size (padded embedding rows get probability 0 and are never top-k)."""
    micro_batch_size: int
    """Rows per micro-batch unless a call says otherwise (``--micro-batch-size``)."""
    clip_grad: float
    """Global gradient-norm clip (0: measure only)."""
    packing_capacity: int | None = None
    """Tokens per packed row (None: no sequence packing)."""
    check_finite: bool = True
    """Refuse an update whose loss or gradient norm is not finite (``nonfinite.LossCheck``)."""

    @classmethod
    def of(cls, step: StepConfig) -> PolicyConfig:
        """The policy settings of a GRPO step config."""
        return cls(
            step.vocab_size,
            step.micro_batch_size,
            step.clip_grad,
            step.packing_capacity,
            step.check_finite,
        )


def update_keys(loss_fn: LossFunction) -> tuple[str, ...]:
    """The keys of an update's sums: ``loss`` and the loss function's metrics, sorted."""
    keys = loss_fn.metric_keys()
    if "loss" in keys:
        raise ValueError("a loss function's metric_keys must not contain 'loss' (it is added)")
    return tuple(sorted(("loss", *keys)))


@dataclass(frozen=True)
class TopKLogits:
    """The k largest logits of the next token at every position of a batch."""

    values: torch.Tensor
    """(B, T, k) float32 logits (untempered), descending."""
    indices: torch.Tensor
    """(B, T, k) int64 token ids (< the real vocabulary size)."""


@dataclass(frozen=True)
class PlannedUpdate:
    """One global batch of a ``train`` call and this rank's micro-batches of it."""

    batch: TrainBatch
    micro_batches: list[MicroBatch]


def plan_updates(
    data: TrainBatch,
    ctx: ParallelContext,
    gbs: int | None,
    mbs: int,
    caches: list[MicroBatchCache] | None,
    fixed_width: bool = False,
) -> list[PlannedUpdate]:
    """``data`` cut into global batches of ``gbs`` rows (default: one), each into this rank's
    micro-batches of ``mbs`` rows; ``caches``: one per micro-batch of this rank, in order
    (fresh ones by default)."""
    if data.is_shard and gbs is not None:
        raise ValueError("a data-parallel shard is one global batch: train it without gbs")
    gbs = data.num_rows if gbs is None else gbs
    if gbs < 1 or data.num_rows % gbs:
        raise ValueError(f"gbs ({gbs}) must divide the {data.num_rows} rows of the data")
    if mbs < 1:
        raise ValueError(f"mbs must be >= 1, got {mbs}")
    per_update = data_parallel_rows(gbs, ctx, mbs, data.is_shard)
    count = len(per_update) * (data.num_rows // gbs)
    caches = [MicroBatchCache() for _ in range(count)] if caches is None else caches
    if len(caches) != count:
        raise ValueError(f"{len(caches)} caches given for {count} micro-batches on this rank")
    updates, it = [], iter(caches)
    for start in range(0, data.num_rows, gbs):
        batch = data if gbs == data.num_rows else data.rows(start, start + gbs, trim=False)
        micros = [
            MicroBatch(
                batch.rows(r.start, r.stop, trim=not fixed_width),
                slice(start + r.start, start + r.stop),
                next(it),
            )
            for r in per_update
        ]
        updates.append(PlannedUpdate(batch, micros))
    return updates


class Policy(ABC):
    """The trained model (this rank's shard), its optimizer and its reference, behind the
    methods of the training loop. Every method is collective over all ranks."""

    config: PolicyConfig
    teacher: torch.nn.Module | RemoteTeacher | None
    """The distillation teacher: a frozen model on this rank's layout, a server, or none."""

    @abstractmethod
    def get_logprobs(self, data: TrainBatch, micro_batch_size: int | None = None) -> torch.Tensor:
        """(B, T) float32 log pi(target) of ``data`` at its sampling temperatures: forward only,
        no gradient, in micro-batches of ``micro_batch_size`` (default: the config's) rows."""

    @abstractmethod
    def get_reference_policy_logprobs(
        self, data: TrainBatch, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """(B, T) float32 log pi_ref(target) under the frozen reference model, as
        ``get_logprobs``; an error when the policy has no reference."""

    def get_teacher_logprobs(
        self, data: TrainBatch, micro_batch_size: int | None = None, topk: int | None = None
    ) -> TeacherLogprobs:
        """The frozen distillation teacher's (B, T) log pi_teacher(target) at temperature 1 and
        (B, T) argmax over the real vocabulary (with ``topk``, also its (B, T, k) largest
        log-probabilities and their ids), as ``get_logprobs``: a forward of the teacher model
        (``_teacher_forward``) or a remote teacher's scoring (no argmax); an error when the
        policy has no teacher."""
        if self.teacher is None:
            raise ValueError("the policy has no distillation teacher (--distill-teacher)")
        if isinstance(self.teacher, RemoteTeacher):
            return self.teacher.get_teacher_logprobs(data, micro_batch_size, topk)
        return self._teacher_forward(data, micro_batch_size, topk)

    @abstractmethod
    def _teacher_forward(
        self, data: TrainBatch, micro_batch_size: int | None, topk: int | None
    ) -> TeacherLogprobs:
        """``get_teacher_logprobs`` from the teacher model on this rank's layout."""

    @abstractmethod
    def get_topk_logits(
        self, data: TrainBatch, k: int, micro_batch_size: int | None = None
    ) -> TopKLogits:
        """The k largest (untempered) logits of the next token at each of the T input positions
        and their token ids, over the real vocabulary (correct under TP: each rank's top-k of its
        vocab shard, then the top-k of the gathered candidates); forward only."""

    @abstractmethod
    def train(
        self,
        data: TrainBatch,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        *,
        gbs: int | None = None,
        mbs: int | None = None,
        caches: list[MicroBatchCache] | None = None,
    ) -> list[StepResult]:
        """One optimizer update (and LR step) per global batch of ``gbs`` rows of ``data``
        (default: all of it) in micro-batches of ``mbs`` rows, minimizing ``loss_fn``'s token
        mean; one result per update, its sums reduced over micro-batches and data parallelism.

        ``eval_mode``: the loss and metrics only (no gradient kept, no optimizer or LR step).
        ``caches``: one per micro-batch of this rank (``plan_updates``), kept by the caller
        across calls that train the same rows.
        """
