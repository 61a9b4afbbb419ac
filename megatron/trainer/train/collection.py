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
(``Policy.get_reference_policy_logprobs``), and so are a distillation teacher's logprobs
(``Policy.get_teacher_logprobs``). The per-micro-batch caches live as long as the
collection; each iteration trains through ``Policy.train`` with the collection's ``GRPOLoss``.

The forced lag counts collections: the generator submits collection s+L+1 when the trainer asks
for collection s+1, so rollouts of collection s were submitted when collection max(0, s-L) was
handed over, i.e. at policy version k x max(0, s - L).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from megatron.rl.dataplane.base import DataPlane
from megatron.rl.dataplane.batches import LOGPROBS, REFERENCE_LOGPROBS, shard_batch
from megatron.rl.dataplane.store import BatchMeta
from megatron.rl.grpo.batch import GlobalCounts, TrainBatch
from megatron.rl.grpo.filtering import DynamicSamplingConfig, select_groups
from megatron.rl.wire import RolloutGroup
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.train.losses import GRPOLoss
from megatron.trainer.train.policy import Policy
from megatron.trainer.train.step import MicroBatchCache, StepConfig, TeacherLogprobs


def global_rows(j: int, num_rows: int, global_batch_size: int) -> list[int]:
    """The collection rows (indices) iteration j trains: ``(j x GBS + r) mod (P x G)``."""
    start = j * global_batch_size % num_rows
    return [(start + r) % num_rows for r in range(global_batch_size)]


class CollectionSlices:
    """The k iterations' global batches of a collection of ``num_rows`` rows, their caches and
    their pi_old / pi_ref computed up front. Subclasses say what ``global_batch`` holds."""

    def __init__(self, num_rows: int, global_batch_size: int, iterations: int) -> None:
        self.num_rows = num_rows
        self.global_batch_size = global_batch_size
        self.iterations = iterations
        self.num_slices = num_rows // math.gcd(num_rows, global_batch_size)
        """Distinct global batches: the cycle of ``j x GBS mod (P x G)``."""
        self._caches: dict[int, list[MicroBatchCache]] = {}
        self._old: dict[int, torch.Tensor] = {}
        """(b, T) pi_old of each distinct global batch's rows on this rank, computed up front."""
        self._ref: dict[int, torch.Tensor] = {}
        """(b, T) pi_ref of each distinct global batch's rows on this rank."""
        self._teacher: dict[int, TeacherLogprobs] = {}
        """The distillation teacher's logprobs and argmax of each distinct global batch."""

    def global_batch(self, j: int) -> TrainBatch:
        """What this rank trains at iteration j (0 <= j < k) of this collection."""
        raise NotImplementedError

    def local_rows(self, j: int) -> torch.Tensor:
        """(b,) the collection rows of ``global_batch(j)``'s rows, in order."""
        raise NotImplementedError

    def add_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        """Per-row ``sums`` of this rank's rows added into the whole collection's (collective
        when ranks hold shards)."""
        return sums

    def mask_rows(self, keep: torch.Tensor) -> None:
        """Take the collection rows where the (N,) bool ``keep`` is False out of the loss."""
        raise NotImplementedError

    def caches(self, j: int, num_micro_batches: int) -> list[MicroBatchCache]:
        """The micro-batch caches of iteration j's global batch (shared by every pass over it)."""
        return self._caches.setdefault(
            j % self.num_slices, [MicroBatchCache() for _ in range(num_micro_batches)]
        )

    def old_logprobs(self, j: int) -> torch.Tensor | None:
        """(b, T) pi_old of ``global_batch(j)`` if ``prepare`` computed it up front."""
        return self._old.get(j % self.num_slices)

    def loss(self, j: int, config: StepConfig) -> GRPOLoss:
        """The GRPO loss of iteration j's global batch (with its pi_old, pi_ref and teacher)."""
        s = j % self.num_slices
        return GRPOLoss(config, self._old.get(s), self._ref.get(s), self._teacher.get(s))

    def prepare(self, policy: Policy, config: StepConfig) -> None:
        """Before the first update: pi_old of every global batch when it is needed and a later
        global batch could not take it from its own first forward, pi_ref of every global
        batch when a loss term needs it, and the teacher's logprobs when distilling."""
        for j in range(self.num_slices):
            if config.needs_pre_update_logprobs and self.num_slices > 1:
                self._old[j] = policy.get_logprobs(self.global_batch(j))
            if config.needs_reference:
                self._ref[j] = policy.get_reference_policy_logprobs(self.global_batch(j))
            if config.distill is not None:
                topk = config.distill.topk
                self._teacher[j] = policy.get_teacher_logprobs(self.global_batch(j), topk=topk)


class Collection(CollectionSlices):
    """One collection's whole batch, cut into the global batches of its k iterations (every rank
    holds every row)."""

    def __init__(self, batch: TrainBatch, global_batch_size: int, iterations: int) -> None:
        super().__init__(batch.num_rows, global_batch_size, iterations)
        self.batch = batch

    def global_batch(self, j: int) -> TrainBatch:
        """The rows of iteration j (0 <= j < k) of this collection."""
        rows, size = self.batch.num_rows, self.global_batch_size
        if size == rows:
            return self.batch
        start = j * size % rows
        if start + size <= rows:
            return self.batch.rows(start, start + size, trim=False)
        return self.batch.select(torch.tensor(global_rows(j, rows, size)))

    def local_rows(self, j: int) -> torch.Tensor:
        """(GBS,) the collection rows of iteration j's global batch."""
        return torch.tensor(global_rows(j, self.num_rows, self.global_batch_size))

    def mask_rows(self, keep: torch.Tensor) -> None:
        """Zero the loss mask of the rows not kept."""
        masked = self.batch.loss_mask * keep[:, None].to(self.batch.loss_mask.dtype)
        self.batch = dataclasses.replace(self.batch, loss_mask=masked)


class KeyedCollection(CollectionSlices):
    """One collection held in the data plane: each rank reads only its shard of each global
    batch, by key, and writes back the logprobs it computes for them.

    ``global_batch``, ``write_back`` and ``finish`` are collective (every rank, same order).
    """

    def __init__(
        self,
        plane: DataPlane,
        meta: BatchMeta,
        global_batch_size: int,
        iterations: int,
        ctx: ParallelContext,
        pad_id: int,
    ) -> None:
        super().__init__(len(meta.keys), global_batch_size, iterations)
        self.plane, self.meta, self.ctx, self.pad_id = plane, meta, ctx, pad_id
        self._shards: dict[int, TrainBatch] = {}
        self._written: set[int] = set()
        """Rows whose logprobs are written back (every rank alike)."""
        self._keep: torch.Tensor | None = None
        """(N,) bool rows kept in the loss (``mask_rows``); None: all."""
        if "masked" in meta.tags:  # rows the owner kept out of the loss (truncated completions)
            published = meta.tag("masked") == 0
            if not bool(published.all()):
                self.mask_rows(published)

    def _mine(self, rows: list[int]) -> list[int]:
        """This data-parallel rank's contiguous share of a global batch's ``rows``."""
        per_rank = len(rows) // self.ctx.dp_size
        return rows[self.ctx.dp_rank * per_rank : (self.ctx.dp_rank + 1) * per_rank]

    def global_batch(self, j: int) -> TrainBatch:
        """This rank's shard of iteration j's global batch (fetched once per collection)."""
        s = j % self.num_slices
        if s not in self._shards:
            rows = global_rows(s, self.num_rows, self.global_batch_size)
            shard = shard_batch(self.plane, self.meta, rows, self._mine(rows), self.pad_id)
            self._shards[s] = self._masked(s, shard)
        return self._shards[s]

    def local_rows(self, j: int) -> torch.Tensor:
        """(GBS / DP,) the collection rows of this rank's shard of iteration j's global batch."""
        return torch.tensor(self._mine(global_rows(j, self.num_rows, self.global_batch_size)))

    def add_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        """Each data-parallel replica's row sums added (tensor-parallel ranks of a replica hold
        the same rows and values)."""
        if self.ctx.dp_size == 1:
            return sums
        total = sums.to(self.ctx.device)
        dist.all_reduce(total, group=self.ctx.dp_group)
        return total.cpu()

    def mask_rows(self, keep: torch.Tensor) -> None:
        """Zero the loss mask of the rows not kept in the shards fetched so far and later, and
        count the global batches' loss tokens without them (rows masked before stay masked)."""
        self._keep = keep if self._keep is None else self._keep & keep
        for s, shard in self._shards.items():
            self._shards[s] = self._masked(s, shard)

    def _masked(self, s: int, shard: TrainBatch) -> TrainBatch:
        """``shard`` (of global batch s) with the rows ``mask_rows`` dropped out of its loss."""
        if self._keep is None:
            return shard
        rows = torch.tensor(global_rows(s, self.num_rows, self.global_batch_size))
        mine = self.local_rows(s)
        mask = shard.loss_mask * self._keep[mine][:, None].to(shard.loss_mask.dtype)
        kept = self.meta.tag("loss_tokens")[rows] * self._keep[rows]
        counts = shard.global_counts or GlobalCounts(len(rows), 0, 0)
        counts = dataclasses.replace(
            counts, loss_tokens=int(kept.sum()), loss_sequences=int((kept > 0).sum())
        )
        return dataclasses.replace(shard, loss_mask=mask, global_counts=counts)

    def rewarded(self) -> torch.Tensor:
        """(N,) float64, 1 for each collection row whose reward is > 0 (the partition's tag)."""
        return self.meta.tag("rewarded").to(torch.float64)

    def write_back(self, j: int, config: StepConfig, micro_batch_size: int) -> None:
        """After iteration j: write the pi_old and pi_ref logprobs of the rows it trained first
        (TP rank 0 of each replica writes its rows; a stage without them writes none)."""
        needed = {LOGPROBS: config.needs_old_logprobs, REFERENCE_LOGPROBS: config.needs_reference}
        names = [name for name, needs in needed.items() if needs]
        if not names or j >= self.num_slices:
            return
        rows = global_rows(j, self.num_rows, self.global_batch_size)
        first = {}  # row -> its first position in the global batch (a row may repeat)
        for position, row in enumerate(rows):
            first.setdefault(row, position)
        per_rank, caches = len(rows) // self.ctx.dp_size, self._caches.get(j, [])
        keys: list[str] = []
        values: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        for i in range(per_rank) if self.ctx.is_replica_leader else []:
            position = self.ctx.dp_rank * per_rank + i
            row, micro = rows[position], i // micro_batch_size
            if row in self._written or first[row] != position or micro >= len(caches):
                continue
            cache = caches[micro]
            tensors = {LOGPROBS: cache.old_logprobs, REFERENCE_LOGPROBS: cache.ref_logprobs}
            if any(tensors[name] is None for name in names):
                continue  # a pipeline stage that does not compute them
            n = self.meta.tags["length"][row]
            keys.append(self.meta.keys[row])
            for name in names:
                values[name].append(tensors[name][i % micro_batch_size, :n].detach().float().cpu())
        self.plane.write(self.meta.partition, keys, values if keys else {})
        self._written.update(rows)

    def finish(self) -> None:
        """Drop the collection's partition once its last iteration is done."""
        self.plane.clear(self.meta.partition)
        self._shards.clear()


def training_groups(
    groups: list[RolloutGroup], sampling: DynamicSamplingConfig | None
) -> tuple[list[RolloutGroup], dict[str, Any]]:
    """The groups of a batch the step trains on (dynamic sampling picks them; None: all), and
    the dynamic-sampling metrics (rank 0)."""
    if sampling is None:
        return groups, {}
    chosen = select_groups(groups, sampling)
    kept = [r.reward for g in chosen.groups for r in g.rollouts if not r.is_placeholder]
    return chosen.groups, {
        "dynamic_sampling_rounds": chosen.rounds_used,
        "dynamic_sampling_dropped_groups": chosen.dropped,
        "dynamic_sampling_generated_rounds": len(groups) // sampling.groups_per_batch,
        "dynamic_sampling_generated_groups": len(groups),
        "dynamic_sampling_kept_groups": chosen.kept,
        "dynamic_sampling_surplus_groups": chosen.surplus,
        "dynamic_sampling_kept_reward_mean": sum(kept) / max(len(kept), 1),
    }
