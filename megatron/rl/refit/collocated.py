"""``CollocatedRefit``: after each optimizer step, every rank copies the trained weights into its
own inference copy of the model, laid out for the inference tensor-parallel size.

Each split parameter is all-gathered over the training TP group (the CPU tier's gloo, NCCL on
CUDA), assembled whole and cut to this rank's inference shard (``tensor_parallel.py``); at the
same layout every rank copies its own shard and nothing is sent. Every rank calls it at the same
point of the schedule (the trainer: right after the optimizer step, before the next generation
window), so the weights a token is sampled with depend on the step count alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.rl.refit.tensor_parallel import (
    global_indices,
    position_checksum,
    shard,
    shard_specs,
    whole,
)

UNCHANGED_STRIDE = 61
"""``RefitStats.unchanged_bf16`` reads every 61st element (a prime, so no tensor's rows or heads
line up with it): 2.2M of SmolLM2's 135M, a standard error near 1e-4, at 1/61 of the cost."""


@dataclass(frozen=True)
class RefitStats:
    """What one refit did on this rank."""

    seconds: float
    """Wall time of the copy, gathers included."""
    bytes_received: int
    """Bytes this rank received from the other ranks of its training TP group."""
    bytes_written: int
    """Bytes written into the inference copy."""
    unchanged_bf16: float
    """The share of the copy's elements whose bfloat16 value the refit left unchanged (what a
    delta refit of bfloat16 weights would not need to send), estimated on every
    ``UNCHANGED_STRIDE``-th element of each tensor."""


class CollocatedRefit:
    """The copy of ``source`` (this rank's training shard, of the TP group ``source_group``) into
    ``target`` (this rank's shard of the inference copy, of the TP group ``target_group``; None:
    one rank); collective over ``source_group``."""

    def __init__(
        self,
        source: torch.nn.Module,
        target: torch.nn.Module,
        source_group: dist.ProcessGroup | None,
        target_group: dist.ProcessGroup | None,
        gated_linear_unit: bool,
    ) -> None:
        self.source, self.target = source, target
        self.specs = shard_specs(source, gated_linear_unit)
        self.targets = dict(target.named_parameters())
        if set(self.targets) != set(self.specs):
            odd = sorted(set(self.targets) ^ set(self.specs))
            raise ValueError(f"the inference copy's parameters differ from the model's: {odd}")
        self.group, self.target_group = source_group, target_group
        self.rank, self.size = _place(source_group)
        self.target_rank, self.target_size = _place(target_group)
        self.same_layout = (self.target_rank, self.target_size) == (self.rank, self.size)

    @torch.no_grad()
    def __call__(self) -> RefitStats:
        """Copy every parameter; what it took."""
        start, received, written, unchanged, elements = time.perf_counter(), 0, 0, 0, 0
        for name, param in self.source.named_parameters():
            spec, dest, local = self.specs[name], self.targets[name], param.detach()
            if spec.dim is None or self.same_layout:
                value = local
            else:
                parts = [local]
                if self.size > 1:
                    parts = [torch.empty_like(local) for _ in range(self.size)]
                    dist.all_gather(parts, local.contiguous(), group=self.group)
                    received += local.numel() * local.element_size() * (self.size - 1)
                value = shard(whole(parts, spec), spec, self.target_rank, self.target_size)
            if value.shape != dest.shape:
                raise ValueError(
                    f"{name}: the inference copy's shard has shape {list(dest.shape)}, the "
                    f"trained weights give {list(value.shape)}"
                )
            new, old = value.reshape(-1)[::UNCHANGED_STRIDE], dest.reshape(-1)[::UNCHANGED_STRIDE]
            unchanged += int((new.to(torch.bfloat16) == old.to(torch.bfloat16)).sum())
            elements += new.numel()
            dest.copy_(value)
            written += dest.numel() * dest.element_size()
        seconds = time.perf_counter() - start
        return RefitStats(seconds, received, written, unchanged / max(1, elements))

    @torch.no_grad()
    def mismatches(self) -> list[str]:
        """The parameters whose inference copy differs from the trained weights (collective over
        the world: every rank gets the same list; ``--rl-verify-model-weights-swap``).

        Each side sums its shards' ``position_checksum`` over its own TP group (the training TP
        group, the inference copy's), so the two sums are of the same whole tensor when the
        refit is right, whatever the layouts; a value in the wrong place or a missing shard
        changes them."""
        found = []
        for name, param in self.source.named_parameters():
            spec, dest = self.specs[name], self.targets[name]
            theirs = self._checksum(param, spec, self.rank, self.size, self.group)
            ours = self._checksum(dest, spec, self.target_rank, self.target_size, self.target_group)
            found.append(int(theirs != ours))
        device = next(self.source.parameters()).device  # NCCL reduces device tensors only
        flags = torch.tensor(found, dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [n for n, bad in zip(self.specs, flags.tolist()) if bad]  # specs: in that order

    @staticmethod
    def _checksum(tensor, spec, rank, size, group) -> torch.Tensor:
        """The whole tensor's checksum from this rank's shard (summed over ``group``)."""
        index = global_indices(spec, tensor.shape, rank, size, tensor.device)  # whole: arange
        total = position_checksum(tensor, index)
        if spec.dim is not None and size > 1:
            dist.all_reduce(total, group=group)
        return total


def _place(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in ``group`` (None or no world: (0, 1))."""
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
