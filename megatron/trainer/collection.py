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
global batch is computed (forward only) before the collection's first update. The per-micro-batch
caches live as long as the collection.

The forced lag counts collections: the generator submits collection s+L+1 when the trainer asks
for collection s+1, so rollouts of collection s were submitted when collection max(0, s-L) was
handed over, i.e. at policy version k x max(0, s - L).
"""

from __future__ import annotations

import math

import torch

from megatron.rl.dataplane.base import DataPlane
from megatron.rl.dataplane.batches import LOGPROBS, REFERENCE_LOGPROBS, shard_batch
from megatron.rl.dataplane.store import BatchMeta
from megatron.rl.grpo.batch import TrainBatch
from megatron.trainer.checkpointing import TrainState
from megatron.trainer.initialize import ParallelContext
from megatron.trainer.step import MicroBatchCache, StepConfig
from megatron.trainer.tiers.base import Tier


def global_rows(j: int, num_rows: int, global_batch_size: int) -> list[int]:
    """The collection rows (indices) iteration j trains: ``(j x GBS + r) mod (P x G)``."""
    start = j * global_batch_size % num_rows
    return [(start + r) % num_rows for r in range(global_batch_size)]


class _Slices:
    """The k iterations' global batches of a collection of ``num_rows`` rows, and their caches."""

    def __init__(self, num_rows: int, global_batch_size: int, iterations: int) -> None:
        self.num_rows = num_rows
        self.global_batch_size = global_batch_size
        self.iterations = iterations
        self.num_slices = num_rows // math.gcd(num_rows, global_batch_size)
        """Distinct global batches: the cycle of ``j x GBS mod (P x G)``."""
        self._caches: dict[int, list[MicroBatchCache]] = {}

    def global_batch(self, j: int) -> TrainBatch:
        """The rows of iteration j (0 <= j < k) of this collection."""
        raise NotImplementedError

    def caches(self, j: int, num_micro_batches: int) -> list[MicroBatchCache]:
        """The micro-batch caches of iteration j's global batch (shared by every pass over it)."""
        return self._caches.setdefault(
            j % self.num_slices, [MicroBatchCache() for _ in range(num_micro_batches)]
        )

    def prepare(
        self, tier: Tier, state: TrainState, config: StepConfig, num_micro_batches: int
    ) -> None:
        """Compute pi_old of every global batch before the first update, when it is needed and
        a later global batch could not take it from its own first forward."""
        if not config.needs_old_logprobs or self.num_slices == 1:
            return
        for j in range(self.num_slices):
            caches = self.caches(j, num_micro_batches)
            tier.fill_old_logprobs(state, self.global_batch(j), config, caches)


class Collection(_Slices):
    """One collection's whole batch, cut into the global batches of its k iterations."""

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


class KeyedCollection(_Slices):
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

    def _mine(self, rows: list[int]) -> list[int]:
        """This data-parallel rank's contiguous share of a global batch's ``rows``."""
        per_rank = len(rows) // self.ctx.dp_size
        return rows[self.ctx.dp_rank * per_rank : (self.ctx.dp_rank + 1) * per_rank]

    def global_batch(self, j: int) -> TrainBatch:
        """This rank's shard of iteration j's global batch (fetched once per collection)."""
        s = j % self.num_slices
        if s not in self._shards:
            rows = global_rows(s, self.num_rows, self.global_batch_size)
            self._shards[s] = shard_batch(
                self.plane, self.meta, rows, self._mine(rows), self.pad_id
            )
        return self._shards[s]

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
