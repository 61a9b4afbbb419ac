"""``CollocatedRefit``: after each optimizer step, every rank copies the trained weights into its
own inference copy of the model, laid out for the inference tensor-parallel size.

Each split parameter is all-gathered over the training TP group (the CPU tier's gloo, NCCL on
CUDA), assembled whole and cut to this rank's inference shard (``tensor_parallel.py``); at the
same layout every rank copies its own shard and nothing is sent. Every rank calls it at the same
point of the schedule (the trainer: right after the optimizer step, before the next generation
window), so the weights a token is sampled with depend on the step count alone.

Routed experts: the copy holds every expert (``layout.py``). An expert's weights are gathered
over the experts' TP group, then over the expert-parallel group when the trained model has one
(``local_experts.{j}`` of EP rank r is expert ``r * local + j``), and cut to the copy's TP shard.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.rl.refit.tensor_parallel import (
    ShardSpec,
    global_indices,
    position_checksum,
    shard,
    shard_specs,
    whole,
)

UNCHANGED_STRIDE = 61
"""``RefitStats.unchanged_bf16`` reads every 61st element (a prime, so no tensor's rows or heads
line up with it): 2.2M of SmolLM2's 135M, a standard error near 1e-4, at 1/61 of the cost."""


EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..+)$")
"""The name of a routed expert's parameter (megatron-core's ``SequentialMLP``): prefix, local
index, suffix."""


@dataclass(frozen=True)
class ExpertPlace:
    """Where this rank's routed experts sit among a model's experts."""

    ep_group: dist.ProcessGroup | None
    """The expert-parallel group (None: every rank holds every expert)."""
    tp_group: dist.ProcessGroup | None
    """The group an expert's weights are split over (megatron-core's ``expt_tp``)."""
    local: int
    """Experts per rank (per MoE layer)."""

    def global_names(self, name: str) -> list[str]:
        """The names, in the copy (every expert), of local parameter ``name`` of every rank of
        ``ep_group``, in its rank order; ``[name]`` for a parameter not of a routed expert."""
        match = EXPERT.match(name)
        if match is None:
            return [name]
        prefix, j, suffix = match.group(1), int(match.group(2)), match.group(3)
        ranks = place(self.ep_group)[1]
        return [f"{prefix}{r * self.local + j}{suffix}" for r in range(ranks)]


def expert_place(model: torch.nn.Module) -> ExpertPlace:
    """The ``ExpertPlace`` of ``model``'s routed experts (a dense model: no groups, one each)."""
    for module in model.modules():
        if hasattr(module, "local_experts") and hasattr(module, "ep_group"):
            groups = module.ep_group, module.tp_group
            return ExpertPlace(*groups, len(module.local_experts))
    return ExpertPlace(None, None, 1)


@dataclass(frozen=True)
class RefitStats:
    """What one refit did on this rank."""

    seconds: float
    """Wall time of the copy, gathers included."""
    bytes_received: int
    """Bytes this rank received from other ranks: of its training TP group, and of its
    expert-parallel or pipeline group when those hold weights this rank's copy needs."""
    bytes_written: int
    """Bytes written into the inference copy."""
    unchanged_bf16: float
    """The share of the copy's elements whose bfloat16 value the refit left unchanged (what a
    delta refit of bfloat16 weights would not need to send), estimated on every
    ``UNCHANGED_STRIDE``-th element of each tensor."""


class CollocatedRefit:
    """The copy of ``source`` (this rank's training shard, of the TP group ``source_group``) into
    ``target`` (this rank's shard of the inference copy, of the TP group ``target_group``; None:
    one rank); collective over ``source_group`` (and, for routed experts, over their groups)."""

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
        self.experts = expert_place(source)
        self.names = {name: self.experts.global_names(name) for name in self.specs}
        """A trained parameter -> its names in the copy (an expert's: one per expert-parallel
        rank)."""
        self.targets = dict(target.named_parameters())
        expected = {name for names in self.names.values() for name in names}
        if set(self.targets) != expected:
            odd = sorted(set(self.targets) ^ expected)
            raise ValueError(f"the inference copy's parameters differ from the model's: {odd}")
        self.group, self.target_group = source_group, target_group
        self.target_rank, self.target_size = place(target_group)

    def _split_group(self, name: str) -> dist.ProcessGroup | None:
        """The group trained parameter ``name`` is split over (an expert's: ``expt_tp``)."""
        return self.experts.tp_group if EXPERT.match(name) else self.group

    @torch.no_grad()
    def __call__(self) -> RefitStats:
        """Copy every parameter; what it took."""
        start, received, tally = time.perf_counter(), 0, [0, 0, 0]  # unchanged, sampled, bytes
        for name, param in self.source.named_parameters():
            spec, local, dests = self.specs[name], param.detach(), self.names[name]
            group = self._split_group(name)
            same = spec.dim is None or place(group) == (self.target_rank, self.target_size)
            if same and len(dests) == 1:
                values = [local]  # this rank's shard is the copy's
            else:
                full, got = gather_whole(local, spec, group)
                received += got
                fulls = [full]
                if len(dests) > 1:  # every expert-parallel rank's expert
                    fulls = [torch.empty_like(full) for _ in dests]
                    dist.all_gather(fulls, full.contiguous(), group=self.experts.ep_group)
                    received += full.numel() * full.element_size() * (len(dests) - 1)
                values = [shard(f, spec, self.target_rank, self.target_size) for f in fulls]
            for dest_name, value in zip(dests, values, strict=True):
                counts = write_shard(self.targets[dest_name], value, dest_name)
                tally = [t + c for t, c in zip(tally, counts)]
        seconds = time.perf_counter() - start
        return RefitStats(seconds, received, tally[2], tally[0] / max(1, tally[1]))

    @torch.no_grad()
    def mismatches(self) -> list[str]:
        """The parameters whose inference copy differs from the trained weights, by their names
        in the copy (collective over the world: every rank gets the same list;
        ``--rl-verify-model-weights-swap``).

        Each side sums its shards' ``position_checksum`` over its own TP group (the training TP
        group, the inference copy's), so the two sums are of the same whole tensor when the
        refit is right, whatever the layouts; a value in the wrong place or a missing shard
        changes them. An expert's sum is gathered over the expert-parallel group."""
        found, names = [], []
        for name, param in self.source.named_parameters():
            spec, dests, group = self.specs[name], self.names[name], self._split_group(name)
            theirs = whole_checksum(param, spec, *place(group), group).reshape(1)
            sums = [theirs]
            if len(dests) > 1:
                sums = [torch.empty_like(theirs) for _ in dests]
                dist.all_gather(sums, theirs, group=self.experts.ep_group)
            for dest_name, their in zip(dests, sums, strict=True):
                dest, target = self.targets[dest_name], (self.target_rank, self.target_size)
                ours = whole_checksum(dest, spec, *target, self.target_group)
                found.append(int(their.item() != ours.item()))
                names.append(dest_name)
        return agreed_mismatches(names, found, next(self.source.parameters()).device)


def whole_checksum(
    tensor: torch.Tensor, spec: ShardSpec, rank: int, size: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The whole tensor's ``position_checksum`` from this rank's shard ``tensor`` (rank ``rank``
    of ``size``), summed over ``group`` (collective over it when the tensor is split)."""
    index = global_indices(spec, tensor.shape, rank, size, tensor.device)  # whole: arange
    total = position_checksum(tensor, index)
    if spec.dim is not None and size > 1:
        dist.all_reduce(total, group=group)
    return total


def gather_whole(
    local: torch.Tensor, spec: ShardSpec, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, int]:
    """The TP=1 tensor of this rank's shard ``local`` and the other shards over ``group``
    (collective over it when the tensor is split), and the bytes received."""
    size = place(group)[1]
    if spec.dim is None or size == 1:
        return local, 0
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return whole(parts, spec), local.numel() * local.element_size() * (size - 1)


def write_shard(dest: torch.Tensor, value: torch.Tensor, name: str) -> tuple[int, int, int]:
    """Copy ``value`` into the copy's tensor ``dest`` (named ``name``); (sampled elements whose
    bfloat16 value it left unchanged, sampled elements, bytes written)."""
    if value.shape != dest.shape:
        raise ValueError(
            f"{name}: the inference copy's shard has shape {list(dest.shape)}, the trained "
            f"weights give {list(value.shape)}"
        )
    new, old = value.reshape(-1)[::UNCHANGED_STRIDE], dest.reshape(-1)[::UNCHANGED_STRIDE]
    unchanged = int((new.to(torch.bfloat16) == old.to(torch.bfloat16)).sum())
    dest.copy_(value)
    return unchanged, new.numel(), dest.numel() * dest.element_size()


def agreed_mismatches(names: list[str], found: list[int], device: torch.device) -> list[str]:
    """The ``names`` that any rank of the world ``found`` (1) to differ (collective: every rank
    gets the same list; on ``device``: NCCL reduces device tensors only)."""
    flags = torch.tensor(found, dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [n for n, bad in zip(names, flags.tolist()) if bad]


def place(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in ``group`` (None or no world: (0, 1))."""
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
