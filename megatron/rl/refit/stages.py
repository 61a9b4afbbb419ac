"""``StageRefit``: the collocated refit of a model trained with pipeline parallelism into inference
copies that are one whole stage (``--rl-inference-pipeline-model-parallel-size 1``).

Each training rank holds one stage: its layers under local names (``decoder.layers.i`` is global
layer ``layer_number - 1``), the embedding on the first stage, the final norm and the output
layer on the last (with tied embeddings the last stage's ``output_layer.weight`` is a duplicate
of the embedding, marked ``shared_embedding`` by megatron-core, and is not copied). Every rank's
copy needs every stage's weights, so each tensor is assembled whole by its stage (gathered over
that stage's TP group) and broadcast over the pipeline group, then cut to the rank's shard of the
copy. A plan exchanged once (which stage holds which tensor, its whole shape and dtype) lets the
other stages allocate the broadcast; every rank walks the plan in the same order.
"""

from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist

from megatron.rl.refit.collocated import (
    RefitStats,
    agreed_mismatches,
    gather_whole,
    place,
    whole_checksum,
    write_shard,
)
from megatron.rl.refit.tensor_parallel import ShardSpec, shard, shard_specs

LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..+)$")


def global_name(model: torch.nn.Module, name: str) -> str:
    """``name`` of this stage's ``model`` with its local layer index made global."""
    match = LAYER.match(name)
    if match is None:
        return name
    layer = model.get_submodule(f"{match.group(1)}{match.group(2)}")
    return f"{match.group(1)}{layer.layer_number - 1}{match.group(3)}"


class StageRefit:
    """The copy of ``source`` (this rank's stage and TP shard, of the TP group ``source_group``
    and the pipeline group ``stage_group``) into ``target`` (a whole model: this rank's shard of
    the copy, of the TP group ``target_group``); collective over both training groups.
    Its ``mismatches`` are as ``CollocatedRefit.mismatches``."""

    def __init__(
        self,
        source: torch.nn.Module,
        target: torch.nn.Module,
        source_group: dist.ProcessGroup | None,
        target_group: dist.ProcessGroup | None,
        gated_linear_unit: bool,
        stage_group: dist.ProcessGroup,
    ) -> None:
        self.group, self.stage_group = source_group, stage_group
        self.target_group = target_group
        self.target_rank, self.target_size = place(target_group)
        self.stage = place(stage_group)[0]
        self.device = next(source.parameters()).device
        specs, size = shard_specs(source, gated_linear_unit), place(source_group)[1]
        self.local: dict[str, torch.Tensor] = {}
        mine = []
        for name, param in source.named_parameters():
            if getattr(param, "shared_embedding", False) and "output_layer" in name:
                continue  # the tied output weight: the first stage's embedding is copied
            spec, shape = specs[name], list(param.shape)
            if spec.dim is not None:
                shape[spec.dim] *= size
            full = global_name(source, name)
            self.local[full] = param
            mine.append((full, tuple(shape), str(param.dtype).removeprefix("torch."), spec))
        plans: list = [None] * place(stage_group)[1]
        dist.all_gather_object(plans, mine, group=stage_group)
        self.plan: list[list[tuple[str, tuple, str, ShardSpec]]] = plans
        """Per stage, in stage order: (name in the copy, whole shape, dtype, spec)."""
        self.targets = dict(target.named_parameters())
        expected = [entry[0] for stage in self.plan for entry in stage]
        if sorted(self.targets) != sorted(expected):
            odd = sorted(set(self.targets) ^ set(expected))
            raise ValueError(f"the inference copy's parameters differ from the stages': {odd}")

    def _entries(self):
        """(stage, its global rank, name, whole shape, dtype, spec), in plan order."""
        for stage, entries in enumerate(self.plan):
            src = dist.get_global_rank(self.stage_group, stage)
            for name, shape, dtype, spec in entries:
                yield stage, src, name, shape, getattr(torch, dtype), spec

    @torch.no_grad()
    def __call__(self) -> RefitStats:
        """Copy every parameter of every stage; what it took."""
        start, received, tally = time.perf_counter(), 0, [0, 0, 0]  # unchanged, sampled, bytes
        for stage, src, name, shape, dtype, spec in self._entries():
            if stage == self.stage:
                full, got = gather_whole(self.local[name].detach(), spec, self.group)
                full = full.contiguous()
            else:
                full = torch.empty(shape, dtype=dtype, device=self.device)
                got = full.numel() * full.element_size()
            dist.broadcast(full, src, group=self.stage_group)
            received += got
            value = shard(full, spec, self.target_rank, self.target_size)
            counts = write_shard(self.targets[name], value, name)
            tally = [t + c for t, c in zip(tally, counts)]
        seconds = time.perf_counter() - start
        return RefitStats(seconds, received, tally[2], tally[0] / max(1, tally[1]))

    @torch.no_grad()
    def mismatches(self) -> list[str]:
        """The copy's tensors that differ from the stages' (collective over the world): each
        whole tensor's checksum, summed over its stage's TP group and broadcast from it,
        against the copy's, summed over the copy's TP group."""
        checksum, found, names = whole_checksum, [], []
        source_place = place(self.group)
        for stage, src, name, _, _, spec in self._entries():
            if stage == self.stage:
                theirs = checksum(self.local[name], spec, *source_place, self.group).reshape(1)
            else:
                theirs = torch.zeros(1, dtype=torch.int64, device=self.device)
            dist.broadcast(theirs, src, group=self.stage_group)
            dest = self.targets[name]
            ours = checksum(dest, spec, self.target_rank, self.target_size, self.target_group)
            found.append(int(theirs.item() != ours.item()))
            names.append(name)
        return agreed_mismatches(names, found, self.device)
