"""How each parameter of a megatron-core GPT is split over tensor-parallel ranks, and one layout's
shards -> another's.

megatron-core tags a split parameter with ``tensor_model_parallel`` and ``partition_dim``:
column-parallel weights and biases (``linear_qkv``, ``linear_fc1``, the output layer) and the
vocabulary embedding are split along dim 0, row-parallel weights (``linear_proj``,
``linear_fc2``) along dim 1; anything untagged (norms, row-parallel biases) is whole on every
rank. Concatenating the ranks' shards in rank order gives the TP=1 tensor, with one exception:
a gated (SwiGLU) ``linear_fc1`` holds ``[gate_r; up_r]`` on rank r, so its TP=1 tensor is
``[gate_0 .. gate_{t-1}; up_0 .. up_{t-1}]``. The query-group interleave of ``linear_qkv`` is
per group, and groups are contiguous per rank, so it needs nothing special.

Resharding never changes a value: TP=t -> TP=u -> TP=t is bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out over tensor-parallel ranks."""

    dim: int | None
    """The dimension it is split along (None: every rank holds it whole)."""
    gated: bool = False
    """Each rank's shard is ``[gate_r; up_r]`` (a gated ``linear_fc1``, split along dim 0)."""


def shard_specs(model: torch.nn.Module, gated_linear_unit: bool) -> dict[str, ShardSpec]:
    """The ``ShardSpec`` of every parameter of ``model``, by name (``gated_linear_unit``: the
    model's MLPs are gated, as ``TransformerConfig.gated_linear_unit``)."""
    specs = {}
    for name, param in model.named_parameters():
        split = getattr(param, "tensor_model_parallel", False)
        dim = getattr(param, "partition_dim", None) if split else None
        gated = gated_linear_unit and dim == 0 and ".linear_fc1." in name
        specs[name] = ShardSpec(dim, gated)
    return specs


def whole(parts: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The TP=1 tensor of the shards ``parts`` of every rank, in rank order."""
    if spec.dim is None:
        return parts[0]
    if spec.gated:
        halves = [p.chunk(2, dim=0) for p in parts]  # ([gate_r], [up_r]) per rank
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=spec.dim)


def shard(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard, of ``size`` ranks, of the TP=1 tensor ``full`` (a view)."""
    if spec.dim is None or size == 1:
        return full
    if full.shape[spec.dim] % (2 * size if spec.gated else size) != 0:
        raise ValueError(
            f"a tensor of shape {list(full.shape)} cannot be split over {size} "
            f"tensor-parallel ranks along dim {spec.dim}"
        )
    if spec.gated:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=spec.dim)[rank]


def global_indices(
    spec: ShardSpec, shape: torch.Size, rank: int, size: int, device: torch.device | None = None
) -> torch.Tensor:
    """The TP=1 flat index of every element of rank ``rank``'s shard of shape ``shape`` (of
    ``size`` ranks): ``shard`` of the whole tensor's ``arange`` (on ``device``)."""
    full = list(shape)
    if spec.dim is not None:
        full[spec.dim] *= size
    index = torch.arange(torch.Size(full).numel(), dtype=torch.int64, device=device).view(full)
    return shard(index, spec, rank, size)


def position_checksum(shard_: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """An int64 checksum of a shard's bits, each weighted by its TP=1 position (``index``): the
    sum over a layout's shards is the same for every layout, and it changes when a value moves.
    Integer sums wrap and do not depend on their order, so they compare exactly."""
    bits = shard_.detach().contiguous().view(-1)
    bits = bits.view(torch.int32 if bits.element_size() == 4 else torch.int16).to(torch.int64)
    weights = index.reshape(-1) * 1_000_003 + 7919
    return (bits * weights).sum()
