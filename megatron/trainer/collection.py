"""How one collection of rollouts becomes training iterations (Megatron-LM's meaning of the flags).

A collection is the batch the rollout generator hands over: ``--grpo-prompts-per-step`` groups of
``--grpo-group-size`` rollouts, P x G rows, with advantages computed over each whole group. It is
trained for ``--grpo-iterations`` passes; each pass is cut into global batches of
``--global-batch-size`` rows, and each global batch is one training iteration (an optimizer step:
the LR schedule and the policy version advance). So a collection lasts
``k = --grpo-iterations x P x G / --global-batch-size`` iterations, and iteration j of it trains
rows ``(j x GBS + r) mod (P x G)`` (the passes walk the rows in the same order; when P x G is not a
multiple of GBS a global batch wraps around, as in Megatron-LM).

Ratios with ``--grpo-iterations`` > 1 (and the IS correction) are against pi_old, the policy that
collected: with one global batch per pass it is the first forward of the collection's first
iteration; with several, a later global batch is first trained after an update, so pi_old of every
global batch is computed (``Policy.get_logprobs``, forward only) before the collection's first
update. The reference KL term's pi_ref of every global batch is computed then too
(``Policy.get_reference_policy_logprobs``). The per-micro-batch caches live as long as the
collection; each iteration trains through ``Policy.train`` with the collection's ``GRPOLoss``.

The forced lag counts collections: the generator submits collection s+L+1 when the trainer asks
for collection s+1, so rollouts of collection s were submitted when collection max(0, s-L) was
handed over, i.e. at policy version k x max(0, s - L).
"""

from __future__ import annotations

import math

import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.trainer.losses import GRPOLoss
from megatron.trainer.policy import Policy
from megatron.trainer.step import MicroBatchCache, StepConfig


class Collection:
    """One collection's batch, cut into the global batches of its k iterations."""

    def __init__(self, batch: TrainBatch, global_batch_size: int, iterations: int) -> None:
        self.batch = batch
        self.global_batch_size = global_batch_size
        self.iterations = iterations
        self.num_slices = batch.num_rows // math.gcd(batch.num_rows, global_batch_size)
        """Distinct global batches: the cycle of ``j x GBS mod (P x G)``."""
        self._caches: dict[int, list[MicroBatchCache]] = {}
        self._old: dict[int, torch.Tensor] = {}
        """(GBS, T) pi_old of each distinct global batch computed up front."""
        self._ref: dict[int, torch.Tensor] = {}
        """(GBS, T) pi_ref of each distinct global batch."""

    def global_batch(self, j: int) -> TrainBatch:
        """The rows of iteration j (0 <= j < k) of this collection."""
        rows, size = self.batch.num_rows, self.global_batch_size
        if size == rows:
            return self.batch
        start = j * size % rows
        if start + size <= rows:
            return self.batch.rows(start, start + size, trim=False)
        return self.batch.select((torch.arange(size) + start) % rows)

    def caches(self, j: int, num_micro_batches: int) -> list[MicroBatchCache]:
        """The micro-batch caches of iteration j's global batch (shared by every pass over it)."""
        return self._caches.setdefault(
            j % self.num_slices, [MicroBatchCache() for _ in range(num_micro_batches)]
        )

    def old_logprobs(self, j: int) -> torch.Tensor | None:
        """(GBS, T) pi_old of iteration j's global batch if ``prepare`` computed it up front."""
        return self._old.get(j % self.num_slices)

    def loss(self, j: int, config: StepConfig) -> GRPOLoss:
        """The GRPO loss of iteration j's global batch (with its pi_old and pi_ref)."""
        s = j % self.num_slices
        return GRPOLoss(config, self._old.get(s), self._ref.get(s))

    def prepare(self, policy: Policy, config: StepConfig) -> None:
        """Before the first update: pi_old of every global batch when it is needed and a later
        global batch could not take it from its own first forward, and pi_ref of every global
        batch when a loss term needs it."""
        for j in range(self.num_slices):
            if config.needs_old_logprobs and self.num_slices > 1:
                self._old[j] = policy.get_logprobs(self.global_batch(j))
            if config.needs_reference:
                self._ref[j] = policy.get_reference_policy_logprobs(self.global_batch(j))
