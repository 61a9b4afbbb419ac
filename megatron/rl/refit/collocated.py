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

from megatron.rl.refit.tensor_parallel import shard, shard_specs, whole


@dataclass(frozen=True)
class RefitStats:
    """What one refit did on this rank."""

    seconds: float
    """Wall time of the copy, gathers included."""
    bytes_received: int
    """Bytes this rank received from the other ranks of its training TP group."""
    bytes_written: int
    """Bytes written into the inference copy."""


class CollocatedRefit:
    """The copy of ``source`` (this rank's training shard) into ``target`` (this rank's inference
    copy: rank ``target_rank`` of ``target_size`` tensor-parallel ranks); collective over
    ``source_group``, the training TP group."""

    def __init__(
        self,
        source: torch.nn.Module,
        target: torch.nn.Module,
        source_group: dist.ProcessGroup | None,
        target_rank: int,
        target_size: int,
        gated_linear_unit: bool,
    ) -> None:
        self.source, self.target = source, target
        self.specs = shard_specs(source, gated_linear_unit)
        self.targets = dict(target.named_parameters())
        if set(self.targets) != set(self.specs):
            odd = sorted(set(self.targets) ^ set(self.specs))
            raise ValueError(f"the inference copy's parameters differ from the model's: {odd}")
        self.group = source_group
        distributed = source_group is not None and dist.is_initialized()
        self.size = dist.get_world_size(source_group) if distributed else 1
        self.rank = dist.get_rank(source_group) if distributed else 0
        self.target_rank, self.target_size = target_rank, target_size
        self.same_layout = (target_rank, target_size) == (self.rank, self.size)

    @torch.no_grad()
    def __call__(self) -> RefitStats:
        """Copy every parameter; what it took."""
        start, received, written = time.perf_counter(), 0, 0
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
            dest.copy_(value)
            written += dest.numel() * dest.element_size()
        return RefitStats(time.perf_counter() - start, received, written)
